"""An fp8 KV cache's scales (engine_worker/kv_scales.py): set by the first prompt's
keys and values and fixed from then on, or a checkpoint's own; what saturated at ±448
unscaled is kept. On the torch path here (a CPU reads an fp8 cache only there); on a
GPU the Triton path too."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.kv_accuracy import teacher_forced
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.protocol import SamplingParams
from engine_worker.engine import LLMEngine
from engine_worker.ops import HEADROOM, from_value_blocks, value_blocks
from helpers import random_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"] if DEVICE == "cuda" else ["torch"]


def engine(model_dir, kv_cache_dtype="fp8", backend="torch") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), device=DEVICE, dtype="float32", attention_backend=backend,
        enforce_eager=True,
        cache=CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_batch_size=4, max_num_batched_tokens=64)))


def cached(e: LLMEngine, layer: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``slots`` slots' keys and values of a layer, as the cache holds them."""
    cache = e.runner.kv_caches[layer]
    keys = cache[0].float().reshape(-1, *cache.shape[3:])
    values = from_value_blocks(value_blocks(cache)).float().reshape(-1, *cache.shape[3:])
    return keys[4:4 + slots], values[4:4 + slots]   # (block 0 is not the first one given)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_first_prompt_sets_each_layers_scales_and_they_stay(tiny_llama_dir, backend):
    e = engine(tiny_llama_dir, backend=backend)
    store = e.kv.leases.store
    assert store.layout.endswith("|uncalibrated")   # (no peer's blocks taken before)
    prompt = random_prompts([24], seed=3)[0]
    e.add_request("a", prompt, SamplingParams(max_tokens=1))
    e.step()
    scales = [layer.kv_scale.clone() for layer in e.runner.kv_scales.layers]
    assert len(scales) == 2 and not e.runner.kv_scales.calibrating
    for i, scale in enumerate(scales):
        assert scale[0] != 1 and scale[1] != 1
        keys, values = cached(e, i, 24)
        # the prompt's largest key and value written as 448 / HEADROOM, exactly
        assert float(keys.abs().max()) == 448 / HEADROOM
        assert float(values.abs().max()) == 448 / HEADROOM
    signature = store.layout.rsplit("|", 1)[1]
    assert signature.startswith("scales=")
    e.generate(random_prompts([30, 9], seed=4), SamplingParams(max_tokens=3))
    for layer, scale in zip(e.runner.kv_scales.layers, scales):
        assert torch.equal(layer.kv_scale, scale)
    assert store.layout.endswith(signature)


def _with_scales(src, out, k_scale: float, v_scale: float):
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, out / "model.safetensors")
    return out


def test_a_checkpoints_scales_are_used_and_kept(tiny_llama_dir, tmp_path):
    """compressed-tensors' kv_cache_scheme: a scale for each layer's keys and values."""
    model = _with_scales(tiny_llama_dir, tmp_path / "scaled", 0.25, 0.125)
    e = engine(model)
    assert e.runner.kv_scales.from_checkpoint and not e.runner.kv_scales.calibrating
    e.generate(random_prompts([20], seed=5), SamplingParams(max_tokens=2))
    for layer in e.runner.kv_scales.layers:
        assert layer.kv_scale.tolist() == [0.25, 0.125]
    assert engine(model, "float32").runner.kv_scales is None   # (read, and not needed)


def test_keys_and_values_past_448_are_kept_by_the_scales(tiny_llama_dir, tmp_path):
    """A model whose keys and values run past fp8's ±448: the tiny Llama with k and v
    projections times 600 and q and o divided by 600, the same function. Unscaled (its
    checkpoint's scales of 1) they saturate; scaled from the first prompt they keep
    fp8's usual rounding."""
    big = tmp_path / "big"
    shutil.copytree(tiny_llama_dir, big)
    tensors = load_file(big / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * 600
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / 600
    save_file(tensors, big / "model.safetensors")
    unscaled = _with_scales(big, tmp_path / "unscaled", 1.0, 1.0)
    prompts = random_prompts([40], seed=11)
    exact = teacher_forced(engine(big, "float32"), prompts)

    def error(model_dir) -> float:
        logits = teacher_forced(engine(model_dir), prompts)
        return float((logits - exact).norm() / exact.norm())

    scaled_error, saturated_error = error(big), error(unscaled)
    assert scaled_error < 0.1 < 0.3 < saturated_error, (scaled_error, saturated_error)
