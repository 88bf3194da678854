"""Serving a GGUF file's weights as they are, on the CPU kernels.

``--model FILE.gguf`` resolves to a folder made once from the file's metadata
(common/model_files.py: config, tokenizer, chat template, and gguf.json naming the
file); the weights stay in the file and are read from it here, at start:

- Q8_0 tensors are packed as the int8 format, Q4_0 and Q4_1 as the 4-bit one, their
  blocks copied unchanged (engine_worker/csrc/gemm.c: rs_pack_gguf), so every weight
  is what the file's own dequantization gives;
- F32 and BF16 linear layers are packed as float32 and bfloat16; F16 ones are widened
  to float32 (exactly: every half is a float);
- norms and the embedding rows are read as float32 (the embedding dequantized);
- a tensor of any other type (Q4_K, Q6_K, ...) is refused at start, by name, as is a
  tensor the architecture does not use, or q/k/v (gate/up) of different types, which
  one packed weight cannot hold.

llama.cpp's converter stores the rows of attn_q and attn_k permuted for its RoPE
(pairs of rotated dimensions interleaved); they are put back in Hugging Face's order
(halves) as whole rows, so blocks are untouched.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from common.errors import ModelLoadError
from common.model_files import GGUF_POINTER
from engine_worker.kernels import GGUF_FORMATS, CpuKernels

logger = logging.getLogger(__name__)

# Dense GGUF types (ggml's ids) and the packed format each becomes.
DENSE_FORMATS = {0: "float32", 1: "float32", 30: "bfloat16"}  # F32, F16 (widened), BF16
SERVED = "F32, F16, BF16, Q8_0, Q4_0 and Q4_1"


def gguf_file(model_dir: Path) -> Optional[Path]:
    """The GGUF file a model folder's weights are read from, or None (safetensors)."""
    pointer = model_dir / GGUF_POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["file"])


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that takes llama.cpp's RoPE layout of a q or k weight (each head's
    rotated pairs interleaved) back to Hugging Face's (each head's halves)."""
    head_dim = num_rows // num_heads
    return np.arange(num_rows).reshape(num_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


class GgufWeights:
    """The tensors of a GGUF file, taken once each by name."""

    def __init__(self, path: Path, kernels: CpuKernels) -> None:
        from gguf import GGUFReader

        self.path, self.kernels = path, kernels
        try:
            self.reader = GGUFReader(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.taken: set[str] = set()
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ModelLoadError(f"{path.name}: roseserve serves GGUF files of the llama "
                                 f"architecture (Llama, SmolLM, Mistral...), not {arch!r}")
        bad = [f"{t.name} ({t.tensor_type.name})" for t in self.reader.tensors
               if int(t.tensor_type) not in GGUF_FORMATS and
               int(t.tensor_type) not in DENSE_FORMATS]
        if bad:
            more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
            raise ModelLoadError(f"{path.name} has tensors in types roseserve cannot serve as "
                                 f"they are: {', '.join(bad[:6])}{more}; it serves {SERVED}")

    def field(self, key: str):
        f = self.reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if value.dtype == np.uint8 else value.tolist()[0]

    def _take(self, name: str):
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name} lacks tensor {name!r}")
        self.taken.add(name)
        return self.tensors[name]

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor as float32 (dequantized if it is in blocks)."""
        from gguf import quants

        t = self._take(name)
        values = quants.dequantize(np.asarray(t.data), t.tensor_type)
        if values.size != int(np.prod(shape)):
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} has {values.size} values, "
                                 f"expected shape {shape}")
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)

    def linear(self, names: list[str], in_features: int,
               heads: Optional[list[Optional[int]]] = None):
        """The tensors ``names``, rows stacked in that order (q, k, v; gate, up), as
        one PackedLinear in the format their type packs as. ``heads``: per tensor, its
        head count if its rows are in llama.cpp's RoPE order."""
        from gguf import quants

        from engine_worker.models import PackedLinear

        tensors = [self._take(n) for n in names]
        types = {int(t.tensor_type) for t in tensors}
        if len(types) > 1:
            listed = ", ".join(f"{t.name} ({t.tensor_type.name})" for t in tensors)
            raise ModelLoadError(f"{self.path.name}: {listed} are computed as one weight and "
                                 f"must share a type")
        ggml_type = types.pop()
        parts = []
        for t, h in zip(tensors, heads or [None] * len(tensors)):
            if int(t.shape[0]) != in_features:
                raise ModelLoadError(f"{self.path.name}: tensor {t.name!r} has "
                                     f"{int(t.shape[0])} inputs, expected {in_features}")
            rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            parts.append(rows[unpermute_rows(len(rows), h)] if h else rows)
        rows = np.ascontiguousarray(np.concatenate(parts))
        out_features = rows.shape[0]
        if ggml_type in GGUF_FORMATS:
            packed, fmt = self.kernels.pack_gguf(torch.from_numpy(rows), ggml_type,
                                                 out_features, in_features)
        else:
            fmt = DENSE_FORMATS[ggml_type]
            weight = torch.from_numpy(np.ascontiguousarray(
                quants.dequantize(rows, tensors[0].tensor_type), dtype=np.float32))
            packed = self.kernels.pack(weight.reshape(out_features, in_features), fmt)
        return PackedLinear.from_packed(self.kernels, packed, fmt, out_features, in_features)

    def finish(self) -> None:
        left = sorted(set(self.tensors) - self.taken - {"rope_freqs.weight"})
        if left:
            raise ModelLoadError(f"{self.path.name} has {len(left)} tensor(s) this "
                                 f"architecture does not use, e.g. {left[:3]}")


@torch.no_grad()
def load_gguf(model, path: Path, kernels: CpuKernels) -> None:
    """Fill a LlamaModel (built with empty weights) from a GGUF file: every linear
    layer packed from the file's blocks as they are."""
    w = GgufWeights(path, kernels)
    cfg = model.cfg
    c, i_size = cfg.hidden_size, cfg.intermediate_size
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ModelLoadError(f"{path.name}: linear layers with biases are not served from "
                             f"GGUF files")
    model.embed_tokens.weight.copy_(w.dense("token_embd.weight", (cfg.vocab_size, c)))
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = w.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                                 c, [cfg.num_heads, cfg.num_kv_heads, None])
        attn.o_proj = w.linear([p + "attn_output.weight"], cfg.num_heads * cfg.head_dim)
        mlp.gate_up_proj = w.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], c)
        mlp.down_proj = w.linear([p + "ffn_down.weight"], i_size)
        layer.input_layernorm.weight.copy_(w.dense(p + "attn_norm.weight", (c,)))
        layer.post_attention_layernorm.weight.copy_(w.dense(p + "ffn_norm.weight", (c,)))
    model.norm.weight.copy_(w.dense("output_norm.weight", (c,)))
    model.lm_head = w.linear(["output.weight" if "output.weight" in w.tensors
                              else "token_embd.weight"], c)
    w.finish()
    counts = Counter(t.tensor_type.name for t in w.reader.tensors)
    logger.info("weights: %s as they are (%s)", path.name,
                ", ".join(f"{n} {k}" for k, n in counts.most_common()))
