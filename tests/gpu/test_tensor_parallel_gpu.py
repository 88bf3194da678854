"""The tensor-parallel code path in a group of one rank (engine_worker/models/layers/
parallel.py): every all-reduce and the logits' gather run, through NCCL on a GPU, where
the decode steps are CUDA graphs that captured them, and through gloo on a CPU; the
tokens are those of an engine in no group. (Two ranks on the CPU:
tests/unit/test_tensor_parallel.py; two GPUs are not lent to CI.)"""

from __future__ import annotations

import multiprocessing
import os

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from helpers import DEVICE, greedy, random_prompts

PROMPTS = random_prompts([5, 17, 9, 30], seed=41)


def engine_config(model_dir) -> EngineConfig:
    cuda = DEVICE == "cuda"
    return EngineConfig(model=str(model_dir), device=DEVICE, dtype="float32",
                        attention_backend="triton" if cuda else "torch",
                        enforce_eager=not cuda, async_scheduling=False,
                        cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=64))


def in_a_group_of_one(model_dir: str, port: int, results) -> None:
    from engine_worker.engine import LLMEngine
    from engine_worker.models.layers.parallel import CollectiveClock

    torch.distributed.init_process_group(
        "nccl" if DEVICE == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
        rank=0, world_size=1)
    try:
        CollectiveClock.on = True
        engine = LLMEngine(engine_config(model_dir))
        at_start = dict(CollectiveClock.calls)   # (CUDA: in the graphs' captures)
        tokens = engine.generate(PROMPTS, greedy(8))
        results.put((engine.runner.parallel.joined, type(engine.runner.step).__name__,
                     at_start, dict(CollectiveClock.calls), tokens))
    except BaseException as e:
        results.put(repr(e))
        raise
    finally:
        torch.distributed.destroy_process_group()


def test_an_engine_in_a_group_of_one_runs_the_collectives_and_the_same_tokens(
        tiny_llama_dir):
    from engine_worker.engine import LLMEngine
    from processes import free_port

    expected = LLMEngine(engine_config(tiny_llama_dir)).generate(PROMPTS, greedy(8))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=in_a_group_of_one,
                       args=(str(tiny_llama_dir), free_port(), results))
    proc.start()
    got = results.get(timeout=600)
    proc.join(60)
    assert not isinstance(got, str), got
    joined, step, at_start, calls, tokens = got
    assert joined and tokens == expected
    layers = 2   # (the tiny Llama's): an all-reduce after each attention and MLP
    if DEVICE == "cuda":
        # graphs captured the collectives at start; their replays call none from Python
        assert step == "GraphForward" and at_start.get("all_reduce", 0) >= 2 * layers
    else:
        assert step == "EagerForward"
        assert calls["all_reduce"] - at_start.get("all_reduce", 0) >= 2 * layers * 8
        assert calls["gather"] >= 8
    assert os.environ.get("RANK") is None   # (the test's own process is in no group)
