"""Loading a model's tokenizer. The tokenizer pool encodes and renders chat templates
with transformers' fast tokenizer (load_tokenizer); the frontend only turns token ids
back into text, which the Rust tokenizer in tokenizer.json does alone (load_decoder),
and only looks at the chat templates' text (chat_template_text): it loads neither
transformers nor torch (3 s and 300 MB less per frontend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from common.config import env_default
from common.errors import ModelLoadError

# Text longer than this many characters per token of context cannot fit, whatever it
# encodes to: it is refused before encoding (a cheap guard against absurd inputs).
MAX_CHARS_PER_TOKEN = 16


# Tokenizers saved as transformers' generic fast class (the default model's, and what
# transformers 5 saves for most) are loaded as that class, not through AutoTokenizer:
# importing AutoTokenizer brings torch and transformers' model configuration code in,
# 2 of a tokenizer worker's 3 s to start. Any other class goes through AutoTokenizer,
# which also picks one for a folder that names none.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path):
    """A transformers fast tokenizer (its ``backend_tokenizer`` is the Rust one)."""
    try:
        config = _json_object(model_dir / "tokenizer_config.json")
        if config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast as loader
        else:
            from transformers import AutoTokenizer as loader
        tokenizer = loader.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds for a broken folder
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{model_dir} has no fast tokenizer (tokenizer.json)")
    return tokenizer


def load_decoder(model_dir: Path):
    """The ``tokenizers.Tokenizer`` of the model's tokenizer.json: the one transformers'
    fast tokenizer wraps (its ``backend_tokenizer``)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no fast tokenizer (tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library's errors have no common type
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e


def chat_template_text(model_dir: Path) -> Optional[str]:
    """Every chat template the folder holds, one after the other (None: none), from
    where transformers reads them: chat_template.jinja, additional_chat_templates/,
    chat_template.json and tokenizer_config.json."""
    texts = [p.read_text() for p in (model_dir / "chat_template.jinja",
                                     *sorted((model_dir / "additional_chat_templates").glob("*.jinja")))
             if p.is_file()]
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = _json_object(model_dir / name).get("chat_template")
        if isinstance(template, str):
            texts.append(template)
        elif isinstance(template, list):  # named templates: [{"name", "template"}]
            texts.extend(t["template"] for t in template
                         if isinstance(t, dict) and isinstance(t.get("template"), str))
    return "\n".join(texts) if texts else None


def _json_object(path: Path) -> dict:
    """A JSON file's object ({} if there is no such file)."""
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as e:
        raise ModelLoadError(f"{path} is not a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return value


def add_chat_template_arg(parser) -> None:
    """--chat-template, for the tokenizer pool (which renders chats) and the frontend
    (which reads how the template writes tool calls): give both the same file."""
    parser.add_argument("--chat-template", default=env_default("CHAT_TEMPLATE"),
                        metavar="FILE",
                        help="a Jinja chat template to use instead of the model's (for a "
                             "model without one, or to fix one); the tokenizer pool and "
                             "the frontend must be given the same file")


def read_chat_template(path: str) -> str:
    """A chat template from a file (--chat-template), checked to parse as Jinja.
    Raises ModelLoadError naming the file and, for bad syntax, the line."""
    import jinja2

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read the chat template {path}: {e}") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the chat template {path} is not a valid Jinja template: "
                             f"line {e.lineno}: {e.message}") from None
    return text


def context_length(model_dir: Path) -> int:
    """The context length config.json declares (max_position_embeddings or n_positions)."""
    config = _json_object(model_dir / "config.json")
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ModelLoadError(f"{model_dir}/config.json declares no context length")
