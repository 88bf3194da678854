"""Loading a model's fast (Rust) tokenizer; shared by the tokenizer pool and the
frontend (which only decodes)."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import ModelLoadError

# Text longer than this many characters per token of context cannot fit, whatever it
# encodes to: it is refused before encoding (a cheap guard against absurd inputs).
MAX_CHARS_PER_TOKEN = 16


def load_tokenizer(model_dir: Path):
    """A transformers fast tokenizer (its ``backend_tokenizer`` is the Rust one)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds for a broken folder
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{model_dir} has no fast tokenizer (tokenizer.json)")
    return tokenizer


def context_length(model_dir: Path) -> int:
    """The context length config.json declares (max_position_embeddings or n_positions)."""
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ModelLoadError(f"{model_dir}/config.json declares no context length")
