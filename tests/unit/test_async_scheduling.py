"""Run-ahead (async scheduling): the next step is scheduled and queued before this
step's tokens reach the host, its placeholders filled on the device. Its outputs are
those of one step at a time, token for token; these tests force it on the CPU (it is
on by default with CUDA only) and compare."""

from __future__ import annotations

import pytest

from common.protocol import FinishReason, SamplingParams
from engine_worker.request import PENDING_TOKEN
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens


def both(model_dir, **kw):
    return (make_engine(model_dir, async_scheduling=False, **kw),
            make_engine(model_dir, async_scheduling=True, **kw))


def run(engine, requests) -> dict:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    out = run_to_end(engine)
    return {rid: (tokens(o), o[-1].finish_reason, [x.logprobs for x in o], o[0].prompt_logprobs)
            for rid, o in out.items()}


def assert_no_placeholder_cached(engine):
    bm = engine.block_manager
    assert all(PENDING_TOKEN not in bm.blocks[b].token_ids for b in bm._by_hash.values())


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_run_ahead_yields_what_one_step_at_a_time_does(tiny_llama_dir, cpu_kernels):
    prompts = random_prompts([5, 23, 9, 40, 3, 17], seed=3)
    shared = prompts[1][:16]
    requests = [
        ("greedy", prompts[0], greedy(12)),
        ("long-greedy", prompts[1], greedy(20)),
        ("seeded", prompts[2], SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9,
                                              seed=7, ignore_eos=True)),
        ("chunked", prompts[3], greedy(9, logprobs=2)),
        ("min-tokens", prompts[4], SamplingParams(max_tokens=8, min_tokens=5, temperature=0,
                                                  stop_token_ids=[7])),
        ("shared-prefix", shared + [1, 2, 3], greedy(6)),
        ("one", prompts[5], greedy(1)),
        ("prompt-logprobs", prompts[5][:9], greedy(5, prompt_logprobs=1)),
    ]
    sync, ahead = both(tiny_llama_dir, budget=16, cpu_kernels=cpu_kernels)
    assert run(ahead, requests) == run(sync, requests)
    assert ahead.num_steps_ahead > 10 and sync.num_steps_ahead == 0
    assert ahead.stats().num_blocks_used == 0
    assert ahead.stats().prefix_cache_hit_tokens == sync.stats().prefix_cache_hit_tokens > 0
    assert_no_placeholder_cached(ahead)


def test_a_stop_token_met_while_the_next_step_is_queued(tiny_llama_dir):
    """The request stops on the token its queued step was waiting for: that step's row
    is wasted, the outputs are the same, and its blocks come back."""
    prompt = random_prompts([6], seed=21)[0]
    sync, ahead = both(tiny_llama_dir)
    free_run = sync.generate([prompt], greedy(12))[0]
    stop = next(t for i, t in enumerate(free_run) if i >= 4 and t not in free_run[:i])
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    requests = [("stops", prompt, params), ("goes-on", random_prompts([8], seed=5)[0],
                                            greedy(12))]
    got = run(ahead, requests)
    assert got == run(sync, requests)
    assert got["stops"][0][-1] == stop and got["stops"][1] is FinishReason.STOP
    assert len(got["stops"][0]) < 12
    assert ahead.stats().num_blocks_used == 0


def test_abort_while_a_step_is_queued(tiny_llama_dir):
    prompts = random_prompts([7, 11, 4], seed=8)
    sync, ahead = both(tiny_llama_dir)
    outs = {}
    for engine in (sync, ahead):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(10))
        got = {f"r{i}": [] for i in range(3)}
        for _ in range(4):
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        assert engine.abort_requests(["r1"]) == ["r1"]
        aborted_at = len(got["r1"])
        for rid, o in run_to_end(engine).items():
            got[rid].extend(tokens(o))
        assert len(got["r1"]) == aborted_at  # nothing after its abort
        assert engine.stats().num_blocks_used == 0
        outs[engine.async_scheduling] = (got["r0"], got["r2"])
    assert outs[True] == outs[False]
    assert ahead.num_steps_ahead > 0


def test_a_request_whose_sampling_reads_its_tokens_is_not_run_ahead(tiny_llama_dir):
    """Penalties count the tokens so far: a step holding such a request is finished
    before the next is scheduled; the others still match."""
    prompts = random_prompts([5, 9], seed=13)
    requests = [("penalized", prompts[0], greedy(10, repetition_penalty=1.3)),
                ("plain", prompts[1], greedy(10))]
    sync, ahead = both(tiny_llama_dir)
    assert run(ahead, requests) == run(sync, requests)
    assert ahead.num_steps_ahead == 0


def test_requests_preempted_while_their_token_is_pending(tiny_llama_dir):
    """A pool too small for every request: the scheduling of a queued step preempts
    requests whose tokens are still on the device; each gets its token when the step
    before is finished and is recomputed with it, as without run-ahead."""
    prompts = random_prompts([9, 10, 11, 12], seed=17)
    requests = [(f"r{i}", p, greedy(14)) for i, p in enumerate(prompts)]
    sync, ahead = both(tiny_llama_dir, num_blocks=16, budget=16)
    assert run(ahead, requests) == run(sync, requests)
    assert ahead.stats().num_preemptions == sync.stats().num_preemptions > 0
    assert 0 < ahead.num_steps_ahead
    assert ahead.stats().num_blocks_used == 0
