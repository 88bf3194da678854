"""Serving a GGUF file's weights as they are, on the CPU kernels.

``--model FILE.gguf`` resolves to a folder made once from the file's metadata
(common/model_files.py: config, tokenizer, chat template, and gguf.json naming the
file; the family's GGUF reading adds what transformers' reading of the metadata
misses: models/spec.py, GgufSpec); the weights stay in the file and are read from it
here, at start, by our modules' names in it (GGUF_NAMES, and the family's own):

- Q8_0 tensors are packed as the int8 format, Q4_0 and Q4_1 as the 4-bit one, IQ4_NL
  and IQ4_XS as the IQ4 one (nibbles indexing 16 fixed levels, a float scale per 32
  weights: IQ4_XS's super-block factor times its sub-block's 6-bit one, exactly), MXFP4
  (gpt-oss's experts) as the MXFP4 one (IQ4's of FP4's levels, doubled, and half the
  block's power-of-two scale), their blocks copied unchanged
  (engine_worker/cpu/csrc/gemm.c: rs_pack_gguf), so every weight is what the file's own
  dequantization gives;
- F32 and BF16 linear layers are packed as float32 and bfloat16; F16 ones are widened
  to float32 (exactly: every half is a float);
- the other types of llama.cpp's files, which most users download (its Q4_K_M of the
  default model holds Q5_0, Q4_K, Q6_K and Q8_0 tensors), are re-stored at start as
  one of those: Q5_0 as Q8_0 blocks, exactly (its 5-bit values less 16 are int8 values
  of the same scale); Q4_K as Q4_1 blocks, the 4-bit values unchanged and each
  32-weight sub-block's scale and offset (its super-block's half-precision factor times
  a 6-bit one) rounded to half precision; every other block type the gguf package
  dequantizes (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, the other IQ and TQ types...) as Q8_0
  blocks, requantized from its values (an error of at most half a step of 127 per
  block of 32: 1/254 of its largest weight; 1.06 bytes a weight, more than the file's;
  models/gguf_types.py);
- norms and the embedding rows are read as float32 (the embedding dequantized);
- q, k and v (gate and up), one packed weight, whose types pack as different formats
  (llama.cpp's mixes give v more bits) are all made Q8_0: exactly where each block's
  values are int8 values of its scale (Q4_0, IQ4_NL, Q5_0, MXFP4), else requantized;
- a tensor of any other type (Q8_K, integers...) is refused at start, by name, as is
  a tensor the architecture does not use, q/k/v mixing dense and block types, or one
  part of a split file (llama-gguf-split joins them).

The architectures whose files are served are the registry's (models/registry.py); q, k
and v biases, qwen3's and gemma3's q and k norms and Gemma's norms of each layer's outputs
are read as float32 (llama.cpp's converter stores Gemma's norms as the 1 + weight they
scale by), the experts of qwen2moe, qwen3moe and Mixtral (llama with experts) each as a
linear layer of its rows of the tensors that hold them all (ffn_gate_exps, ffn_up_exps,
ffn_down_exps), qwen2moe's shared expert and its gate as tensors of their own, and a
RoPE scaling from the file (rope_scaling below), which the folder's config does not
hold, divides the model's frequencies (gemma3's: its full layers'). Rows a family's
files store in another order than Hugging Face's (llama's q and k, permuted for
llama.cpp's RoPE) are put back as whole rows, so blocks are untouched
(GgufSpec.qkv_orders).
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

from common.errors import ModelLoadError
from common.gguf_reader import GgufReader, ggml_type_name
from common.model_files import GGUF_POINTER
from engine_worker.cpu.kernels import GGUF_FORMATS, CpuKernels
from engine_worker.models.gguf_types import (DENSE_FORMATS, PANEL, Q8_0, as_q8_0, in_chunks,
                                             restored_types, served)
from engine_worker.models.layers.linear import Linear, WeightFormats
from engine_worker.models.layers.parallel import Shard
from engine_worker.models.names import TensorNames

if TYPE_CHECKING:
    from engine_worker.models.spec import Architecture

logger = logging.getLogger(__name__)

# Our modules' tensors in llama.cpp's files, as every architecture's name them (a
# family's GgufSpec.names add to them); a layer's experts are each one's rows of
# tensors that hold them all (the expert's index left over: names.py)
GGUF_NAMES = {
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "layers": "blk",
    "layers.*.input_layernorm": "blk.*.attn_norm",
    "layers.*.self_attn.qkv_proj": ("blk.*.attn_q", "blk.*.attn_k", "blk.*.attn_v"),
    "layers.*.self_attn.o_proj": "blk.*.attn_output",
    "layers.*.self_attn.q_norm": "blk.*.attn_q_norm",
    "layers.*.self_attn.k_norm": "blk.*.attn_k_norm",
    "layers.*.self_attn.sinks": "blk.*.attn_sinks.weight",
    "layers.*.post_attention_layernorm": "blk.*.ffn_norm",
    "layers.*.attn_out_norm": "blk.*.post_attention_norm",
    "layers.*.mlp_out_norm": "blk.*.post_ffw_norm",
    "layers.*.mlp.gate_up_proj": ("blk.*.ffn_gate", "blk.*.ffn_up"),
    "layers.*.mlp.down_proj": "blk.*.ffn_down",
    "layers.*.mlp.gate": "blk.*.ffn_gate_inp",
    "layers.*.mlp.experts.*.gate_up_proj": ("blk.*.ffn_gate_exps", "blk.*.ffn_up_exps"),
    "layers.*.mlp.experts.*.down_proj": "blk.*.ffn_down_exps",
    "layers.*.mlp.shared_expert.gate_up_proj": ("blk.*.ffn_gate_shexp", "blk.*.ffn_up_shexp"),
    "layers.*.mlp.shared_expert.down_proj": "blk.*.ffn_down_shexp",
    "layers.*.mlp.shared_expert_gate": "blk.*.ffn_gate_inp_shexp",
}


def gguf_file(model_dir: Path) -> Optional[Path]:
    """The GGUF file a model folder's weights are read from, or None (safetensors)."""
    pointer = model_dir / GGUF_POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["file"])


class Packed(NamedTuple):
    """A weight as the CPU kernels compute with it, in ``fmt``."""
    packed: torch.Tensor
    fmt: str
    out_features: int
    in_features: int


class GgufWeights:
    """The tensors of a GGUF file, taken once each by name."""

    def __init__(self, path: Path, kernels: CpuKernels) -> None:
        self.path, self.kernels = path, kernels
        self.reader = GgufReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.taken: set[str] = set()
        self._stacked: dict[str, torch.Tensor] = {}   # experts' biases, by name
        splits = self.reader.fields.get("split.count", 1)
        if splits > 1:
            raise ModelLoadError(f"{path.name} is one of {splits} parts of a split GGUF "
                                 f"file; join them first (llama.cpp's llama-gguf-split "
                                 f"--merge FIRST_PART OUT.gguf) and serve the whole file")
        self.architecture = self.reader.fields.get("general.architecture")
        experts = self.reader.fields.get(f"{self.architecture}.expert_count", 0)
        if experts and "blk.0.ffn_gate_exps.weight" not in self.tensors:
            raise ModelLoadError(f"{path.name} is a mixture of experts ({experts} experts a "
                                 f"layer) that stores each expert as tensors of its own "
                                 f"(blk.N.ffn_gate.E.weight: llama.cpp's layout before "
                                 f"2024); convert its checkpoint again, which stores a "
                                 f"layer's experts together (blk.N.ffn_gate_exps.weight)")
        self.restored = restored_types()
        known = {*GGUF_FORMATS, *DENSE_FORMATS, *self.restored}
        bad = [f"{t.name} ({t.type_name})" for t in self.reader.tensors
               if t.ggml_type not in known]
        if bad:
            more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
            raise ModelLoadError(f"{path.name} has tensors in types roseserve cannot serve as "
                                 f"they are: {', '.join(bad[:6])}{more}; it serves {served()}")

    def take(self, name: str):
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name} lacks tensor {name!r}")
        self.taken.add(name)
        return self.tensors[name]

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor as float32 (dequantized if it is in blocks)."""
        from gguf import quants

        t = self.take(name)
        values = quants.dequantize(t.data, t.ggml_type)
        if values.size != int(np.prod(shape)):
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} has {values.size} values, "
                                 f"expected shape {shape}")
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)

    def rows(self, name: str, size: int, expert: Optional[int] = None) -> torch.Tensor:
        """A bias (size,) as float32, or of a tensor holding every expert's (E, size),
        the expert's (the tensor read once for them all)."""
        if expert is None:
            return self.dense(name, (size,))
        if name not in self._stacked:
            from gguf import quants

            t = self.take(name)
            values = quants.dequantize(t.data, t.ggml_type)
            self._stacked[name] = torch.from_numpy(
                np.array(values, dtype=np.float32)).reshape(-1, size)
        return self._stacked[name][expert]

    def pack(self, names: list[str], in_features: int,
             orders: Optional[list[Optional[np.ndarray]]] = None,
             expert: Optional[int] = None, shard: Optional[Shard] = None,
             sizes: tuple[int, ...] = ()) -> Packed:
        """The tensors ``names``, rows stacked in that order (q, k, v; gate, up), as
        one packed weight in the format their type packs as. ``orders``: per tensor, the
        order to take its rows in, or None (as they are). ``expert``: of tensors
        holding every expert of a mixture (ffn_gate_exps...), that expert's rows.
        ``shard``: a tensor-parallel rank's part (of the layer's parts ``sizes``): its
        rows, or its columns on the tensors' block boundaries. Tensors of types that pack as different formats (llama.cpp's mixes give v more
        bits than q and k), or as one format but not in whole panels each, are all made
        Q8_0 (int8): as_q8_0."""
        from gguf import quants

        tensors = [self.take(n) for n in names]
        parts, types = [], []
        for t, order in zip(tensors, orders or [None] * len(tensors)):
            if t.shape[0] != in_features:
                raise ModelLoadError(f"{self.path.name}: tensor {t.name!r} has "
                                     f"{t.shape[0]} inputs, expected {in_features}")
            data = t.data if expert is None else t.data.reshape(t.shape[2], -1,
                                                                t.data.shape[1])[expert]
            parts.append(data if order is None else data[order])
            types.append(t.ggml_type)
        if shard is not None:
            parts, types, in_features = self._shard(parts, types, in_features, shard, sizes)
        packs_as = [self.restored.get(g, (g,))[0] for g in types]
        formats = {GGUF_FORMATS.get(g) or DENSE_FORMATS[g] for g in packs_as}
        dense = formats & set(DENSE_FORMATS.values())
        if dense and dense != formats:
            listed = ", ".join(f"{t.name} ({t.type_name})" for t in tensors)
            raise ModelLoadError(f"{self.path.name}: {listed} are computed as one weight "
                                 f"and must all be dense or all in blocks")
        if len(dense) > 1:   # BF16 beside F32 or F16: all widened to float32
            formats = {"float32"}
        # types of one format are packed apart, each of rows in whole panels (but the
        # last); dense ones are widened to float32 apart anyway
        whole_panels = not any(len(rows) % PANEL for rows in parts[:-1])
        if not dense and (len(formats) > 1 or (len(set(packs_as)) > 1 and not whole_panels)):
            parts = [in_chunks(rows, functools.partial(as_q8_0, ggml_type=g))
                     for rows, g in zip(parts, types)]
            packs_as, formats = [Q8_0] * len(types), {"int8"}
            logger.info("%s: %s are one int8 weight (Q8_0)", self.path.name,
                        ", ".join(f"{t.name} ({t.type_name})" for t in tensors))
        else:
            parts = [in_chunks(rows, self.restored[g][1]) if g in self.restored else rows
                     for rows, g in zip(parts, types)]
        out_features, fmt = sum(len(rows) for rows in parts), formats.pop()
        if dense:
            weight = np.concatenate([quants.dequantize(rows, g)
                                     for rows, g in zip(parts, types)]).astype(np.float32)
            packed = self.kernels.pack(torch.from_numpy(weight).reshape(out_features,
                                                                        in_features), fmt)
        elif len(set(packs_as)) == 1:
            packed, _ = self.kernels.pack_gguf(torch.from_numpy(np.concatenate(parts)),
                                               packs_as[0], out_features, in_features)
        else:   # one format from types of its own (Q4_0 and Q4_1, IQ4_NL and IQ4_XS)
            packed = torch.cat([self.kernels.pack_gguf(torch.from_numpy(np.array(rows)), g,
                                                       len(rows), in_features)[0]
                                for rows, g in zip(parts, packs_as)])
        return Packed(packed, fmt, out_features, in_features)

    def _shard(self, parts: list, types: list[int], in_features: int, shard: Shard,
               sizes: tuple[int, ...]) -> tuple[list, list[int], int]:
        """A rank's part of a layer's tensors (``sizes``: the layer's parts; one tensor
        may hold them all, as Phi-3's fused q/k/v)."""
        from gguf.constants import GGML_QUANT_SIZES

        if shard.rows is not None:
            if len(parts) == 1 and len(sizes) > 1:
                bounds = np.cumsum(sizes)[:-1]
                parts, types = np.split(parts[0], bounds), types * len(sizes)
            parts = [rows[s] for rows, s in zip(parts, shard.rows)]
        if shard.cols is not None:
            cols = shard.cols
            out = []
            for rows, g in zip(parts, types):
                block = GGML_QUANT_SIZES[g][0]
                if cols.start % block or cols.stop % block:
                    raise ModelLoadError(
                        f"{self.path.name}: a {ggml_type_name(g)} tensor's blocks of {block} "
                        f"inputs do not split at input {cols.start}-{cols.stop} for this "
                        f"tensor-parallel rank; serve it over fewer ranks")
                per_block = rows.shape[1] // (in_features // block)   # (bytes, or values)
                out.append(rows[:, cols.start // block * per_block:
                                cols.stop // block * per_block])
            parts, in_features = out, cols.stop - cols.start
        return parts, types, in_features

    def finish(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            raise ModelLoadError(f"{self.path.name} has {len(left)} tensor(s) this "
                                 f"architecture does not use, e.g. {left[:3]}")


def rope_scaling(w: GgufWeights, head_dim: int) -> torch.Tensor:
    """What divides each RoPE frequency (head_dim // 2,). llama.cpp's converter stores
    Llama 3.1's scaling (Llama 3.2, 3.3) as that factor per frequency, the tensor
    rope_freqs.weight, and a linear one as {arch}.rope.scaling.type and .factor;
    transformers' reading of the file into a config keeps neither. YaRN's is in the
    config the file's folder holds (common/model_files.py: _yarn_parameters), so the
    model's RoPE has it already. Other types (longrope) are refused, as in a Hugging
    Face folder."""
    kind = w.reader.fields.get(f"{w.architecture}.rope.scaling.type", "none")
    factors = torch.ones(head_dim // 2)
    if "rope_freqs.weight" in w.tensors:
        factors = w.dense("rope_freqs.weight", (head_dim // 2,))
    if kind == "linear":
        factors = factors * w.reader.fields.get(f"{w.architecture}.rope.scaling.factor", 1.0)
    elif kind not in ("none", "yarn"):
        raise ModelLoadError(f"{w.path.name}: unsupported rope scaling {kind!r}; supported: "
                             f"linear, yarn, and llama3 (rope_freqs.weight)")
    return factors


def load_gguf(model: nn.Module, path: Path, arch: Architecture, formats: WeightFormats) -> None:
    """Fill a decoder (built with empty weights) from a GGUF file: every linear layer
    packed from the file's blocks, as they are or re-stored (restored_types), the rest
    read as float32."""
    if formats.packing is None:
        raise ModelLoadError("a GGUF file is served by the CPU C kernels (--device cpu, "
                             "float32, a C compiler)")
    cfg = model.cfg
    w = GgufWeights(path, formats.packing.kernels)
    names = TensorNames({**GGUF_NAMES, **arch.gguf.names}, {})
    if "output.weight" not in w.tensors:   # tied: packed from the file's own embedding
        names.rules["lm_head"] = ("token_embd",)
    qkv_orders = arch.gguf.qkv_orders(cfg) if arch.gguf.qkv_orders is not None else None

    def load(path: str, module: nn.Module) -> None:
        if isinstance(module, Linear):
            parts, expert = names(path)
            orders = qkv_orders if path.endswith("self_attn.qkv_proj") else None
            _load_linear(module, w, parts, orders, expert[0] if expert else None,
                         formats.packing)
            return
        shards = getattr(module, "shards", {})   # (split over ranks: models/loader.py)
        for name, param in module.named_parameters(recurse=False):
            shape, rows = shards.get(name, (tuple(param.shape), slice(None)))
            param.copy_(w.dense(names(f"{path}.{name}")[0][0], shape)[rows])
        for name, child in module.named_children():
            load(f"{path}.{name}", child)

    for name, child in model.named_children():
        load(name, child)
    model.rotary.inv_freq = model.rotary.inv_freq / rope_scaling(w, cfg.head_dim)
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in w.tensors:   # phi3's LongRoPE: in the config (models/phi3.py)
            w.take(name)
    # Gemma's embedding scale into the embeddings (its norms are stored as the 1 + weight
    # they scale by); the lm_head, packed from the file's own embedding, keeps it
    # unscaled
    model.fold_scales(tied=False)
    w.finish()
    counts = Counter(t.ggml_type for t in w.reader.tensors)
    kept = ", ".join(f"{n} {ggml_type_name(k)}" for k, n in counts.most_common()
                     if k not in w.restored)
    restored = "".join(f"; {n} {ggml_type_name(k)} re-stored as {w.restored[k][2]}"
                       for k, n in counts.most_common() if k in w.restored)
    logger.info("weights: %s, as they are: %s%s", path.name, kept, restored)


def _load_linear(linear: Linear, w: GgufWeights, parts: tuple[str, ...],
                 orders: Optional[list], expert: Optional[int], packing) -> None:
    packed = w.pack([f"{p}.weight" for p in parts], linear.full_in, orders, expert,
                    linear.shard, linear.full_sizes)
    if packed.out_features != linear.out_features:
        raise ModelLoadError(f"{w.path.name}: {', '.join(parts)} have {packed.out_features} "
                             f"rows, expected {linear.out_features}")
    linear.load_packed(packed.packed, packing.method(packed.fmt))
    if linear.bias is None:
        return
    sizes = (sum(linear.full_sizes),) if len(parts) == 1 else linear.full_sizes
    linear.load_bias(torch.cat([w.rows(f"{p}.bias", rows, expert)
                                for p, rows in zip(parts, sizes)]))

