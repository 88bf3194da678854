"""The CPU platform: the C kernels (cpu/kernels.py, built by cpu/build.py) where they
build and the dtype allows (float32, bfloat16): every linear layer packed in its
format (cpu/formats.py), decode attention in C (cpu/attention.py), the fused layer ops,
a row-wise argmax for the sampler, and where the model is the shared decoder the whole
step in one C call (cpu/fused.py). Without them, torch's reference path
(engine_worker/attention.py: TorchAttention; ops.py: TorchOps) in the model's dtype.
The KV cache is a byte budget of host memory (kv_cache.py: 2 GiB unless given)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_worker.attention import AttentionBackend, TorchAttention
from engine_worker.cpu.attention import CpuAttention
from engine_worker.cpu.formats import Packing
from engine_worker.cpu.fused import FusedForward, FusedLlama
from engine_worker.cpu.kernels import CpuKernels
from engine_worker.forward import EagerForward, Forward
from engine_worker.kv_cache import KvCache, kv_cache_dtype
from engine_worker.models.config import ModelConfig
from engine_worker.models.layers import Backends
from engine_worker.models.layers.fp8 import fp8_formats
from engine_worker.models.layers.linear import DenseMethod, WeightFormats
from engine_worker.ops import FP8, Ops, TorchOps
from engine_worker.sampler import Sampler

logger = logging.getLogger(__name__)


class CpuPlatform:
    # steps are not queued ahead of the host (engine.py: async scheduling off by default)
    runs_ahead = False
    # n-gram speculation and predicted outputs run here (speculation.py)
    speculates = True

    def __init__(self, device: torch.device, dtype: torch.dtype,
                 kernels: Optional[CpuKernels]) -> None:
        """dtype: the one asked for; kernels: the C kernels, or None (torch's path)."""
        self.device, self.dtype, self.kernels = device, dtype, kernels
        self.packing = Packing(kernels) if kernels is not None else None

    def formats(self, config: EngineConfig, model: ModelConfig, gguf_path: Optional[Path]
                ) -> tuple[WeightFormats, torch.dtype, Optional[torch.dtype]]:
        """The weights' formats, the dtype the model computes in and the KV cache's
        (None: auto, decided once the weights are loaded), each checked against the
        others. On the C kernels, bfloat16 and int8 are formats of the packed weights;
        activations stay float32. An fp8 checkpoint is served as int8 unless
        --quantization names another format (its weights dequantized as they load);
        without the kernels, in the model's dtype."""
        if gguf_path is not None and (config.quantization or self.dtype != torch.float32):
            raise ValueError(f"{gguf_path.name} is served as it is: --quantization and "
                             f"--dtype (other than auto or float32) do not apply to it")
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype)
        if config.quantization == "fp8":
            if self.packing is not None:
                raise ValueError("--quantization fp8 is a CUDA format (its products need fp8 "
                                 "tensor cores); on the CPU kernels use --quantization int8 "
                                 "(an fp8 checkpoint is served as int8 here by itself), or "
                                 "--no-cpu-kernels for torch's own fp8 products (slow: for "
                                 "accuracy)")
            return fp8_formats(self.dtype), self.dtype, kv_dtype
        if self.packing is None:
            if config.quantization is not None:
                raise ValueError(f"{config.quantization} weights need the CPU C kernels "
                                 f"(--device cpu, a C compiler, not --no-cpu-kernels)")
            return WeightFormats(DenseMethod(self.dtype)), self.dtype, kv_dtype
        if kv_dtype == FP8:
            raise ValueError("--kv-cache-dtype fp8 is for CUDA: the CPU kernels read a float32 "
                             "or bfloat16 cache (on the CPU only the torch reference path, "
                             "--attention-backend torch, reads fp8)")
        fmt = config.quantization or ("int8" if model.weight_format == "fp8" else
                                      "bfloat16" if self.dtype == torch.bfloat16 else "float32")
        return self.packing.formats(fmt), torch.float32, kv_dtype

    def attention(self, cfg: ModelConfig, kv_dtype: Optional[torch.dtype], block_size: int,
                  max_seqs: int) -> tuple[AttentionBackend, Ops]:
        args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
        if self.kernels is None:
            return TorchAttention(*args, softcap=cfg.attn_softcap), TorchOps()
        if not self.kernels.supports_head_dim(cfg.head_dim):
            logger.info("head_dim %d: decode attention uses the torch path", cfg.head_dim)
            return TorchAttention(*args, softcap=cfg.attn_softcap), self.kernels
        return CpuAttention(*args, self.kernels, softcap=cfg.attn_softcap), self.kernels

    def backends(self, attn: AttentionBackend, ops: Ops, formats: WeightFormats) -> Backends:
        return Backends(attn, ops, formats)

    def prepare(self, model: nn.Module) -> None:
        """(The loaded model computes as it is here.)"""

    def auto_kv_dtype(self, weight_format: str, dtype: torch.dtype) -> torch.dtype:
        """--kv-cache-dtype auto: the dtype the model computes in, but bfloat16 where
        the C kernels hold weights of less precision than float32 (bfloat16, int8,
        4-bit; a GGUF file by the format most of its layers take), as a bfloat16 model
        on vLLM and a quantized file on llama.cpp (f16) keep theirs: half the bytes for
        attention to read, twice the tokens in the same memory, for a perplexity change
        under the weights' own (docs/performance.md). float32 weights keep float32, so
        that the default model's greedy output stays Hugging Face's token for token."""
        if self.kernels is not None and weight_format != "float32":
            return torch.bfloat16
        return dtype

    def products(self, fmt: str) -> Optional[str]:
        """How this CPU multiplies weights in ``fmt``, where there is a choice."""
        return self.kernels.products(fmt) if self.kernels is not None else None

    def kv_blocks(self, kv: KvCache, cache: CacheConfig, scheduler: SchedulerConfig,
                  eager: EagerForward, sampler: Sampler) -> tuple[int, int]:
        """(blocks, the sliding layers' own) of the KV cache: given, or what its byte
        budget holds."""
        return kv.sized(cache)

    def warm_up(self, eager: EagerForward, kv: KvCache, scheduler: SchedulerConfig) -> None:
        """(Nothing compiles while serving here.)"""

    def forward(self, eager: EagerForward, attn: AttentionBackend, kv: KvCache,
                scheduler: SchedulerConfig) -> Forward:
        """The whole step in one C call where the model is the shared decoder on the
        kernels, else layer by layer."""
        model = eager.model
        if isinstance(attn, CpuAttention) and FusedLlama.supports(model):
            return FusedForward(FusedLlama(self.kernels, model, kv.layers, kv.block_size),
                                model, kv.block_size, kv.windowed)
        return eager
