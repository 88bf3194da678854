"""What each GGUF block type is served as on the CPU kernels: the types packed as they
are (GGUF_FORMATS, cpu/kernels.py) and the others re-stored at start as one of those
(``restored_types``: Q5_0 as Q8_0 and Q4_K as Q4_1, exactly or nearly; every other type
the gguf package dequantizes requantized as Q8_0), and ``as_q8_0`` for the parts of
one weight whose types pack as different formats (models/gguf.py)."""

from __future__ import annotations

import functools

import numpy as np

from common.gguf_reader import ggml_type_name
from engine_worker.cpu.kernels import GGUF_FORMATS

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


def in_chunks(rows: np.ndarray, convert) -> np.ndarray:
    """``convert`` applied to ``rows`` a chunk of rows at a time."""
    n = max(1, RESTORE_CHUNK_BYTES // max(1, rows.shape[1]))
    return np.concatenate([convert(rows[i:i + n]) for i in range(0, len(rows), n)])
