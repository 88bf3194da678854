"""Small helpers shared by the engine tests."""

from __future__ import annotations

import random

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.protocol import RequestOutput, SamplingParams
from engine_worker.engine import LLMEngine

# the CUDA path's tests (tests/gpu): on the GPU, else through Triton's interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(model_dir, block_size=4, num_blocks=512, budget=None, max_batch=64,
                prefill_batch=None, prefix_caching=True, cpu_kernels=True,
                max_model_len=None, dtype="auto", quantization=None,
                kv_cache_dtype="auto", async_scheduling=None,
                speculative_tokens=0, window_pool=True, **cache) -> LLMEngine:
    """A CPU engine on a small pool; ``cache``: further CacheConfig fields."""
    return LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", cpu_kernels=cpu_kernels, dtype=dtype,
        quantization=quantization, async_scheduling=async_scheduling,
        speculative_tokens=speculative_tokens,
        max_model_len=max_model_len,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                          window_pool=window_pool, **cache),
        scheduler=SchedulerConfig(max_batch_size=max_batch, prefill_max_batch_size=prefill_batch,
                                  max_num_batched_tokens=budget)))


def triton_engine(model_dir, budget=None, max_batch=8, enforce_eager=True,
                  num_blocks=256, async_scheduling=None) -> LLMEngine:
    """An engine on the CUDA path's kernels (Triton), on the GPU where there is one,
    else on the CPU through Triton's interpreter."""
    return LLMEngine(EngineConfig(
        model=str(model_dir), device=DEVICE, dtype="float32", attention_backend="triton",
        enforce_eager=enforce_eager, async_scheduling=async_scheduling,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_batch_size=max_batch, max_num_batched_tokens=budget)))


def random_prompts(lengths, seed=0, vocab=50257) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def run_staggered(engine: LLMEngine, prompts, params, every=2) -> list[list[int]]:
    """Add prompt i after i * every steps; return outputs in prompt order."""
    results = {f"s{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and steps >= pending[0][0] * every:
            i, prompt = pending.pop(0)
            engine.add_request(f"s{i}", prompt, params)
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        steps += 1
    return [results[f"s{i}"] for i in range(len(prompts))]


# A function tool of the tool-call tests.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string"}}}}}
