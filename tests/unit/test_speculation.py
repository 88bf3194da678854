"""N-gram speculation (--speculative-tokens): proposals from a request's own text,
checked in one step; the output is exactly what decoding token by token gives, in
fewer steps where the text repeats itself (a tiny random model's greedy output falls
into loops, which it copies). In process; through the engine process and HTTP:
tests/e2e/test_speculation_served.py."""

from __future__ import annotations

import pytest

from common.protocol import FinishReason, SamplingParams
from common.structured import StructuredOutput
from common.ngram import Prediction, propose
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

# Prompts that repeat themselves, and random ones.
LOOPS = [[11, 22, 33, 44] * 5, [7, 8, 9] * 6 + [7]]
PROMPTS = LOOPS + random_prompts([9, 14], seed=21)


def test_proposals_follow_the_latest_earlier_occurrence():
    assert propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert propose([1, 2, 3, 9, 2, 3, 8, 2, 3], 2) == [8, 2]  # the latest one
    assert propose([5, 1, 2, 3, 6, 0, 2, 3, 7, 1, 2, 3], 1) == [6]  # the longest n first
    assert propose([1, 2, 3, 4], 3) == [] and propose([1, 2, 1, 2], 0) == []
    # ids whose bytes match across two ids are not matches
    assert propose([256, 1, 0, 0, 1, 5, 0, 1], 2) == [5, 0]


def speculating(model_dir, k=4, **kw):
    from common.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine_worker.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", speculative_tokens=k,
        cpu_kernels=kw.get("cpu_kernels", True), quantization=kw.get("quantization"),
        cache=CacheConfig(block_size=4, num_blocks=kw.get("num_blocks", 512)),
        scheduler=SchedulerConfig(max_batch_size=kw.get("max_batch", 64),
                                  max_num_batched_tokens=kw.get("budget"))))


def assert_cache_holds_only_known_tokens(engine, request):
    """Every block of the request in the prefix cache holds the request's own tokens
    (a rejected proposal's block, overwritten since, must not be there)."""
    bs = engine.block_manager.block_size
    for i, block_id in enumerate(request.blocks.block_ids):
        block = engine.block_manager.blocks[block_id]
        if block.block_hash is not None:
            assert block.token_ids == tuple(request.token_ids[i * bs:(i + 1) * bs])


@pytest.mark.parametrize("k", [1, 4])
def test_the_output_is_token_by_tokens_in_fewer_steps(tiny_llama_dir, k):
    plain = make_engine(tiny_llama_dir)
    expected = plain.generate(PROMPTS, greedy(40))
    engine = speculating(tiny_llama_dir, k)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(40))
    steps = 0
    outs: dict = {}
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        for request in engine.scheduler.running:
            assert_cache_holds_only_known_tokens(engine, request)
    assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == expected
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    assert stats.num_generated_tokens == 40 * len(PROMPTS)
    # Each step yields one token per request, plus those it kept.
    assert steps < 41 and any(len(o.new_token_ids) > 1 for out in outs.values() for o in out)
    assert stats.num_blocks_used == 0  # everything given back


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_the_torch_path_too(request, model):
    """Without the C kernels (and for GPT-2, which never takes them) the step runs
    through torch's layers: the same tokens as decoding one at a time."""
    model_dir = request.getfixturevalue(model)
    expected = make_engine(model_dir, cpu_kernels=False).generate(PROMPTS[:2], greedy(30))
    engine = speculating(model_dir, 4, cpu_kernels=False)
    assert engine.generate(PROMPTS[:2], greedy(30)) == expected
    assert engine.stats().num_accepted_tokens > 0


def test_stops_lengths_and_requests_that_do_not_speculate_in_one_batch(tiny_llama_dir):
    """A stop token inside kept proposals ends the request there; max_tokens is never
    passed; sampled, constrained and logprob-wanting requests decode as usual beside
    them; the same outputs as without speculation."""
    plain = make_engine(tiny_llama_dir)
    loop = plain.generate([LOOPS[0]], greedy(30))[0]
    # a token it generates first after a run of repeats (kept proposals)
    at = next(i for i in range(12, 30) if loop[i] not in loop[:i])
    stop = loop[at]
    cases = {
        "stop": (LOOPS[0], greedy(30, stop_token_ids=[stop])),
        "free": (LOOPS[1], greedy(30)),
        "short": (LOOPS[1], greedy(7)),
        "seeded": (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                              ignore_eos=True)),
        "regex": (PROMPTS[3], greedy(30, structured=StructuredOutput(
            kind="regex", spec=r" (cat|dog) [0-9]{3}\."))),
        "logprobs": (LOOPS[1], greedy(20, logprobs=2)),
        "penalty": (LOOPS[0], greedy(20, repetition_penalty=1.3)),
    }
    expected = {}
    for name, (prompt, params) in cases.items():
        plain.add_request(name, prompt, params)
    expected = run_to_end(plain)
    engine = speculating(tiny_llama_dir, 4)
    for name, (prompt, params) in cases.items():
        engine.add_request(name, prompt, params)
    got = run_to_end(engine)
    for name in cases:
        assert tokens(got[name]) == tokens(expected[name]), name
        assert got[name][-1].finish_reason == expected[name][-1].finish_reason, name
    assert got["stop"][-1].finish_reason is FinishReason.STOP
    assert tokens(got["stop"]) == loop[:at + 1]
    assert len(tokens(got["short"])) == 7
    assert [o.logprobs for o in got["logprobs"]] == [o.logprobs for o in expected["logprobs"]]
    assert engine.stats().num_accepted_tokens > 0


def test_proposals_never_cost_a_place_and_their_blocks_stay_out_of_the_cache(tiny_llama_dir):
    """A pool too small for every request's proposals, a small token budget, and the
    same prompts twice (the second time from the prefix cache): outputs as without
    speculation, and no proposal caused a preemption."""
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(24))
    engine = speculating(tiny_llama_dir, 6, num_blocks=36, budget=12)
    for attempt in range(2):
        assert engine.generate(PROMPTS, greedy(24)) == expected, attempt
    without = make_engine(tiny_llama_dir, num_blocks=36, budget=12)
    without.generate(PROMPTS, greedy(24))
    without.generate(PROMPTS, greedy(24))
    assert engine.stats().num_preemptions == without.stats().num_preemptions > 0
    assert engine.stats().num_accepted_tokens > 0


def drafts_per_step(engine) -> list[int]:
    """Step until idle: the tokens proposed in each step."""
    per_step = []
    while engine.has_unfinished_requests():
        before = engine.stats().num_draft_tokens
        engine.step()
        per_step.append(engine.stats().num_draft_tokens - before)
    return per_step


def test_proposals_stop_where_rows_stop_being_free(tiny_llama_dir):
    """A step's decodes and proposals stay within MAX_STEP_ROWS (8): eight decoding
    requests propose nothing, seven one token a step between them."""
    from engine_worker.speculation import MAX_STEP_ROWS

    engine = speculating(tiny_llama_dir, 4)
    engine.generate([LOOPS[0]] * MAX_STEP_ROWS, greedy(30))
    assert engine.stats().num_draft_tokens == 0
    for i in range(MAX_STEP_ROWS - 1):
        engine.add_request(f"r{i}", LOOPS[0], greedy(30))
    assert max(drafts_per_step(engine)) == 1 and engine.stats().num_accepted_tokens > 0


def test_4_bit_weights_take_fewer_rows(tiny_llama_dir):
    """With 4-bit weights a step's decodes and proposals stay within 5 rows: four
    decoding requests propose one token a step between them."""
    from engine_worker.speculation import MAX_STEP_ROWS_Q4

    engine = speculating(tiny_llama_dir, 4, quantization="q4")
    for i in range(MAX_STEP_ROWS_Q4 - 1):
        engine.add_request(f"r{i}", LOOPS[0], greedy(30))
    assert max(drafts_per_step(engine)) == 1


def test_iq4_weights_take_as_few_rows_as_4_bit_ones(tiny_llama_dir):
    """IQ4 weights, multiplied as 4-bit ones are (nibbles looked up first), get their
    step's row limit."""
    from engine_worker.speculation import MAX_STEP_ROWS, MAX_STEP_ROWS_Q4

    assert speculating(tiny_llama_dir, 4, quantization="iq4").scheduler.max_step_rows == \
        MAX_STEP_ROWS_Q4 < MAX_STEP_ROWS == speculating(tiny_llama_dir, 4).scheduler.max_step_rows


def test_a_check_on_logits_that_are_not_finite_fails_its_request_alone(tiny_llama_dir):
    """The logits of one request's proposed tokens turned NaN: it ends with an error
    naming them, the other request gets its whole output."""
    import torch

    expected = make_engine(tiny_llama_dir).generate([LOOPS[1]], greedy(30))[0]
    engine = speculating(tiny_llama_dir, 4)
    forward = engine.runner.forward

    def poisoned(*args, **kw):
        logits = forward(*args, **kw)
        engine.runner.draft_logits = [
            (r, torch.full_like(rows, float("nan")) if r.request_id == "bad" else rows)
            for r, rows in engine.runner.draft_logits]
        return logits

    engine.runner.forward = poisoned
    engine.add_request("bad", LOOPS[0], greedy(30))
    engine.add_request("good", LOOPS[1], greedy(30))
    outs = run_to_end(engine)
    assert outs["bad"][-1].finish_reason is FinishReason.ERROR
    assert "the logits are not finite" in outs["bad"][-1].error
    assert tokens(outs["good"]) == expected
    assert engine.stats().num_blocks_used == 0


def test_a_sampled_check_draws_each_token_with_its_probability():
    """check_sampled over 200,000 rows of one distribution: whatever the proposal (a
    likely token, an unlikely one, one the distribution excludes), each token comes
    out with its probability."""
    import torch

    from engine_worker.speculation import check_sampled

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(0)
    n = 200_000
    for proposal in range(4):
        out = check_sampled(p.expand(n, 4), torch.full((n,), proposal), generator)
        share = torch.bincount(out, minlength=4).float() / n
        assert torch.allclose(share, p, atol=0.006), (proposal, share)


def test_sampled_requests_speculate_too(tiny_llama_dir):
    """Sampled, unseeded requests propose and keep tokens: at a temperature that leaves
    the most likely token all the probability, the greedy output; at 1.0 with top_k 3
    every token is one of each step's three most likely (a request seeded decodes as
    usual, see the test above)."""
    expected = make_engine(tiny_llama_dir).generate(PROMPTS, greedy(30))
    engine = speculating(tiny_llama_dir, 4)
    cold = SamplingParams(max_tokens=30, temperature=1e-3, ignore_eos=True)
    assert engine.generate(PROMPTS, cold) == expected
    assert engine.stats().num_accepted_tokens > 0
    warm = SamplingParams(max_tokens=30, temperature=1.0, top_k=3, ignore_eos=True)
    before = engine.stats().num_draft_tokens
    outputs = engine.generate([LOOPS[0]] * 2, warm)
    assert [len(o) for o in outputs] == [30, 30]
    assert engine.stats().num_draft_tokens > before
    from transformers import AutoModelForCausalLM
    import torch

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for out in outputs:
        with torch.no_grad():
            logits = hf(torch.tensor([LOOPS[0] + out])).logits[0]
        top3 = logits[len(LOOPS[0]) - 1:-1].topk(3).indices
        assert all(t in row for t, row in zip(out, top3.tolist()))


def test_speculation_is_refused_where_it_cannot_run():
    from common.config import EngineConfig

    for kw, message in (({"speculative_tokens": 17}, "must be in 0..16"),
                        ({"speculative_tokens": 2, "device": "cuda"}, "CPU engine"),
                        ({"speculative_tokens": 2, "async_scheduling": True},
                         "not with async scheduling")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kw)


# -- a predicted output (OpenAI's prediction) --------------------------------------------


def test_a_prediction_proposes_what_follows_where_the_output_is():
    p = Prediction([1, 2, 3, 4, 5, 6, 7, 8])
    assert p.propose([], 3) == [1, 2, 3]            # from its start
    assert p.propose([1, 2], 3) == [3, 4, 5]        # followed
    assert p.propose([1, 2, 9], 3) == []            # departed, nothing to find yet
    assert p.propose([1, 2, 9, 5, 6], 3) == [7, 8]  # found again from the last tokens
    assert p.propose([1, 2, 9, 5, 6, 7, 8], 3) == []   # its end
    # Found again after where it was lost, before anywhere else.
    p = Prediction([5, 6, 7, 8, 5, 6, 9])
    assert p.propose([5, 6, 7, 8, 0, 5, 6], 2) == [9]
    # Ids whose bytes match across two ids are not matches.
    p = Prediction([256, 1, 0, 0, 1, 5])
    assert p.propose([7, 0, 1], 2) == [5]
    # OpenAI's counts: the prediction's tokens the output holds where it put them
    # (3 and 4 replaced by 9: the rest found again), and the others.
    assert Prediction([1, 2, 3, 4, 5, 6, 7, 8]).count([1, 2, 9, 5, 6, 7, 8]) == (6, 2)
    assert Prediction([1, 2, 3]).count([]) == (0, 3)
    assert Prediction([1, 2, 3]).count([1, 2, 3, 4]) == (3, 0)
    counted = Prediction([5, 6, 7, 8, 5, 6, 9])
    assert counted.count([5, 6, 7, 8, 0]) == (4, 3)
    assert counted.count([5, 6, 7, 8, 0, 5, 6, 9]) == (7, 0)   # as its tokens come


def run_counting(engine, requests):
    """Steps and outputs of ``requests`` (id -> (prompt, params)) run together."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    steps, outs = 0, {}
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return steps, outs


def test_a_predicted_output_is_the_output_in_fewer_steps(tiny_llama_dir):
    """The same tokens as decoding one at a time, whatever the prediction; the steps
    fewer as it is right, found again past a part it got wrong."""
    prompt = random_prompts([12], seed=5)[0]
    expected = make_engine(tiny_llama_dir).generate([prompt], greedy(48))[0]
    wrong = list(expected)
    wrong[20:24] = [3, 1, 4, 1]   # a changed stretch in the middle
    results = {}
    for name, prediction in (("none", []), ("right", expected), ("wrong", wrong),
                             ("unrelated", random_prompts([48], seed=9)[0])):
        engine = speculating(tiny_llama_dir, 8)
        steps, outs = run_counting(engine, {"r": (prompt, greedy(48, prediction=prediction))})
        assert outs["r"] == expected, name
        results[name] = (steps, engine.stats().num_accepted_tokens)
        assert engine.stats().num_blocks_used == 0
    assert results["right"][1] >= 40 and results["right"][0] <= 12, results
    assert results["wrong"][1] >= 30 and results["wrong"][0] < results["none"][0], results
    assert results["right"][0] < results["wrong"][0] <= results["unrelated"][0], results


def test_a_prediction_saves_steps_on_an_engine_that_does_not_speculate(tiny_llama_dir):
    """Without --speculative-tokens the CPU engine speculates for requests that carry a
    prediction only: the right one's 48 tokens in a few steps (up to 7 proposals a
    step); a request without one, beside it or alone, a token a step and no proposal."""
    prompt = random_prompts([12], seed=5)[0]
    expected = make_engine(tiny_llama_dir).generate([prompt], greedy(48))[0]
    engine = make_engine(tiny_llama_dir)
    steps, outs = run_counting(engine, {"r": (prompt, greedy(48, prediction=expected))})
    assert outs["r"] == expected and steps <= 12, steps
    assert engine.stats().num_accepted_tokens >= 40
    engine = make_engine(tiny_llama_dir)
    steps, outs = run_counting(engine, {"r": (prompt, greedy(48))})
    assert outs["r"] == expected and steps == 48
    assert engine.stats().num_draft_tokens == 0


def test_a_prediction_past_the_limit_is_refused():
    from common.errors import InvalidRequestError
    from common.sampling_params import MAX_PREDICTION_TOKENS

    SamplingParams(prediction=[1] * MAX_PREDICTION_TOKENS).validate()
    with pytest.raises(InvalidRequestError, match=f"prediction has {MAX_PREDICTION_TOKENS + 1} "
                                                  f"tokens, more than the {MAX_PREDICTION_TOKENS}"):
        SamplingParams(prediction=[1] * (MAX_PREDICTION_TOKENS + 1)).validate()
