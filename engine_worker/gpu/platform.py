"""The CUDA platform: Triton's attention and ops (gpu/attention.py, gpu/ops.py), a
mixture's experts grouped into one GEMM a projection (gpu/moe.py), the KV cache sized
from what a profiled step leaves of the GPU (gpu/memory.py), every Triton kernel
compiled at start, and steps replayed from CUDA graphs (gpu/graphs.py) unless
``enforce_eager``; steps are queued ahead of the host. --attention-backend torch: the
reference attention and ops on the device.

``InterpretedPlatform``: the same kernels on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1), for tests: the KV cache from a byte budget, no graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from engine_worker.attention import AttentionBackend, TorchAttention
from engine_worker.forward import EagerForward, Forward
from engine_worker.gpu.attention import TritonAttention
from engine_worker.gpu.graphs import (CudaGraphCapture, GraphForward, prompt_graph_seqs,
                                      prompt_graph_sizes)
from engine_worker.gpu.memory import MemoryProfile
from engine_worker.gpu.moe import GroupedExperts
from engine_worker.gpu.ops import TritonOps
from engine_worker.kv_cache import KvCache, kv_cache_dtype
from engine_worker.models.config import ModelConfig
from engine_worker.models.layers import Backends
from engine_worker.models.layers.fp8 import fp8_formats
from engine_worker.models.layers.linear import DenseMethod, WeightFormats
from engine_worker.models.layers.moe import MoE
from engine_worker.ops import FP8, Ops, TorchOps
from engine_worker.profile_step import dummy_step
from engine_worker.sampler import Sampler

logger = logging.getLogger(__name__)


class CudaPlatform:
    # a step is queued before the host has read the last one's tokens (engine.py)
    runs_ahead = True
    # (speculation runs on the CPU engine)
    speculates = False
    # (no C kernels: the sampler's argmax is torch's)
    kernels = None

    def __init__(self, device: torch.device, dtype: torch.dtype, triton: bool,
                 enforce_eager: bool) -> None:
        """triton: Triton's attention and ops (else torch's); enforce_eager: no CUDA
        graphs."""
        self.device, self.dtype, self.triton = device, dtype, triton
        self.enforce_eager = enforce_eager
        # multiprocessors the split decode attention fills
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.graphs = False   # whether the model's steps replay from graphs (prepare)

    def formats(self, config: EngineConfig, model: ModelConfig, gguf_path: Optional[Path]
                ) -> tuple[WeightFormats, torch.dtype, Optional[torch.dtype]]:
        """Dense weights in the model's dtype, or fp8 (--quantization fp8, or an fp8
        checkpoint; a mixture's experts too, in the grouped GEMM): then the lm_head and
        a mixture's routers dense; the KV cache in the model's dtype or fp8."""
        if gguf_path is not None:
            raise ValueError(f"{gguf_path.name}: a GGUF file is served as it is by the CPU "
                             f"kernels (--device cpu); on a GPU, serve its checkpoint")
        if config.quantization not in (None, "fp8"):
            raise ValueError(f"{config.quantization} weights need the CPU C kernels (--device "
                             f"cpu, a C compiler, not --no-cpu-kernels); on CUDA, fp8")
        name = config.cache.kv_cache_dtype
        kv_dtype = kv_cache_dtype(name)
        if self.device.type == "cuda" and kv_dtype not in (None, self.dtype, FP8):
            raise ValueError(f"--kv-cache-dtype {name}: on {self.device.type} the KV cache is "
                             f"kept in the dtype the model computes in "
                             f"({str(self.dtype).removeprefix('torch.')}) or in fp8; use "
                             f"auto or fp8")
        if config.quantization == "fp8" or model.weight_format == "fp8":
            self._check_fp8()
            return fp8_formats(self.dtype), self.dtype, kv_dtype
        return WeightFormats(DenseMethod(self.dtype)), self.dtype, kv_dtype

    def _check_fp8(self) -> None:
        """fp8 weights' products (cuBLASLt's row-wise scaled GEMM) need fp8 tensor
        cores (Ada, Hopper: compute capability 8.9 and up) and give bfloat16."""
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            name = torch.cuda.get_device_name(self.device)
            raise ValueError(f"fp8 weights need fp8 tensor cores (compute capability 8.9 or "
                             f"later: Ada, Hopper); {name} has none: serve the checkpoint "
                             f"in bfloat16 (without --quantization fp8)")
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            raise ValueError(f"fp8 weights compute in bfloat16 on CUDA (its fp8 GEMM's "
                             f"row-wise scales give bfloat16), not "
                             f"{str(self.dtype).removeprefix('torch.')}: use --dtype auto "
                             f"or bfloat16")

    def attention(self, cfg: ModelConfig, kv_dtype: Optional[torch.dtype], block_size: int,
                  max_seqs: int) -> tuple[AttentionBackend, Ops]:
        args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale)
        if not self.triton:
            return TorchAttention(*args, softcap=cfg.attn_softcap), TorchOps()
        if kv_dtype == FP8 and block_size & (block_size - 1):
            raise ValueError(f"--kv-cache-dtype fp8 needs a --block-size that is a power "
                             f"of two (its attention kernel reads values a block's row "
                             f"at a time), got {block_size}")
        return (TritonAttention(*args, max_seqs, self.device, kv_dtype == FP8,
                                softcap=cfg.attn_softcap, num_sms=self.num_sms), TritonOps())

    def backends(self, attn: AttentionBackend, ops: Ops, formats: WeightFormats) -> Backends:
        # gpt-oss's checkpoints' MXFP4 experts kept so (4.25 bits a weight)
        return Backends(attn, ops, formats, GroupedExperts.mxfp4 if self.triton else None)

    def prepare(self, model: nn.Module) -> None:
        """A mixture's experts in one grouped GEMM a projection, routed on the device;
        CUDA graphs where the model's steps take them (a mixture routed on the host,
        not grouped, runs eagerly)."""
        mixtures = [m for m in model.modules() if isinstance(m, MoE)]
        if self.triton:
            for moe in mixtures:
                moe.group(GroupedExperts)
        self.graphs = (not self.enforce_eager and model.cuda_graphs
                       and (self.triton or not mixtures))

    def auto_kv_dtype(self, weight_format: str, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def products(self, fmt: str) -> Optional[str]:
        return None

    def kv_blocks(self, kv: KvCache, cache: CacheConfig, scheduler: SchedulerConfig,
                  eager: EagerForward, sampler: Sampler) -> tuple[int, int]:
        """Blocks for the KV cache on the GPU (and the sliding layers' own): given, or
        what is left after profiling (gpu/memory.py), with room for the CUDA graphs'
        largest steps where there are graphs."""
        if cache.num_blocks is not None:
            return kv.given(cache.num_blocks)
        if cache.kv_cache_memory_bytes is not None:
            return kv.given_bytes(cache.kv_cache_memory_bytes)
        free, total = torch.cuda.mem_get_info(self.device)
        torch_held = torch.cuda.memory_reserved(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        seqs = min(scheduler.decode_batch_size, scheduler.token_budget)
        peak = self._profile_peak(kv, eager, sampler, scheduler.token_budget, seqs)
        graph_pool = 0
        if self.graphs:  # the graphs hold their largest steps' activations
            b = scheduler.decode_batch_size
            graph_pool = max(self._profile_peak(kv, eager, sampler, b, b),
                             self._profile_peak(kv, eager, sampler,
                                                prompt_graph_sizes(scheduler.token_budget)[-1],
                                                prompt_graph_seqs(eager.inputs.max_seqs)))
        profile = MemoryProfile(total=total, used_by_others=total - free - torch_held,
                                weights=weights, activation_peak=peak, graph_pool=graph_pool)
        kv_bytes = profile.kv_cache_bytes(cache.gpu_memory_utilization)
        logger.info("GPU memory: %.1f GiB total, %.0f%% usable; %s; KV cache %.2f GiB",
                    total / 2**30, cache.gpu_memory_utilization * 100, profile.describe(),
                    kv_bytes / 2**30)
        return kv.blocks_in(kv_bytes)

    @torch.inference_mode()
    def _profile_peak(self, kv: KvCache, eager: EagerForward, sampler: Sampler, tokens: int,
                      seqs: int) -> int:
        """Bytes a step adds at its peak over the weights: a forward pass over
        ``tokens`` prompt tokens in ``seqs`` sequences (the token budget in as many
        sequences as may run; a decode batch; a prompt graph's largest step), the
        logits of every sequence and the sampler on them. Runs on a cache of just
        enough blocks, freed after."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scheduled, blocks = dummy_step(tokens, seqs, kv.block_size, eager.inputs.width)
        # (the made-up requests' local tables read the null block)
        kv.allocate(blocks, 1 if kv.windowed else 0)
        logits = eager(scheduled, (), None, ())
        sampler.profile(logits)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        cache_bytes = kv.nbytes
        kv.layers.clear()
        del logits
        torch.cuda.empty_cache()
        return max(0, peak - cache_bytes)

    @torch.inference_mode()
    def warm_up(self, eager: EagerForward, kv: KvCache, scheduler: SchedulerConfig) -> None:
        """Runs a step of one prompt chunk and a decode step at each split count a
        step can take, so that no Triton kernel compiles while serving (a compile
        takes a second or so; the step inputs' alignment keeps the variants to these)."""
        if not self.triton:
            return
        bs, width = kv.block_size, eager.inputs.width
        chunk = min(scheduler.token_budget, 64, kv.num_blocks * bs)
        steps = [dummy_step(chunk, 1, bs, width)[0]]
        top = min(scheduler.decode_batch_size, eager.inputs.max_seqs, kv.num_blocks)
        by_splits = {eager.splits(b): b for b in range(top, 0, -1)}
        steps += [dummy_step(b, b, bs, width)[0] for b in by_splits.values()]  # decode rows
        for scheduled in steps:
            eager(scheduled, (), None, ())
        kv.zero_null_block()

    def forward(self, eager: EagerForward, attn: AttentionBackend, kv: KvCache,
                scheduler: SchedulerConfig) -> Forward:
        """Decode steps, steps of a few short prompt chunks alone, and mixed steps of up
        to 2,048 tokens (piecewise) from CUDA graphs."""
        if not self.graphs:
            return eager
        graphs = GraphForward(eager, scheduler.decode_batch_size, CudaGraphCapture(),
                              prompt_graph_sizes(scheduler.token_budget), piecewise=True)
        graphs.capture_all()
        return graphs


class InterpretedPlatform(CudaPlatform):
    """Triton's kernels on CPU tensors through its interpreter (tests)."""
    runs_ahead = False
    speculates = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype, self.triton, self.enforce_eager = device, dtype, True, True
        self.num_sms = 1
        self.graphs = False

    def kv_blocks(self, kv: KvCache, cache: CacheConfig, scheduler: SchedulerConfig,
                  eager: EagerForward, sampler: Sampler) -> tuple[int, int]:
        return kv.sized(cache)
