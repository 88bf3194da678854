"""Sampling: seeded reproducibility, greedy equivalences, penalties, cut-offs, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from common.protocol import SamplingParams
from engine_worker.request import Request
from engine_worker.sampler import (Sampler, apply_min_p, apply_penalties, apply_top_k, apply_top_p,
                                   exponential_race)
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

PROMPTS = random_prompts([7, 19, 3], seed=3)


def req(prompt, output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100,
                eos_token_ids=frozenset({0}))
    for t in output:
        r.append_token(t)
    return r


def test_seed_reproduces_regardless_of_batch(tiny_llama_dir):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine(tiny_llama_dir)
    alone = engine.generate([PROMPTS[0]], params)[0]
    # Same request among unseeded and differently seeded neighbours.
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.0))
    engine.add_request("b", PROMPTS[0], params)
    engine.add_request("c", PROMPTS[2], SamplingParams(max_tokens=9, temperature=0.7, seed=5))
    batched = tokens(run_to_end(engine)["b"])
    assert batched == alone
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(
        max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True))[0]
    assert other_seed != alone


def test_top_k_1_equals_greedy(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    want = engine.generate(PROMPTS, greedy(10))
    got = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.5, top_k=1,
                                                  ignore_eos=True))
    assert got == want


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [req([0, 1], output=[2], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    r = req([4, 4, 4], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [r])
    # token 1: twice -> 0.5 + 2 * 0.25; token 2: once -> 0.5 + 0.25; prompt token 4: none.
    assert logits.tolist() == [[0.0, -1.0, -0.75, 0.0, 0.0]]


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.isinf(apply_top_k(logits, [2])).tolist() == [[False, False, True, True]]
    # 0.5 + 0.25 reaches 0.7: the third token is cut; exactly reaching stops too.
    assert torch.isinf(apply_top_p(logits, [0.7])).tolist() == [[False, False, True, True]]
    assert torch.isinf(apply_top_p(logits, [0.75])).tolist() == [[False, False, True, True]]
    assert torch.isinf(apply_top_p(logits, [0.76])).tolist() == [[False, False, False, True]]
    assert torch.isinf(apply_top_p(logits, [0.01])).tolist() == [[False, True, True, True]]
    probs = logits.softmax(-1)
    # min_p 0.4: threshold 0.2 of the top 0.5: keeps 0.5 and 0.25.
    assert (apply_min_p(probs, [0.4]) == 0).tolist() == [[False, False, True, True]]


def test_temperature_sampling_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).expand(2000, 3).clone()
    requests = [req([1], temperature=1.0) for _ in range(2000)]
    ids = sampler(logits, requests).token_ids
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / 2000
    assert torch.allclose(freq, probs, atol=0.04), freq
    # Temperature 0.25 sharpens: p^4 normalized -> token 0 with ~0.94.
    requests = [req([1], temperature=0.25) for _ in range(2000)]
    ids = sampler(logits.clone(), requests).token_ids
    assert sum(1 for i in ids if i == 0) / 2000 > 0.9


def test_min_tokens_bans_stop_tokens_until_reached():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 10.0, 5.0]])  # token 1 would win
    early = req([2], output=[2], temperature=0.0, stop_token_ids=[1], min_tokens=2)
    ids = sampler(logits.clone(), [early]).token_ids
    assert ids == [2]
    done = req([2], output=[2, 2], temperature=0.0, stop_token_ids=[1], min_tokens=2)
    ids = sampler(logits.clone(), [done]).token_ids
    assert ids == [1]


def test_logprobs_match_reference_log_softmax(tiny_llama_dir):
    from hf_reference import hf_model

    engine = make_engine(tiny_llama_dir)
    prompt = PROMPTS[1]
    engine.add_request("lp", prompt, greedy(5, logprobs=3))
    outs = run_to_end(engine)["lp"]
    generated = tokens(outs)
    model = hf_model(tiny_llama_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, out in enumerate(outs):
        (lp,) = out.logprobs
        row = ref[len(prompt) - 1 + i]
        token = out.new_token_ids[0]
        assert math.isclose(lp.logprob, float(row[token]), abs_tol=1e-4)
        want_ids = torch.topk(row, 3).indices.tolist()
        assert lp.top_token_ids == want_ids
        assert lp.top_token_ids[0] == token  # greedy picks the most likely
        for tid, value in zip(lp.top_token_ids, lp.top_logprobs):
            assert math.isclose(value, float(row[tid]), abs_tol=1e-4)


def test_logprobs_zero_returns_only_the_chosen_token(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("lp", PROMPTS[0], greedy(2, logprobs=0))
    outs = run_to_end(engine)["lp"]
    assert all(o.logprobs[0].top_token_ids == [] and o.logprobs[0].logprob <= 0 for o in outs)


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_p=0.9, seed=7),
    dict(temperature=1.2, top_k=50, min_p=0.05, seed=7),
    dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
])
def test_mixed_batch_runs_every_path(tiny_llama_dir, params):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, **params))
    engine.add_request("g", PROMPTS[1], greedy(8))
    outs = run_to_end(engine)
    assert len(tokens(outs["x"])) == 8 and len(tokens(outs["g"])) == 8
    assert tokens(outs["g"]) == make_engine(tiny_llama_dir).generate([PROMPTS[1]], greedy(8))[0]


def test_exponential_race_draws_each_token_with_its_probability():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0]).expand(20000, 4).contiguous()
    requests = [req([1], temperature=1.0)] * 20000
    draws = exponential_race(probs, requests, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015), freq
    assert freq[3] == 0  # a zero probability is never drawn


def test_exponential_race_seeded_rows_ignore_their_neighbours():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)

    def draws(neighbours):
        seeded = req([1], temperature=1.0, seed=77)
        rows = [req([1], temperature=1.0) for _ in range(neighbours)] + [seeded]
        batch = torch.cat([probs[:1].expand(neighbours, 50), probs[2:]])
        out = []
        for _ in range(5):
            out.append(int(exponential_race(batch, rows, torch.Generator().manual_seed(9))[-1]))
        return out

    assert draws(0) == draws(2) == draws(5)
    assert len(set(draws(0))) > 1  # the generator advances step to step


def test_a_vanishing_top_p_keeps_the_most_likely_token(tiny_llama_dir):
    """top_p 1e-45 is a denormal float32, which the C kernels' fast math (flush to
    zero) reads as 0: the cut-off must still keep the most likely token."""
    engine = make_engine(tiny_llama_dir)
    got = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=1.0,
                                                       top_p=1e-45, ignore_eos=True))[0]
    want = engine.generate([PROMPTS[0]], greedy(4))[0]
    assert got == want  # only the most likely token survives: greedy
    logits = torch.tensor([[3.0, 1.0, 2.0]])
    assert torch.isinf(apply_top_p(logits, [0.0])).tolist() == [[False, True, True]]


@pytest.mark.parametrize("width", [5, 16, 49152 + 7])  # tail only; vectors; vectors + tail
def test_greedy_rows_on_the_c_kernels_match_the_torch_path(width):
    """An all-greedy batch on the CPU kernels takes each row's token and validity code
    in one C pass; the tokens and errors must be the torch path's exactly: the first
    index of a tie, and NaN, +inf and all -inf rows failed with their own messages."""
    from engine_worker.cpu.build import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, width, generator=g)
    rows[1, width // 3] = rows[1, width - 1] = 50.0        # a tie: the first index wins
    rows[2, width - 1] = float("nan")                      # NaN in the tail, or a lane
    rows[3, width // 2] = float("inf")
    rows[4] = float("-inf")
    rows[5, :] = float("-inf")
    rows[5, width - 2] = -1e30                             # one finite value is enough
    rows[6, 0] = float("nan")                              # NaN in the first vector
    rows[7, width // 2] = float("-inf")                    # a -inf among finite values
    requests = [req([1, 2], max_tokens=4, temperature=0.0) for _ in range(8)]
    fast = Sampler(torch.device("cpu"), 0, kernels)(rows.clone(), requests)
    slow = Sampler(torch.device("cpu"), 0, None)(rows.clone(), requests)
    assert fast.token_ids == slow.token_ids
    assert fast.errors == slow.errors == {2: "the logits hold NaN", 3: "the logits hold +inf",
                                          4: "every token is excluded (all logits are -inf)",
                                          6: "the logits hold NaN"}
    assert fast.token_ids[1] == width // 3 and fast.token_ids[5] == width - 2
    assert kernels.greedy_rows(rows[[0, 1]]) == [(int(rows[0].argmax()), 0), (width // 3, 0)]
