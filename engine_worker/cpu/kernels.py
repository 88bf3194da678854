"""The CPU's C kernels (cpu/csrc/), called through ctypes: paged attention, the packed
GEMM and its weight formats, the fused layer ops, a row-wise argmax, and the one-call
forward of the shared decoder (llama.c; cpu/fused.py drives it). cpu/build.py compiles
them for this CPU and loads them (``cpu_kernels()``).

GEMM (gemm.c): every linear layer computes from a weight packed once at load time into
panels of 16 output features, register-tiled for the CPU's vector width (AVX-512 or
AVX2, whichever -march=native finds on the machine that compiles). At 1-8 rows a layer
is bound by streaming its weight, at 64 by FMA throughput; the same kernel serves
both, and nothing depends on a vendor BLAS. bfloat16 weights are multiplied as bf16
products where the CPU has them and they are faster (AMX tiles, or AVX-512-BF16's
vdpbf16ps, which Intel's cores run no faster than widening; see BF16_PATHS), and int8
and 4-bit weights as AMX tiles from 16 rows where it has them (INT8_PATHS; IQ4's and
MXFP4's panels unpacked to int8 ones first, a panel at a time); the OS must first allow
AMX: loading the kernels asks it (rs_init). The row-wise argmax is there because
torch's is single-threaded and unvectorized on the CPU, ~10x slower over a vocabulary.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from engine_worker.ops import QkNorm, clamped_swiglu, norm_heads, split_qkv

logger = logging.getLogger(__name__)


class CpuKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.rs_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                       i64, i64, ctypes.c_float, ctypes.c_float, i64, ptr]
        fn.restype = ctypes.c_int
        self._attention = fn
        self._argmax = lib.rs_argmax_rows
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr, ptr]
        self._argmax.restype = None
        self._add_rms_norm = lib.rs_add_rms_norm
        self._add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self._add_rms_norm.restype = None
        self._rope_write_kv = lib.rs_rope_write_kv
        self._rope_write_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64, i64,
                                        i64, i64]
        self._rope_write_kv.restype = None
        self._silu_mul = lib.rs_silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        self._silu_mul.restype = None
        self._packed_bytes = lib.rs_packed_bytes
        self._packed_bytes.argtypes = [i64, i64, ctypes.c_int]
        self._packed_bytes.restype = i64
        self._pack = lib.rs_pack_weight
        self._pack.argtypes = [ptr, i64, i64, ctypes.c_int, ptr]
        self._pack.restype = ctypes.c_int
        self.read_all = lib.rs_read_all
        self.read_all.argtypes = [ptr, i64]
        self.read_all.restype = ctypes.c_float
        self._unpack = lib.rs_unpack_weight
        self._unpack.argtypes = [ptr, i64, i64, ctypes.c_int, ptr]
        self._unpack.restype = ctypes.c_int
        self._linear = lib.rs_linear
        self._linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self._llama_forward = lib.rs_llama_forward
        self._llama_forward.argtypes = [ptr, ptr]
        self._llama_forward.restype = ctypes.c_int
        self._llama_scratch = lib.rs_llama_scratch_floats
        self._llama_scratch.argtypes = [ptr, i64, i64, i64, i64]
        self._llama_scratch.restype = i64
        self._pack_gguf = lib.rs_pack_gguf
        self._pack_gguf.argtypes = [ptr, i64, i64, ctypes.c_int, ptr]
        self._pack_gguf.restype = ctypes.c_int
        init = lib.rs_init
        init.argtypes, init.restype = [], ctypes.c_int
        self.bf16_path = BF16_PATHS[init()]
        amx_status = lib.rs_amx_status
        amx_status.argtypes, amx_status.restype = [], ctypes.c_int
        if amx_status() < 0:
            logger.warning("this CPU's AMX tiles gave other results than its vector "
                           "instructions on a test layer: they are not used")
        int8_path = lib.rs_int8_path
        int8_path.argtypes, int8_path.restype = [], ctypes.c_int
        self.int8_path = INT8_PATHS[int8_path()]

    def products(self, fmt: str) -> Optional[str]:
        """How products with weights in ``fmt`` are computed here (BF16_PATHS,
        INT8_PATHS), for the formats that have a choice."""
        return {"bfloat16": self.bf16_path, "int8": self.int8_path,
                "q4": self.int8_path, "iq4": self.int8_path,
                "mxfp4": self.int8_path}.get(fmt)

    # Linear layers (gemm.c).

    def pack(self, weight: torch.Tensor, fmt: str = "float32") -> torch.Tensor:
        """weight (N, K) float32, as nn.Linear holds it -> its packed form in ``fmt``
        (WEIGHT_FORMATS): panels of 16 output features, zero-padded, as bytes."""
        weight = weight.detach().float().contiguous()
        n, k = weight.shape
        code = WEIGHT_FORMATS[fmt]
        packed = torch.empty(self._packed_bytes(n, k, code), dtype=torch.uint8)
        if self._pack(weight.data_ptr(), n, k, code, packed.data_ptr()) != 0:
            step = 2 if fmt == "bfloat16" else INT8_BLOCK
            raise ValueError(f"{fmt} weights need input sizes that are multiples of "
                             f"{step}; a layer has {k}")
        return packed

    def pack_gguf(self, blocks: torch.Tensor, ggml_type: int, out_features: int,
                  in_features: int) -> tuple[torch.Tensor, str]:
        """A GGUF tensor's raw blocks (uint8, out_features rows of in_features / 32
        blocks) of a type in GGUF_FORMATS -> (its packed form, the format), unchanged:
        Q8_0 as int8, Q4_0 and Q4_1 as q4, IQ4_NL and IQ4_XS as iq4, MXFP4 as mxfp4."""
        fmt = GGUF_FORMATS[ggml_type]
        blocks = blocks.contiguous()
        packed = torch.empty(self._packed_bytes(out_features, in_features, WEIGHT_FORMATS[fmt]),
                             dtype=torch.uint8)
        if self._pack_gguf(blocks.data_ptr(), out_features, in_features, ggml_type,
                           packed.data_ptr()) != 0:
            step = GGUF_BLOCK_WEIGHTS.get(ggml_type, INT8_BLOCK)
            raise ValueError(f"GGUF blocks need input sizes that are multiples of "
                             f"{step}; a tensor has {in_features}")
        return packed, fmt

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int,
               fmt: str = "float32") -> torch.Tensor:
        """The float32 weight (N, K) that a packed one computes with."""
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        if self._unpack(packed.data_ptr(), out_features, in_features, WEIGHT_FORMATS[fmt],
                        w.data_ptr()) != 0:
            raise MemoryError("unpacking a weight could not allocate scratch memory")
        return w

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: Optional[torch.Tensor], fmt: str = "float32") -> torch.Tensor:
        """x (M, K) float32 -> x @ weight.T + bias, (M, N)."""
        x = x.contiguous()
        m, k = x.shape
        out = torch.empty(m, out_features, dtype=torch.float32)
        if m and self._linear(x.data_ptr(), m, k, packed.data_ptr(), out_features,
                              ptr_or_none(bias), out.data_ptr(), 0, WEIGHT_FORMATS[fmt]) != 0:
            raise MemoryError("the linear kernel could not allocate scratch memory")
        return out

    # The fused layer ops of engine_worker/ops.py (same signatures as TorchOps).

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        n, c = x.shape
        out = torch.empty_like(x)
        if residual is None:
            residual_in, residual = None, torch.empty_like(x)
        else:
            residual_in = residual = residual.contiguous()  # updated in place
        self._add_rms_norm(x.data_ptr(), None if residual_in is None else residual_in.data_ptr(),
                           residual.data_ptr(), out.data_ptr(), weight.data_ptr(), n, c, eps)
        return out, residual

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      qk_norm: Optional[QkNorm] = None, kv_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert kv_scale is None, "the C kernels write no fp8 cache"
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        if qk_norm is not None:
            norm_heads(self, qkv, num_heads, num_kv_heads, head_dim, qk_norm)
        n = qkv.shape[0]
        self._rope_write_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                            kv_type(kv_cache.dtype), slot_mapping.data_ptr(), n, num_heads,
                            num_kv_heads, head_dim)
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act_mul(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act_mul(gate_up, gelu=True)

    clamped_swiglu = staticmethod(clamped_swiglu)   # (gpt-oss's experts: torch's ops)

    def _act_mul(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        n, two_i = gate_up.shape
        out = gate_up.new_empty(n, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), n, two_i // 2, int(gelu))
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(R, C) float32 -> (R,) int64, first index of each row's maximum."""
        return self._argmax_pass(x, codes=False)[0]

    def greedy_rows(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """(R, C) float32 -> per row (first index of its maximum, validity code: 0, or
        1 a NaN, 2 a +inf, 3 every value -inf), in one pass over the rows."""
        return list(zip(*self.greedy_pass(x).tolist()))

    def greedy_pass(self, x: torch.Tensor) -> torch.Tensor:
        """greedy_rows as a (2, R) int64 tensor: the rows' tokens, then their codes."""
        return self._argmax_pass(x, codes=True)

    def _argmax_pass(self, x: torch.Tensor, codes: bool) -> torch.Tensor:
        """(1 or 2, R) int64: each row's argmax, then (codes) its validity code."""
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(1 + codes, x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out[0].data_ptr(),
                     out[1].data_ptr() if codes else None)
        return out

    @staticmethod
    def supports_head_dim(head_dim: int) -> bool:
        """Whether paged_decode_attention handles this head size (16-float vectors)."""
        return head_dim % 16 == 0 and head_dim <= 256

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int = 0, softcap: float = 0.0,
                               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (B, Hq, D) float32, kv_cache (2, num_blocks, bs, Hkv, D) float32 or
        bfloat16, block_tables (B, max_blocks) and context_lens (B,) int64 -> (B, Hq, D):
        one query per sequence."""
        seq = torch.arange(q.shape[0], dtype=torch.int64)
        return self.paged_attention(q, kv_cache, seq, block_tables, context_lens, scale,
                                    window, softcap, sinks)

    def paged_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, seq: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        scale: float, window: int = 0, softcap: float = 0.0,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (N, Hq, D) float32: token n attends to the first context_lens[n] tokens of
        sequence seq[n] (its row of block_tables), or to the last ``window`` of them; a
        sequence's consecutive tokens (a prompt chunk) are attended as tiles, as in the
        fused forward; softcap > 0: each score s becomes softcap tanh(s / softcap)
        (Gemma 2); sinks (Hq,): each head's sink logit in its softmax (gpt-oss). -> (N,
        Hq, D)."""
        q = q.contiguous()
        if sinks is not None:   # (held here while the kernel reads them)
            sinks = sinks.float().contiguous()
        n, hq, d = q.shape
        _, _, block_size, hkv, _ = kv_cache.shape
        out = torch.empty_like(q)
        seq, block_tables = seq.contiguous(), block_tables.contiguous()
        context_lens = context_lens.contiguous()
        rc = self._attention(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                             kv_type(kv_cache.dtype), seq.data_ptr(), context_lens.data_ptr(),
                             block_tables.data_ptr(), out.data_ptr(), n, hq, hkv, d,
                             block_size, block_tables.shape[1], scale, softcap, window,
                             ptr_or_none(sinks))
        if rc == -2:
            raise ValueError(f"paged attention kernel needs head_dim a multiple of 16 "
                             f"and <= 256, got {d}")
        if rc != 0:
            raise MemoryError("paged attention kernel could not allocate scratch memory")
        return out


# KV cache element types the C kernels read and write (RS_KV_F32, RS_KV_BF16).
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def kv_type(dtype: torch.dtype) -> int:
    if dtype not in KV_TYPES:
        raise ValueError(f"the CPU kernels keep the KV cache in float32 or bfloat16, not {dtype}")
    return KV_TYPES[dtype]


# Packed weight formats (RS_F32 ... RS_MXFP4 in kernels.h). int8, q4, iq4 and mxfp4 keep
# a float (q4: a half scale and offset) per INT8_BLOCK inputs of each output feature;
# iq4's and mxfp4's nibbles index 16 fixed levels (ggml's IQ4_NL and IQ4_XS; FP4's values,
# doubled, of gpt-oss's experts, the float a power of two).
WEIGHT_FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "q4": 3, "iq4": 4, "mxfp4": 5}
INT8_BLOCK = 32
# GGUF tensor types (ggml's ids) packed as they are, and the format each becomes.
# Q8_0, Q4_0, Q4_1, IQ4_NL, IQ4_XS, MXFP4
GGUF_FORMATS = {8: "int8", 2: "q4", 3: "q4", 20: "iq4", 23: "iq4", 39: "mxfp4"}
# Weights a block of those types holds, where not INT8_BLOCK: IQ4_XS's super-blocks.
GGUF_BLOCK_WEIGHTS = {23: 256}
# How bfloat16 weights are multiplied here (rs_bf16_path in gemm.c): AMX tiles (Intel
# Xeon, 4th generation on; vdpbf16ps below 16 rows), AVX-512-BF16's vdpbf16ps (AMD Zen
# 4/5; without AMX, Intel's cores widen, which is faster there), both taking x rounded
# to bfloat16, or widened to float32 (x stays float32).
BF16_PATHS = {2: "amx", 1: "avx512-bf16", 0: "widened"}
# And int8 and 4-bit weights (rs_int8_path): AMX tiles (from 16 rows; VNNI below), VNNI's
# byte dot products (vpdpbusd: AVX-512 VNNI or AVX-VNNI), or without them (vpmaddubsw,
# portable). AMX tiles give the VNNI tiles' results: int8's bit for bit, 4-bit's within a
# float32 rounding.
INT8_PATHS = {2: "amx", 1: "vnni", 0: "no-vnni"}


def ptr_or_none(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()
