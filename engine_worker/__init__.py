"""The engine worker: token ids in, token ids out. Never touches text."""
