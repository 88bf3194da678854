"""The OpenAI-compatible HTTP frontend. It never runs the model."""
