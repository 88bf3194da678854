"""The device chosen once, at start: a platform object the engine and the model runner
ask whatever depends on the device and its kernels, so that neither branches on it.

  * CpuPlatform (cpu/platform.py): the C kernels (packed weight formats, decode
    attention, fused ops, the whole step in one C call), or torch's reference path
    where they do not build, are turned off or the dtype is another;
  * CudaPlatform (gpu/platform.py): Triton's kernels, grouped experts, memory sized
    by profiling, CUDA graphs (or torch's attention on the device, asked for);
  * InterpretedPlatform (gpu/platform.py): Triton's kernels through its interpreter
    on CPU tensors (tests).

Each answers the same questions (``Platform``), in the order ModelRunner asks them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Protocol

import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_worker.attention import AttentionBackend
from engine_worker.cpu.build import cpu_kernels
from engine_worker.cpu.kernels import CpuKernels
from engine_worker.cpu.platform import CpuPlatform
from engine_worker.forward import EagerForward, Forward
from engine_worker.kv_cache import KvCache
from engine_worker.models.config import ModelConfig
from engine_worker.models.layers import Backends
from engine_worker.models.layers.linear import WeightFormats
from engine_worker.ops import Ops
from engine_worker.sampler import Sampler


class Platform(Protocol):
    device: torch.device
    # a step is queued before the host has read the last one's tokens, by default
    # (engine.py: async scheduling)
    runs_ahead: bool
    # n-gram speculation and predicted outputs run here (speculation.py)
    speculates: bool
    # the CPU's C kernels, where they run (the sampler's argmax)
    kernels: Optional[CpuKernels]

    def formats(self, config: EngineConfig, model: ModelConfig, gguf_path: Optional[Path]
                ) -> tuple[WeightFormats, torch.dtype, Optional[torch.dtype]]:
        """The linear layers' formats (from --dtype, --quantization and the checkpoint's
        own: ``model.weight_format``), the dtype the model computes in, and the KV
        cache's (None: auto_kv_dtype's, once the weights are loaded); ValueError for a
        combination not served."""

    def attention(self, cfg: ModelConfig, kv_dtype: Optional[torch.dtype], block_size: int,
                  max_seqs: int) -> tuple[AttentionBackend, Ops]: ...

    def backends(self, attn: AttentionBackend, ops: Ops, formats: WeightFormats
                 ) -> Backends: ...

    def prepare(self, model: nn.Module) -> None:
        """The loaded model made what this platform computes with."""

    def auto_kv_dtype(self, weight_format: str, dtype: torch.dtype) -> torch.dtype: ...

    def products(self, fmt: str) -> Optional[str]:
        """How products with weights in ``fmt`` are computed, where there is a choice."""

    def kv_blocks(self, kv: KvCache, cache: CacheConfig, scheduler: SchedulerConfig,
                  eager: EagerForward, sampler: Sampler) -> tuple[int, int]:
        """(blocks, the sliding layers' own blocks) of the KV cache."""

    def warm_up(self, eager: EagerForward, kv: KvCache, scheduler: SchedulerConfig) -> None:
        """Whatever must run once before serving (kernels compiled)."""

    def forward(self, eager: EagerForward, attn: AttentionBackend, kv: KvCache,
                scheduler: SchedulerConfig) -> Forward:
        """What runs a step."""


def make_platform(config: EngineConfig) -> Platform:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    triton = config.attention_backend == "triton" or (
        config.attention_backend == "auto" and device.type == "cuda")
    if device.type == "cuda":
        from engine_worker.gpu.platform import CudaPlatform   # (triton: not on every CPU host)

        return CudaPlatform(device, dtype, triton, config.enforce_eager)
    if triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs a CUDA device (on a CPU it "
                             "runs only through Triton's interpreter, TRITON_INTERPRET=1: "
                             "for tests)")
        from engine_worker.gpu.platform import InterpretedPlatform

        return InterpretedPlatform(device, dtype)
    kernels = (cpu_kernels() if config.cpu_kernels and config.attention_backend == "auto"
               and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
               else None)
    return CpuPlatform(device, dtype, kernels)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)
