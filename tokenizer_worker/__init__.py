"""The tokenizer pool: text and chat messages in, prompt_token_ids out."""
