"""The engine's request lifecycle: validation, stopping, abort, accounting, knobs."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.protocol import FinishReason, SamplingParams
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

PROMPT = random_prompts([9], seed=11)[0]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_model_len=64)


@pytest.mark.parametrize("prompt, params, param, message", [
    ([], greedy(4), "prompt", "empty"),
    ([1, 50257], greedy(4), "prompt", "50257 outside the vocabulary [0, 50257)"),
    ([1, -1], greedy(4), "prompt", "-1 outside"),
    ([1, 2.5], greedy(4), "prompt", "2.5 outside"),
    ([1] * 60, greedy(5), "max_tokens",
     "maximum context length is 64 tokens, but the prompt has 60 tokens and max_tokens is 5"),
    ([1] * 64, SamplingParams(), "prompt", "leaving no room"),
    ([1], greedy(4, stop_token_ids=[99999]), "stop_token_ids", "99999"),
    ([1], SamplingParams(max_tokens=0), "max_tokens", "at least 1"),
    ([1], SamplingParams(temperature=-0.5), "temperature", "non-negative"),
    ([1], SamplingParams(temperature=float("nan")), "temperature", "finite"),
    ([1], SamplingParams(top_p=0.0), "top_p", "(0, 1]"),
    ([1], SamplingParams(top_p=1.5), "top_p", "(0, 1]"),
    ([1], SamplingParams(top_k=0), "top_k", "at least 1"),
    ([1], SamplingParams(min_p=2.0), "min_p", "[0, 1]"),
    ([1], SamplingParams(repetition_penalty=0.0), "repetition_penalty", "[0.01, 100]"),
    ([1], SamplingParams(repetition_penalty=1e-300), "repetition_penalty", "[0.01, 100]"),
    ([1], SamplingParams(repetition_penalty=1e30), "repetition_penalty", "[0.01, 100]"),
    ([1], SamplingParams(presence_penalty=3.0), "presence_penalty", "[-2, 2]"),
    ([1], SamplingParams(frequency_penalty=-2.5), "frequency_penalty", "[-2, 2]"),
    ([1], SamplingParams(logprobs=21), "logprobs", "[0, 20]"),
    ([1], SamplingParams(priority=2**31), "priority", "32 bits"),
    ([1], SamplingParams(max_tokens=2, min_tokens=3), "min_tokens", "must not exceed"),
    ([1], SamplingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens", "at least 1"),
])
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(engine, prompt, params,
                                                                  param, message):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == param
    assert message in str(info.value)
    assert not engine.has_unfinished_requests()  # nothing was queued
    assert len(engine.generate([PROMPT], greedy(2))[0]) == 2


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", PROMPT, greedy(2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", PROMPT, greedy(2))
    run_to_end(engine)
    engine.add_request("dup", PROMPT, greedy(2))  # free again once finished
    run_to_end(engine)


def test_max_tokens_and_length_finish(engine):
    engine.add_request("r", PROMPT, greedy(5))
    outs = run_to_end(engine)["r"]
    assert len(tokens(outs)) == 5
    assert [o.finish_reason for o in outs] == [None] * 4 + [FinishReason.LENGTH]


def test_without_max_tokens_generation_stops_when_the_context_is_full(engine):
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, ignore_eos=True))
    outs = run_to_end(engine)["r"]
    assert len(tokens(outs)) == 64 - len(PROMPT)
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_finish_with_stop(engine):
    want = engine.generate([PROMPT], greedy(6))[0]
    stop = want[2]
    engine.add_request("r", PROMPT, greedy(6, stop_token_ids=[stop]))
    outs = run_to_end(engine)["r"]
    assert tokens(outs) == want[:want.index(stop) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_min_tokens_delays_a_stop_token(engine):
    want = engine.generate([PROMPT], greedy(6))[0]
    stop = want[0]
    engine.add_request("r", PROMPT, greedy(6, stop_token_ids=[stop], min_tokens=3))
    got = tokens(run_to_end(engine)["r"])
    assert stop not in got[:3]
    assert got[0] != want[0]


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    full = random_prompts([30], seed=5)[0]
    engine.add_request("t", full, greedy(4, truncate_prompt_tokens=10))
    got = tokens(run_to_end(engine)["t"])
    assert got == engine.generate([full[-10:]], greedy(4))[0]


def test_first_output_carries_durations_and_cached_tokens(engine):
    fresh = random_prompts([9], seed=99)[0]
    for expected_cached in (0, 8):  # the second time, two full blocks of 4 are cached
        engine.add_request("r", fresh, greedy(3))
        outs = run_to_end(engine)["r"]
        first = outs[0]
        assert first.queue_ms is not None and first.queue_ms >= 0
        assert first.prefill_ms is not None and first.prefill_ms >= 0
        assert first.num_cached_tokens == expected_cached
        assert all(o.queue_ms is None and o.num_cached_tokens is None for o in outs[1:])


def test_abort_mid_generation_frees_every_block(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    engine.add_request("a", PROMPT, greedy(30))
    engine.add_request("b", PROMPT[:5], greedy(30))
    engine.add_request("waiting", PROMPT, greedy(30))
    for _ in range(4):
        engine.step()
    assert engine.stats().num_blocks_used > 0
    assert engine.abort_requests(["a", "waiting", "unknown"]) == ["a", "waiting"]
    outs = run_to_end(engine)
    assert set(outs) == {"b"}
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_blocks_used == 0
    assert stats.num_blocks_free == 64


def test_shared_prefix_computes_only_new_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=4)
    shared = random_prompts([40], seed=2)[0]
    engine.generate([shared + [1, 2, 3]], greedy(2))
    assert engine.stats().num_prompt_tokens_computed == 43
    engine.add_request("second", shared + [7, 8], greedy(2))
    outs = run_to_end(engine)["second"]
    stats = engine.stats()
    assert outs[0].num_cached_tokens == 40  # ten full blocks of the shared prefix
    assert stats.num_prompt_tokens_computed == 43 + 2
    assert stats.prefix_cache_hit_tokens == 40


def test_identical_prefixes_admitted_together_are_computed_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=4)
    shared = random_prompts([40], seed=4)[0]
    # The same token ids whatever text they came from: the engine keys on ids only.
    for i, tail in enumerate([[5, 6], [7, 8], [9, 10]]):
        engine.add_request(f"r{i}", shared + tail, greedy(3))
    outs = run_to_end(engine)
    stats = engine.stats()
    assert stats.num_prompt_tokens_computed == 42 + 2 + 2
    assert [outs[f"r{i}"][0].num_cached_tokens for i in range(3)] == [0, 40, 40]
    # The dedup does not change results.
    alone = make_engine(tiny_llama_dir).generate([shared + [7, 8]], greedy(3))[0]
    assert tokens(outs["r1"]) == alone


def test_prefix_cache_off_computes_everything(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, block_size=4, prefix_caching=False)
    shared = random_prompts([40], seed=4)[0]
    engine.generate([shared + [1], shared + [2]], greedy(2))
    assert engine.stats().num_prompt_tokens_computed == 82
    assert engine.stats().prefix_cache_hit_tokens == 0


def test_prefill_admission_and_decode_batch_are_separate_knobs(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_batch=4, prefill_batch=3)
    for i, p in enumerate(random_prompts([5] * 10, seed=6)):
        engine.add_request(f"r{i}", p, greedy(6))
    engine.step()
    assert engine.stats().num_running == 3  # prefill admission per step
    engine.step()
    assert engine.stats().num_running == 4  # the decode batch caps it
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    assert peak == 4


def test_prefill_admission_above_the_decode_batch(tiny_llama_dir):
    """A burst of 6 is prefilled in one step (6 first tokens), then decodes 2 per step,
    taking turns, and every request still gets exactly its tokens."""
    engine = make_engine(tiny_llama_dir, max_batch=2, prefill_batch=6)
    prompts = random_prompts([5] * 6, seed=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(4))
    first = engine.step()
    assert len(first) == 6 and engine.stats().num_running == 6
    per_step, served = [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        per_step.append(len(outs))
        for o in outs:
            served.setdefault(o.request_id, []).append(len(per_step))
    assert max(per_step) == 2
    assert per_step[:3] == [2, 2, 2]  # turns: r0 r1, r2 r3, r4 r5
    assert [served[f"r{i}"][0] for i in range(6)] == [1, 1, 2, 2, 3, 3]
    alone = make_engine(tiny_llama_dir).generate(prompts, greedy(4))
    engine2 = make_engine(tiny_llama_dir, max_batch=2, prefill_batch=6)
    assert engine2.generate(prompts, greedy(4)) == alone


def finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finish_reason is not None]
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_batch=1, prefill_batch=1)  # one at a time
    prompts = random_prompts([5] * 5, seed=9)
    for name, priority, prompt in zip("abcde", (0, 5, -1, 0, -1), prompts):
        engine.add_request(name, prompt, greedy(3, priority=priority))
    assert finish_order(engine) == ["c", "e", "a", "d", "b"]  # FCFS: a b c d e
    # Each still gets its own tokens.
    alone = make_engine(tiny_llama_dir).generate(prompts, greedy(3))
    engine.add_request("again", prompts[1], greedy(3, priority=5))
    assert tokens(run_to_end(engine)["again"]) == alone[1]


def test_the_decode_batch_goes_to_the_lowest_priority_values_first(tiny_llama_dir):
    """Three admitted at once, a decode batch of one: b (priority 0) decodes every step
    until it is done (taking turns, it would get every third), then a and c in turns."""
    engine = make_engine(tiny_llama_dir, max_batch=1, prefill_batch=3)
    for name, priority, prompt in zip("abc", (5, 0, 5), random_prompts([5] * 3, seed=10)):
        engine.add_request(name, prompt, greedy(4, priority=priority))
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        finished.update((o.request_id, step) for o in engine.step() if o.finish_reason)
    assert finished == {"b": 4, "a": 9, "c": 10}  # the prefill step, then 3 + 3 + 3


def test_the_running_request_of_the_highest_priority_value_is_preempted(tiny_llama_dir):
    """x (priority 5) is admitted a step before w and z (priority 0), with a prompt a
    token shorter, so that all three reach their fifth block of 4 tokens in the same
    step, in a pool of 12: w is served first, and the victim is x, not z (the latest
    admitted, the rule without priorities). Every request gets its whole output."""
    engine = make_engine(tiny_llama_dir, num_blocks=12, max_batch=3)
    x, w, z = random_prompts([7, 8, 8], seed=12)
    engine.add_request("x", x, greedy(12, priority=5))
    outputs: dict[str, list] = {"x": engine.step()}
    engine.add_request("w", w, greedy(12, priority=0))
    engine.add_request("z", z, greedy(12, priority=0))
    requests = {name: engine.requests[name] for name in "xwz"}
    for name, outs in run_to_end(engine).items():
        outputs.setdefault(name, []).extend(outs)
    assert {n: r.num_preemptions for n, r in requests.items()} == {"x": 1, "w": 0, "z": 0}
    alone = make_engine(tiny_llama_dir).generate([x, w, z], greedy(12))
    assert [tokens(outputs[n]) for n in "xwz"] == alone


def run_collecting(engine, outputs: dict) -> dict:
    for name, outs in run_to_end(engine).items():
        outputs.setdefault(name, []).extend(outs)
    return outputs


def test_a_waiting_request_preempts_a_running_one_of_a_higher_priority_value(tiny_llama_dir):
    """One request runs at a time. low (priority 5) is decoding when high (0) and same
    (5) arrive: high takes low's place at once and finishes first; same, of low's
    value, waits, and low resumes before it (its place in the queue). Everyone gets
    its whole output."""
    engine = make_engine(tiny_llama_dir, max_batch=1, prefill_batch=1)
    low, high, same = random_prompts([6, 6, 6], seed=13)
    engine.add_request("low", low, greedy(8, priority=5))
    outputs = run_collecting_steps(engine, 2)
    engine.add_request("same", same, greedy(4, priority=5))
    engine.add_request("high", high, greedy(4, priority=0))
    low_request = engine.requests["low"]
    finished = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
            if o.finish_reason is not None:
                finished.append(o.request_id)
    assert finished == ["high", "low", "same"]
    assert low_request.num_preemptions == 1
    alone = make_engine(tiny_llama_dir)
    assert [tokens(outputs[n]) for n in ("low", "high", "same")] == [
        alone.generate([p], greedy(n))[0] for p, n in ((low, 8), (high, 4), (same, 4))]


def run_collecting_steps(engine, n: int) -> dict:
    outputs: dict = {}
    for _ in range(n):
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def test_a_waiting_request_takes_the_blocks_of_higher_priority_values(tiny_llama_dir):
    """A pool of 10 blocks of 4: low (priority 3, 20-token prompt) holds 6 of them;
    high (priority 1) needs 5 for its 18-token prompt: low is preempted for it, and
    mid (priority 1, like high) is not, though it holds blocks too."""
    engine = make_engine(tiny_llama_dir, num_blocks=10, max_batch=4)
    mid, low, high = random_prompts([6, 20, 18], seed=14)
    engine.add_request("mid", mid, greedy(3, priority=1))
    engine.add_request("low", low, greedy(3, priority=3))
    outputs = run_collecting_steps(engine, 1)
    engine.add_request("high", high, greedy(3, priority=1))
    requests = {n: engine.requests[n] for n in ("mid", "low", "high")}
    run_collecting(engine, outputs)
    assert {n: r.num_preemptions for n, r in requests.items()} == {
        "mid": 0, "low": 1, "high": 0}
    alone = make_engine(tiny_llama_dir).generate([mid, low, high], greedy(3))
    assert [tokens(outputs[n]) for n in ("mid", "low", "high")] == alone


def test_no_request_is_preempted_for_one_that_would_still_not_fit(tiny_llama_dir):
    """high (0) needs 9 blocks of a pool of 10 while equal (0) holds 2 of them: taking
    low's (5) would not be enough, so low keeps running."""
    engine = make_engine(tiny_llama_dir, num_blocks=10, max_batch=4, budget=64)
    equal, low, high = random_prompts([6, 6, 34], seed=15)
    engine.add_request("equal", equal, greedy(6, priority=0))
    engine.add_request("low", low, greedy(6, priority=5))
    run_collecting_steps(engine, 1)
    engine.add_request("high", high, greedy(2, priority=0))
    low_request = engine.requests["low"]
    run_to_end(engine)
    assert low_request.num_preemptions == 0


def test_token_budget_chunks_long_prompts(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, budget=16)
    engine.add_request("long", random_prompts([50], seed=1)[0], greedy(2))
    computed = []
    while engine.has_unfinished_requests():
        before = engine.stats().num_prompt_tokens_computed
        engine.step()
        computed.append(engine.stats().num_prompt_tokens_computed - before)
    assert computed[:4] == [16, 16, 16, 2]


def test_engine_config_rejects_bad_knobs():
    from common.config import CacheConfig, EngineConfig, SchedulerConfig

    with pytest.raises(ValueError, match="prefill_max_batch_size must be a positive integer"):
        SchedulerConfig(prefill_max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(max_batch_size=-1)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
