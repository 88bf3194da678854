"""Serving a GGUF file's weights as they are, on the CPU kernels.

``--model FILE.gguf`` resolves to a folder made once from the file's metadata
(common/model_files.py: config, tokenizer, chat template, and gguf.json naming the
file); the weights stay in the file and are read from it here, at start:

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
  block of 32: 1/254 of its largest weight; 1.06 bytes a weight, more than the file's);
- norms and the embedding rows are read as float32 (the embedding dequantized);
- q, k and v (gate and up), one packed weight, whose types pack as different formats
  (llama.cpp's mixes give v more bits) are all made Q8_0: exactly where each block's
  values are int8 values of its scale (Q4_0, IQ4_NL, Q5_0, MXFP4), else requantized;
- a tensor of any other type (Q8_K, integers...) is refused at start, by name, as is
  a tensor the architecture does not use, q/k/v mixing dense and block types, or one
  part of a split file (llama-gguf-split joins them).

Files of the llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3 and gpt-oss
architectures are served (common/model_files.py: GGUF_ARCHITECTURES); qwen2's q, k and
v biases, qwen3's and gemma3's q and k norms and Gemma's norms of each layer's outputs
are read as float32 (llama.cpp's converter stores Gemma's norms as the 1 + weight they
scale by), the experts of qwen2moe, qwen3moe and Mixtral (llama with experts) each as a
PackedLinear of its rows of the tensors that hold them all (ffn_gate_exps, ffn_up_exps,
ffn_down_exps), qwen2moe's shared expert and its gate as tensors of their own, and a
RoPE scaling from the file (rope_scaling below), which the folder's config does not
hold, divides the model's frequencies (gemma3's: its full layers'). For the llama
architecture llama.cpp's converter stores the rows of attn_q and attn_k permuted for
its RoPE (pairs of rotated dimensions interleaved); they are put back in Hugging Face's
order (halves) as whole rows, so blocks are untouched. The others' RoPE is Hugging
Face's: their rows are stored as they are.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from common.errors import ModelLoadError
from common.gguf_reader import GgufReader, ggml_type_name, unpermute_rows
from common.model_files import GGUF_ARCHITECTURES, GGUF_POINTER, unserved_gguf_architecture
from engine_worker.cpu.kernels import GGUF_FORMATS, CpuKernels

logger = logging.getLogger(__name__)

# Dense GGUF types (ggml's ids) and the packed format each becomes.
DENSE_FORMATS = {0: "float32", 1: "float32", 30: "bfloat16"}  # F32, F16 (widened), BF16
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, IQ4_NL, MXFP4 = 2, 3, 6, 8, 12, 20, 39
PANEL = 16   # output rows of a packed panel (gemm.c)


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The half-precision field at byte ``at`` of each block, as float32."""
    return blocks[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def q5_0_as_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (a half scale d, 32 fifth bits, 16 bytes of nibbles; weight
    d (q - 16)) as Q8_0 blocks (d, then q - 16 as int8): the same weights exactly."""
    blocks = rows.reshape(-1, 22)
    qh = blocks[:, 2:6].copy().view("<u4")
    qs = blocks[:, 6:22]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)   # values 0..15, 16..31
    q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = (q - 16).astype(np.int8).view(np.uint8)
    return out.reshape(len(rows), -1)


def q4_k_as_q4_1(rows: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks of 256 (half d and dmin, 8 pairs of 6-bit scale and min, 128
    bytes of nibbles; weight d sc q - dmin m) as eight Q4_1 blocks (half d', half m,
    16 bytes of nibbles; weight d' q + m): the 4-bit values as they are, d sc and
    -dmin m rounded to half precision."""
    blocks = rows.reshape(-1, 144)
    d, dmin = _halves(blocks, 0), _halves(blocks, 2)
    s = blocks[:, 4:16].astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)   # 4 chunks: sub-blocks 2c (low), 2c + 1 (high)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    out = np.empty((len(blocks), 8, 20), dtype=np.uint8)
    out[:, :, 0:2] = (d[:, None] * sc).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 2:4] = (-dmin[:, None] * mn).astype(np.float16)[..., None].view(np.uint8)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(len(rows), -1)


def mxfp4_as_q8_0(rows: np.ndarray) -> np.ndarray:
    """MXFP4 rows (gpt-oss's experts; blocks of 32: a power-of-two scale byte e, then
    16 bytes of nibbles, weights 0-15 low and 16-31 high, each indexing FP4 values)
    as Q8_0, exactly: ggml's doubled FP4 values {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}
    are int8 values of the scale 2^(e - 128), which half precision holds for e from
    104 to 143; blocks of other scales are requantized."""
    from gguf import quants

    blocks = rows.reshape(-1, 17)
    e, qs = blocks[:, 0].astype(np.int32), blocks[:, 1:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    out[:, :2] = np.ldexp(np.float32(1), e - 128).astype(np.float16)[:, None].view(np.uint8)
    out[:, 2:] = np.array(quants.MXFP4.kvalues, dtype=np.int8)[q].view(np.uint8)
    odd = (e < 104) | (e > 143)
    if odd.any():
        out[odd] = requantized_as_q8_0(rows.reshape(-1, 17)[odd], MXFP4).reshape(-1, 34)
    return out.reshape(len(rows), -1)


def requantized_as_q8_0(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Rows of another block type (gguf's own dequantization of them) requantized as
    Q8_0: per block of 32, the scale d = largest |weight| / 127 rounded to half
    precision first and each weight round(w / d), so that no weight is off by more
    than half of d."""
    from gguf import quants

    values = quants.dequantize(rows, ggml_type).reshape(-1, 32)
    d = (np.abs(values).max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    q = np.divide(values, d32, out=np.zeros_like(values), where=d32 > 0)
    out = np.empty((len(values), 34), dtype=np.uint8)
    out[:, :2] = d[:, None].view(np.uint8)
    out[:, 2:] = np.clip(np.rint(q), -127, 127).astype(np.int8).view(np.uint8)
    return out.reshape(len(rows), -1)


def _dequantizable(ggml_type) -> bool:
    """Whether the gguf package dequantizes blocks of this type (its versions add
    types)."""
    from gguf import GGML_QUANT_SIZES, quants

    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[ggml_type][1]), np.uint8), ggml_type)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


@functools.cache
def restored_types() -> dict:
    """Types re-stored at load: ggml id -> (the type they become, how, in words): two
    of our own, then every other block type (more than one weight a block) that the
    gguf package dequantizes, requantized."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    restored = {Q5_0: (Q8_0, q5_0_as_q8_0, "Q8_0, exactly"),
                Q4_K: (Q4_1, q4_k_as_q4_1, "Q4_1, sub-block scales rounded to half precision")}
    for t in GGMLQuantizationType:
        if (GGML_QUANT_SIZES[t][0] > 1 and int(t) not in restored
                and int(t) not in GGUF_FORMATS and _dequantizable(t)):
            restored[int(t)] = (Q8_0, functools.partial(requantized_as_q8_0, ggml_type=t),
                                "Q8_0, requantized")
    return restored


def served() -> str:
    """The types a GGUF file's tensors may have, in words."""
    names = ", ".join(ggml_type_name(t) for t in restored_types())
    return (f"F32, F16, BF16, Q8_0, Q4_0, Q4_1, IQ4_NL, IQ4_XS and MXFP4 as they are, and "
            f"{names} re-stored")


def as_q8_0(rows: np.ndarray, ggml_type: int) -> np.ndarray:
    """Rows of blocks of ``ggml_type`` as Q8_0 blocks: as they are (Q8_0), exactly where
    each block's values are int8 values of its scale (Q4_0: q - 8; IQ4_NL: its levels;
    Q5_0: re-stored so anyway; MXFP4: its levels doubled), else requantized from the
    file's values."""
    from gguf import quants

    restored = restored_types().get(ggml_type)
    if ggml_type == Q8_0:
        return rows
    if ggml_type == MXFP4:
        return mxfp4_as_q8_0(rows)
    if restored is not None and restored[0] == Q8_0:
        return restored[1](rows)
    if ggml_type not in (Q4_0, IQ4_NL):
        return requantized_as_q8_0(rows, ggml_type)
    blocks = rows.reshape(-1, 18)   # a half scale d, then 16 bytes of nibbles
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)   # weights 0-15, then 16-31
    values = (np.array(quants.IQ4_NL.kvalues, dtype=np.int8)[q] if ggml_type == IQ4_NL
              else q.astype(np.int8) - 8)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = values.view(np.uint8)
    return out.reshape(len(rows), -1)


# Bytes of blocks re-stored at a time: at most ~5 weights a byte (IQ1_S), so the
# temporary float32 values stay under 100 MiB whatever the tensor's size (an 8B model's
# embedding holds half a billion weights).
RESTORE_CHUNK_BYTES = 1 << 22


def _restored(rows: np.ndarray, convert) -> np.ndarray:
    """``convert`` applied to ``rows`` a chunk of rows at a time."""
    n = max(1, RESTORE_CHUNK_BYTES // max(1, rows.shape[1]))
    return np.concatenate([convert(rows[i:i + n]) for i in range(0, len(rows), n)])


def gguf_file(model_dir: Path) -> Optional[Path]:
    """The GGUF file a model folder's weights are read from, or None (safetensors)."""
    pointer = model_dir / GGUF_POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["file"])


class GgufWeights:
    """The tensors of a GGUF file, taken once each by name."""

    def __init__(self, path: Path, kernels: CpuKernels) -> None:
        self.path, self.kernels = path, kernels
        self.reader = GgufReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.taken: set[str] = set()
        splits = self.reader.fields.get("split.count", 1)
        if splits > 1:
            raise ModelLoadError(f"{path.name} is one of {splits} parts of a split GGUF "
                                 f"file; join them first (llama.cpp's llama-gguf-split "
                                 f"--merge FIRST_PART OUT.gguf) and serve the whole file")
        self.architecture = self.reader.fields.get("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise unserved_gguf_architecture(path.name, self.architecture)
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

    def linear(self, names: list[str], in_features: int,
               orders: Optional[list[Optional[np.ndarray]]] = None,
               expert: Optional[int] = None):
        """The tensors ``names``, rows stacked in that order (q, k, v; gate, up), as
        one PackedLinear in the format their type packs as. ``orders``: per tensor, the
        order to take its rows in, or None (as they are). ``expert``: of tensors
        holding every expert of a mixture (ffn_gate_exps...), that expert's rows.
        Tensors of types that pack as different formats (llama.cpp's mixes give v more
        bits than q and k), or as one format but not in whole panels each, are all made
        Q8_0 (int8): as_q8_0."""
        from gguf import quants

        from engine_worker.models import PackedLinear

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
            parts = [_restored(rows, functools.partial(as_q8_0, ggml_type=g))
                     for rows, g in zip(parts, types)]
            packs_as, formats = [Q8_0] * len(types), {"int8"}
            logger.info("%s: %s are one int8 weight (Q8_0)", self.path.name,
                        ", ".join(f"{t.name} ({t.type_name})" for t in tensors))
        else:
            parts = [_restored(rows, self.restored[g][1]) if g in self.restored else rows
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
        return PackedLinear.from_packed(self.kernels, packed, fmt, out_features, in_features)

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


def _qkv_orders(arch: str, cfg) -> Optional[list[Optional[np.ndarray]]]:
    """The order of q's, k's and v's rows to take: llama.cpp's converter stores q's and
    k's in its RoPE order for the llama architecture (put back in Hugging Face's); the
    others' RoPE is Hugging Face's, rows as they were, but where RoPE turns only part of
    each head (Phi-4-mini), q's and k's reordered as from a checkpoint."""
    if arch == "llama":
        return [unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads),
                unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads), None]
    if cfg.rotary_dim is None:
        return None
    from engine_worker.models.llama import partial_rotary_order

    rows = partial_rotary_order(cfg)[0].numpy()
    total = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [np.concatenate([rows, np.arange(len(rows), total)])]


def _expert_biases(w: GgufWeights, p: str, mlp, cfg) -> None:
    """gpt-oss's router's bias and each expert's: gate's and up's (llama.cpp's
    converter splits the checkpoint's interleaved gate_up into ffn_gate_exps and
    ffn_up_exps) and down's."""
    e, i_size, c = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    mlp.gate.bias = w.dense(p + "ffn_gate_inp.bias", (e,))
    gate, up = (w.dense(p + f"ffn_{n}_exps.bias", (e, i_size)) for n in ("gate", "up"))
    down = w.dense(p + "ffn_down_exps.bias", (e, c))
    for k, expert in enumerate(mlp.experts):
        expert.gate_up_proj.bias = torch.cat([gate[k], up[k]])
        expert.down_proj.bias = down[k].clone()


@torch.no_grad()
def load_gguf(model, path: Path, kernels: CpuKernels) -> None:
    """Fill a LlamaModel (built with empty weights) from a GGUF file: every linear
    layer packed from the file's blocks, as they are or re-stored (restored_types)."""
    w = GgufWeights(path, kernels)
    cfg = model.cfg
    c, i_size = cfg.hidden_size, cfg.intermediate_size
    if cfg.mlp_bias:
        raise ModelLoadError(f"{path.name}: MLP biases are not served from GGUF files")
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = _qkv_orders(w.architecture, cfg)
    phi3 = w.architecture == "phi3"   # q/k/v and gate/up stored fused, as its checkpoints
    model.embed_tokens.weight.copy_(w.dense("token_embd.weight", (cfg.vocab_size, c)))
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = w.linear([p + "attn_qkv.weight"] if phi3 else
                                 [p + f"attn_{n}.weight" for n in "qkv"], c, qkv)
        if cfg.qkv_bias:   # qwen2's and gpt-oss's
            sizes = (q_size, kv_size, kv_size)
            attn.qkv_proj.bias = torch.cat([w.dense(p + f"attn_{n}.bias", (size,))
                                            for n, size in zip("qkv", sizes)])
        attn.o_proj = w.linear([p + "attn_output.weight"], cfg.num_heads * cfg.head_dim)
        if cfg.o_bias:   # gpt-oss's (and a llama model's with attention_bias)
            attn.o_proj.bias = w.dense(p + "attn_output.bias", (c,))
        if cfg.attn_sinks:
            attn.sinks.copy_(w.dense(p + "attn_sinks.weight", (cfg.num_heads,)))
        if i in cfg.moe_layers:   # the router, then each expert's rows
            mlp.gate = w.linear([p + "ffn_gate_inp.weight"], c)
            if mlp.shared_expert is not None:   # qwen2moe's, and its gate
                mlp.shared_expert_gate = w.linear([p + "ffn_gate_inp_shexp.weight"], c)
                mlp.shared_expert.gate_up_proj = w.linear(
                    [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"], c)
                mlp.shared_expert.down_proj = w.linear([p + "ffn_down_shexp.weight"],
                                                       cfg.shared_expert_size)
            for e, expert in enumerate(mlp.experts):
                expert.gate_up_proj = w.linear([p + "ffn_gate_exps.weight",
                                                p + "ffn_up_exps.weight"], c, expert=e)
                expert.down_proj = w.linear([p + "ffn_down_exps.weight"],
                                            cfg.expert_intermediate_size, expert=e)
            if cfg.expert_bias:   # gpt-oss's router's and experts' biases
                _expert_biases(w, p, mlp, cfg)
        else:
            mlp.gate_up_proj = w.linear([p + "ffn_up.weight"] if phi3 else
                                        [p + "ffn_gate.weight", p + "ffn_up.weight"], c)
            mlp.down_proj = w.linear([p + "ffn_down.weight"], i_size)
        if cfg.qk_norm:
            attn.q_norm.weight.copy_(w.dense(p + "attn_q_norm.weight", (cfg.head_dim,)))
            attn.k_norm.weight.copy_(w.dense(p + "attn_k_norm.weight", (cfg.head_dim,)))
        layer.input_layernorm.weight.copy_(w.dense(p + "attn_norm.weight", (c,)))
        # (gpt-oss's norm before the MLP has the name Gemma's after the attention has)
        mlp_norm = "post_attention_norm" if w.architecture == "gpt-oss" else "ffn_norm"
        layer.post_attention_layernorm.weight.copy_(w.dense(p + mlp_norm + ".weight", (c,)))
        if cfg.sandwich_norms:   # Gemma's norms of the attention's and the MLP's outputs
            layer.attn_out_norm.weight.copy_(w.dense(p + "post_attention_norm.weight", (c,)))
            layer.mlp_out_norm.weight.copy_(w.dense(p + "post_ffw_norm.weight", (c,)))
    model.norm.weight.copy_(w.dense("output_norm.weight", (c,)))
    model.lm_head = w.linear(["output.weight" if "output.weight" in w.tensors
                              else "token_embd.weight"], c)
    model.rotary.inv_freq = model.rotary.inv_freq / rope_scaling(w, cfg.head_dim)
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in w.tensors:   # phi3's LongRoPE: in the folder's config (model_files.py)
            w.take(name)
    # Gemma's embedding scale into the embeddings (its norms are stored as the 1 + weight
    # they scale by); the lm_head, packed from the file's own embedding, keeps it
    # unscaled
    model.fold_scales()
    w.finish()
    counts = Counter(t.ggml_type for t in w.reader.tensors)
    kept = ", ".join(f"{n} {ggml_type_name(k)}" for k, n in counts.most_common()
                     if k not in w.restored)
    restored = "".join(f"; {n} {ggml_type_name(k)} re-stored as {w.restored[k][2]}"
                       for k, n in counts.most_common() if k in w.restored)
    logger.info("weights: %s, as they are: %s%s", path.name, kept, restored)
