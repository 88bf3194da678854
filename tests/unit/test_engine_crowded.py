"""A crowded engine serves each request as it would serve it alone: random workloads
(prompts sharing prefixes, greedy, seeded and penalized sampling, priorities, arrivals
over time, aborts) on a KV cache small enough to preempt, a token budget that chunks
prompts, with run-ahead scheduling or n-gram speculation, on the C kernels and the
torch path. Each finished request's tokens equal those of the same request run alone
in a roomy engine, an aborted one's are a prefix of them, and no block stays held."""

from __future__ import annotations

import random

import pytest

from common.protocol import SamplingParams
from helpers import make_engine


def workload(rng: random.Random) -> list[tuple]:
    """(id, prompt, params, arrival step, abort step or None) per request."""
    shared = [rng.randrange(100, 50000) for _ in range(20)]
    requests = []
    for i in range(rng.randrange(8, 15)):
        prompt = shared[:rng.choice([0, 8, 20])] + [
            rng.randrange(100, 50000) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.3:   # text that repeats itself: speculation proposes
            prompt += prompt[-6:] * 3
        max_tokens, kind = rng.randrange(1, 24), rng.random()
        if kind < 0.5:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True,
                                    seed=rng.randrange(1000), top_k=rng.choice([None, 20]))
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                    repetition_penalty=1.3, priority=rng.choice([-1, 0, 1]))
        arrival = rng.randrange(6)
        requests.append((f"r{i}", prompt, params, arrival,
                         arrival + 3 if rng.random() < 0.15 else None))
    return requests


@pytest.mark.parametrize("seed, config", [
    (3, dict(num_blocks=32, budget=16, max_batch=4)),
    (6, dict(num_blocks=32, budget=8, max_batch=8, cpu_kernels=False)),
    (22, dict(num_blocks=32, budget=16, max_batch=8, speculative_tokens=3)),
    (41, dict(num_blocks=32, budget=32, max_batch=8, speculative_tokens=3,
              cpu_kernels=False)),
    (35, dict(num_blocks=32, budget=16, max_batch=8, async_scheduling=True)),
    (12, dict(num_blocks=24, budget=8, max_batch=4, async_scheduling=True,
              cpu_kernels=False))])
def test_each_request_gets_what_it_would_get_alone(tiny_llama_dir, seed, config):
    requests = workload(random.Random(seed))
    roomy = make_engine(tiny_llama_dir, max_batch=8,
                        cpu_kernels=config.get("cpu_kernels", True))
    alone = {rid: roomy.generate([prompt], params)[0] for rid, prompt, params, *_ in requests}

    crowded = make_engine(tiny_llama_dir, **config)
    got: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    step = 0
    while step < 7 or crowded.has_unfinished_requests():
        for rid, prompt, params, arrival, abort in requests:
            if arrival == step:
                crowded.add_request(rid, prompt, params)
            if abort == step:
                crowded.abort_requests([rid])
        for out in crowded.step():
            assert out.error is None, out.error
            got[out.request_id].extend(out.new_token_ids)
        step += 1
        assert step < 2000
    assert crowded.stats().num_preemptions > 0   # the cache was crowded
    for rid, _, _, _, abort in requests:
        if abort is None:
            assert got[rid] == alone[rid], rid
        else:
            assert got[rid] == alone[rid][:len(got[rid])], rid
    assert crowded.stats().num_blocks_used == 0
