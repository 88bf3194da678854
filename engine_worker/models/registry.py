"""The architectures served: Hugging Face's architecture name -> its spec
(models/spec.py), each made in its family's file, and llama.cpp's names for those a
GGUF file may hold; ``load_model_config`` reads a model folder's config by them.
Adding a family is its file and its line in FAMILIES.

``python -m engine_worker.models.registry`` prints the table of architectures that
docs/architecture.md holds (tests/unit/test_registry.py keeps them equal).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

from common.errors import ModelLoadError
from common.gguf_reader import GgufReader
from engine_worker.models import (gemma, gpt2, gpt_oss, granite, llama, mixtral, olmo2,
                                  phi3, qwen2, qwen3)
from engine_worker.models.config import ConfigSource, ModelConfig
from engine_worker.models.gguf import gguf_file
from engine_worker.models.quantization import checkpoint_format
from engine_worker.models.spec import Architecture, LanguageModel

logger = logging.getLogger(__name__)

FAMILIES = (llama, qwen2, qwen3, mixtral, granite, phi3, gemma, gpt_oss, gpt2, olmo2)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for family in FAMILIES for a in family.ARCHITECTURES}
# Multimodal checkpoints whose language model is served (text only)
LANGUAGE_MODELS: dict[str, LanguageModel] = {
    m.name: m for family in FAMILIES for m in getattr(family, "LANGUAGE_MODELS", ())}
# Where a multimodal checkpoint keeps its language model's tensors (prefixes stripped
# from their names, in order) and what else it holds, not read (the vision tower)
_LANGUAGE_MODEL_PLACES = {
    "checkpoint_prefixes": ("language_model.model.", "model.language_model.",
                            "language_model."),
    "checkpoint_skips": ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                         "model.multi_modal_projector.")}


def load_model_config(model_dir: Path, max_model_len: Optional[int] = None) -> ModelConfig:
    """max_model_len: the context to serve, where the user caps it (LongRoPE picks its
    factors by it)."""
    try:
        arch, raw, places = read_config(model_dir)
        source = ConfigSource(raw, str(model_dir.resolve().name),
                              _eos_token_ids(raw, model_dir), max_model_len)
        config = arch.read_config(source)
    except KeyError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'} lacks the field {e.args[0]!r}") \
            from None
    return dataclasses.replace(config, architecture=arch.name,
                               weight_format=checkpoint_format(raw), **places)


def read_config(model_dir: Path) -> tuple[Architecture, dict[str, Any], dict[str, Any]]:
    """A model folder's architecture, the config its reader takes (config.json; a
    multimodal checkpoint's text_config; a GGUF file's with what the family reads from
    its metadata besides), and the fields of the ModelConfig that say where its
    checkpoint keeps the tensors, where not the reader's."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{model_dir} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    gguf = gguf_file(model_dir)
    if gguf is not None:   # the config transformers read from the file, and the family's
        reader = GgufReader(gguf)
        arch = gguf_architecture(gguf.name, reader.fields)
        return arch, arch.gguf.read(raw, reader) if arch.gguf.read else raw, {}
    archs = raw.get("architectures") or []
    multimodal = next((LANGUAGE_MODELS[a] for a in archs if a in LANGUAGE_MODELS), None)
    if multimodal is not None:
        logger.info("%s: serving its language model (text only; the vision tower is not "
                    "loaded)", multimodal.name)
        return (ARCHITECTURES[multimodal.text_architecture],
                _language_model_config(raw, multimodal), _LANGUAGE_MODEL_PLACES)
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported architecture "
                             f"{archs or raw.get('model_type')!r}; supported: "
                             f"{', '.join(supported())}")
    return arch, raw, {}


def architecture(name: str) -> Architecture:
    return ARCHITECTURES[name]


def supported() -> list[str]:
    return sorted({*ARCHITECTURES, *LANGUAGE_MODELS})


def gguf_architecture(file_name: str, fields: dict[str, Any]) -> Architecture:
    """The architecture of a GGUF file's metadata (llama.cpp's name for it in
    general.architecture, and where several share that name, their own fields)."""
    name = fields.get("general.architecture")
    for arch in ARCHITECTURES.values():
        if arch.gguf is not None and arch.gguf.name == name and arch.gguf.matches(fields):
            return arch
    served = [a for a in ARCHITECTURES.values() if a.gguf is not None]
    names = list(dict.fromkeys(a.gguf.name for a in served))
    raise ModelLoadError(f"{file_name}: roseserve serves GGUF files of the "
                         f"{', '.join(names[:-1])} and {names[-1]} architectures "
                         f"({'; '.join(a.serves for a in served)}), not {name!r}")


def _language_model_config(raw: dict[str, Any], model: LanguageModel) -> dict[str, Any]:
    """A multimodal config's text_config, with the defaults its config class fills in
    (Gemma 3's published configs give a few fields and leave the rest to them)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{model.name}'s config has no text_config")
    import transformers

    full = getattr(transformers, model.config_class)(**text).to_dict()
    full["architectures"] = [model.text_architecture]
    if "quantization_config" in raw:   # (the checkpoint's, whole)
        full["quantization_config"] = raw["quantization_config"]
    return full


def _eos_token_ids(raw: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may list several)."""
    ids: list[int] = []
    sources = [raw]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            sources.append(json.loads(gen_path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen_path} is not valid JSON: {e}") from None
    for source in sources:
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def table() -> str:
    """The architectures served, as docs/architecture.md lists them (markdown)."""
    rows = ["| architecture | serves | family file | GGUF files |", "| --- | --- | --- | --- |"]
    for family in FAMILIES:
        file = f"`models/{family.__name__.rsplit('.', 1)[1]}.py`"
        for a in family.ARCHITECTURES:
            gguf = f"`{a.gguf.name}`" if a.gguf is not None else ""
            rows.append(f"| `{a.name}` | {a.serves} | {file} | {gguf} |")
        for m in getattr(family, "LANGUAGE_MODELS", ()):
            rows.append(f"| `{m.name}` | its language model (`{m.text_architecture}`), "
                        f"text only | {file} | |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
