"""common/tokenizer.py's readings of a vocabulary: what logprobs show of one token
(TokenStrings), and how a code model asks for the middle of a file
(fill_in_the_middle); on GPT-2's real byte-level BPE and a SentencePiece vocabulary
with byte fallback."""

from __future__ import annotations

import json

import pytest

from common.tokenizer import TokenStrings, fill_in_the_middle, load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_gpt2_dir):
    return load_tokenizer(tiny_gpt2_dir).backend_tokenizer

TEXT = "héllo wörld 🌹, 你好\n\tq"


def sentencepiece_tokenizer():
    """Llama 2's kind: SentencePiece words (▁ for a space) with byte fallback
    (<0xNN> for what the vocabulary lacks), and a special token added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁", "h", "l", "o", "w", "r", "d", "q", ",", "▁h", "ll", "llo", "▁w"):
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l"), ("ll", "o"), ("▁", "w")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok


def test_a_tokens_bytes_are_its_own_and_join_into_the_text(tok):
    for backend, special in ((tok, "<|endoftext|>"), (sentencepiece_tokenizer(), "</s>")):
        strings = TokenStrings(backend)
        ids = backend.encode(TEXT).ids
        raw = [strings.raw(t) for t in ids]
        joined = b"".join(raw).decode()
        # SentencePiece adds a space before the first word, which its decoder drops.
        assert joined.removeprefix(" ") == TEXT, backend
        assert any(r and r[0] >= 0x80 and not _utf8(r) for r in raw)   # part of a character
        for t, r in zip(ids, raw):
            assert strings.text(t) == r.decode("utf-8", "replace")
        special_id = backend.token_to_id(special)
        assert strings.raw(special_id) == special.encode() and strings.text(special_id) == special
    # A SentencePiece word keeps its space (decoded alone, the space is stripped).
    sp = sentencepiece_tokenizer()
    word = sp.token_to_id("▁w")
    assert sp.decode([word]) == "w" and TokenStrings(sp).text(word) == " w"


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_fill_in_the_middle_follows_the_vocabularys_tokens(tok, tiny_coder_dir):
    from tokenizers import AddedToken

    coder = load_tokenizer(tiny_coder_dir).backend_tokenizer
    fim = fill_in_the_middle(coder)
    assert fim("def f(", "):\n") == "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>"
    assert fill_in_the_middle(tok) is None   # GPT-2 has no such tokens
    # Codestral's order: the suffix first.
    sp = sentencepiece_tokenizer()
    sp.add_special_tokens([AddedToken("[SUFFIX]", special=True),
                           AddedToken("[PREFIX]", special=True)])
    assert fill_in_the_middle(sp)("a", "b") == "[SUFFIX]b[PREFIX]a"


def test_the_pools_context_length_reads_text_configs_and_yarn(
        tiny_gemma3_vision_dir, tiny_yarn_dir, tiny_llama_dir, tmp_path):
    """The tokenizer pool sizes its longest prompt by it: a multimodal model's is its
    text_config's (it did not start for one: 'declares no context length'), Gemma 3's
    published configs leave it to the class's default, and YaRN extends it as the
    engine serves it (its prompts past max_position_embeddings were refused)."""
    from common.tokenizer import context_length

    assert context_length(tiny_llama_dir) == 512
    assert context_length(tiny_gemma3_vision_dir) == 512
    assert context_length(tiny_yarn_dir) == 4 * 128
    published = tmp_path / "gemma-3-4b"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}}))
    assert context_length(published) == 131072
