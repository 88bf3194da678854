"""Loading a model's tokenizer. The tokenizer pool encodes and renders chat templates
with transformers' fast tokenizer (load_tokenizer); the frontend only turns token ids
back into text, which the Rust tokenizer in tokenizer.json does alone (load_decoder),
and only looks at the chat templates' text (chat_template_text): it loads neither
transformers nor torch (3 s and 300 MB less per frontend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

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


class TokenStrings:
    """What logprobs show of one token: its text (special tokens as they are) and the
    bytes it stands for. A byte-level BPE token (GPT-2's, Llama 3's, Qwen's) or a
    SentencePiece byte-fallback token can hold part of a character, whose text alone
    is a replacement character; its bytes are the token's own, so that a client
    joining a reply's bytes gets its text back, as OpenAI's ``bytes`` promise. A
    SentencePiece word's text keeps its leading space. Vocabularies of other kinds
    show the token decoded alone."""

    def __init__(self, tokenizer) -> None:
        """``tokenizer``: a ``tokenizers.Tokenizer``."""
        self.tokenizer = tokenizer
        decoder = tokenizer.decoder
        decoders = _flat_decoders(None if decoder is None else json.loads(decoder.__getstate__()))
        kinds = {d.get("type") for d in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._metaspace = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and d.get("pattern") == {"String": "\u2581"}
            and d.get("content") == " " for d in decoders)
        self._byte_fallback = "ByteFallback" in kinds
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self.special = frozenset(i for i, t in added.items() if t.special)
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        if token_id in self._added or not (self._byte_level or self._metaspace):
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.raw(token_id).decode("utf-8", "replace")

    def raw(self, token_id: int) -> bytes:
        """The bytes the token stands for."""
        out = self._bytes.get(token_id)
        if out is None:
            out = self._bytes[token_id] = self._raw(token_id)
        return out

    def _raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None or token_id in self._added:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._metaspace:
            if (self._byte_fallback and len(piece) == 6 and piece.startswith("<0x")
                    and piece.endswith(">")):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _flat_decoders(decoder: Optional[dict]) -> list[dict]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [d for inner in decoder.get("decoders", []) for d in _flat_decoders(inner)]
    return [decoder]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters, each standing for one byte: printable Latin-1
    bytes stand for themselves, the other 68 for the characters from U+0100 on, in
    byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


_BYTE_LEVEL = _byte_level_alphabet()


# Fill-in-the-middle: the special tokens code models are trained to complete the
# middle of a file with, and the order of the prompt's parts they expect.
_FIM_PREFIX_SUFFIX_MIDDLE = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),     # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),            # StarCoder, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
_FIM_SUFFIX_PREFIX = ("[SUFFIX]", "[PREFIX]")                   # Codestral


def fill_in_the_middle(tokenizer) -> Optional[Callable[[str, str], str]]:
    """How the model's vocabulary asks for the text between a prefix and a suffix
    (the prompt's text, to which the model's completion is the middle), or None if
    it has no fill-in-the-middle tokens. ``tokenizer``: a ``tokenizers.Tokenizer``."""
    def has(*tokens: str) -> bool:
        return all(tokenizer.token_to_id(t) is not None for t in tokens)

    for pre, suf, mid in _FIM_PREFIX_SUFFIX_MIDDLE:
        if has(pre, suf, mid):
            return lambda prefix, suffix: f"{pre}{prefix}{suf}{suffix}{mid}"
    if has(*_FIM_SUFFIX_PREFIX):
        suf, pre = _FIM_SUFFIX_PREFIX
        return lambda prefix, suffix: f"{suf}{suffix}{pre}{prefix}"
    return None


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


# What a text config without a context length has, by its model_type (the defaults
# of transformers' config classes): Gemma 3's published multimodal configs leave it out.
_DEFAULT_CONTEXT = {"gemma3_text": 131072}


def context_length(model_dir: Path) -> int:
    """The context length config.json declares (max_position_embeddings or n_positions;
    a multimodal model's, its text_config's), as far as a YaRN scaling extends it (the
    original context times its factor) and the tokenizer pool needs it: the longest
    prompt it takes is so many tokens' characters. (The engine reads the context it
    serves with its model: engine_worker/models/config.py.)"""
    config = _json_object(model_dir / "config.json")
    text = config.get("text_config")
    if isinstance(text, dict):
        config = text
    length = next((config[key] for key in ("max_position_embeddings", "n_positions",
                                           "max_sequence_length")
                   if isinstance(config.get(key), int)),
                  _DEFAULT_CONTEXT.get(config.get("model_type")))
    if length is None:
        raise ModelLoadError(f"{model_dir}/config.json declares no context length")
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if (rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("factor"):
        original = rope.get("original_max_position_embeddings") or length
        length = max(length, int(original * rope["factor"]))
    return length
