"""One bad request fails alone: whatever goes wrong for one request (its sampling, its
logits, its post-processing, or a forward pass it breaks) ends that request with an
error; the others in the same batch finish with exactly the output they would have had
alone, and the prefix cache keeps what is known good."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.protocol import FinishReason, SamplingParams
from engine_worker.cpu.fused import FusedForward
from engine_worker.step_failures import FatalDeviceError
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

PROMPTS = random_prompts([9, 14, 5], seed=11)


def reference(model_dir, prompts, params) -> list[list[int]]:
    return make_engine(model_dir).generate(prompts, params)


def raise_on_output(n: int):
    """A logits processor that raises once the request has n output tokens."""
    def processor(row, request):
        if request.num_output_tokens >= n:
            raise RuntimeError("injected failure")
    return processor


def test_a_tiny_temperature_is_greedy_and_fails_nobody(tiny_llama_dir):
    want = reference(tiny_llama_dir, PROMPTS[:2], greedy(12))
    engine = make_engine(tiny_llama_dir)
    engine.add_request("tiny", PROMPTS[0], SamplingParams(max_tokens=12, temperature=1e-39,
                                                          ignore_eos=True))
    engine.add_request("valid", PROMPTS[1], greedy(12))
    out = run_to_end(engine)
    assert tokens(out["tiny"]) == want[0]
    assert tokens(out["valid"]) == want[1]
    assert all(o.finish_reason is not FinishReason.ERROR for outs in out.values() for o in outs)


def test_a_failing_logits_processor_fails_only_its_request(tiny_llama_dir):
    want = reference(tiny_llama_dir, PROMPTS, greedy(10))
    engine = make_engine(tiny_llama_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(10))
    engine.requests["r1"].logits_processors.append(raise_on_output(3))
    out = run_to_end(engine)
    assert tokens(out["r0"]) == want[0] and tokens(out["r2"]) == want[2]
    bad = out["r1"]
    assert tokens(bad) == want[1][:3]
    assert bad[-1].finish_reason is FinishReason.ERROR
    assert "logits processing failed: RuntimeError: injected failure" in bad[-1].error
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    # The failed request's KV was good: its prompt's full blocks stay cached.
    before = stats.prefix_cache_hit_tokens
    engine.generate([PROMPTS[1] + [7]], greedy(1))
    assert engine.stats().prefix_cache_hit_tokens - before == 12  # 3 blocks of 4


def test_nan_or_fully_masked_logits_fail_only_their_row(tiny_llama_dir):
    want = reference(tiny_llama_dir, PROMPTS[:1], greedy(6))
    engine = make_engine(tiny_llama_dir)
    engine.add_request("ok", PROMPTS[0], greedy(6))
    engine.add_request("nan", PROMPTS[1], greedy(6))
    engine.add_request("masked", PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.8,
                                                            seed=1, ignore_eos=True))
    engine.requests["nan"].logits_processors.append(lambda row, r: row.fill_(float("nan")))
    engine.requests["masked"].logits_processors.append(lambda row, r: row.fill_(float("-inf")))
    out = run_to_end(engine)
    assert tokens(out["ok"]) == want[0]
    assert out["nan"] == [out["nan"][0]] and out["nan"][0].error == "the logits hold NaN"
    assert out["masked"][0].error == "every token is excluded (all logits are -inf)"
    assert out["masked"][0].finish_reason is FinishReason.ERROR


def test_a_seeded_neighbour_draws_as_if_the_failed_row_were_not_there(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True)
    want = reference(tiny_llama_dir, PROMPTS[:1], params)[0]
    engine = make_engine(tiny_llama_dir)
    engine.add_request("bad", PROMPTS[1], SamplingParams(max_tokens=8, temperature=1.0,
                                                         seed=5, ignore_eos=True))
    engine.add_request("seeded", PROMPTS[0], params)
    engine.requests["bad"].logits_processors.append(raise_on_output(2))
    out = run_to_end(engine)
    assert tokens(out["seeded"]) == want
    assert out["bad"][-1].finish_reason is FinishReason.ERROR


def test_a_failure_after_sampling_fails_only_its_request(tiny_llama_dir):
    want = reference(tiny_llama_dir, PROMPTS, greedy(5))
    engine = make_engine(tiny_llama_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(5))
    victim = engine.requests["r0"]

    def broken_check_stop(max_model_len):
        raise KeyError("injected")

    victim.check_stop = broken_check_stop
    out = run_to_end(engine)
    assert out["r0"][-1].finish_reason is FinishReason.ERROR
    assert "internal error: KeyError" in out["r0"][-1].error
    assert [tokens(out["r1"]), tokens(out["r2"])] == want[1:]
    assert engine.stats().num_blocks_used == 0


def test_a_sampler_that_fails_on_the_batch_is_retried_row_by_row(tiny_llama_dir):
    want = reference(tiny_llama_dir, PROMPTS, greedy(4))
    engine = make_engine(tiny_llama_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(4))
    sampler = engine.runner.sampler

    class Picky:
        """Raises whenever "r2" is among the rows (a bug its values trigger)."""
        def launch(self, logits, requests):
            if any(r.request_id == "r2" for r in requests):
                raise ValueError("injected sampler bug")
            return sampler.launch(logits, requests)

        def __call__(self, logits, requests):
            return self.launch(logits, requests).result()

    engine.runner.sampler = Picky()
    out = run_to_end(engine)
    assert [tokens(out["r0"]), tokens(out["r1"])] == want[:2]
    assert out["r2"] == [out["r2"][0]]
    assert out["r2"][0].error == "sampling failed: ValueError: injected sampler bug"


MARKER = 4242


def forward_pass(engine):
    """What runs a step's forward pass: the one-call C path when it is on, else the
    model layer by layer. Both take the step's input ids first."""
    step = engine.runner.step
    return step.fused if isinstance(step, FusedForward) else engine.runner.model


def test_a_forward_pass_one_request_breaks_fails_only_that_request(tiny_llama_dir):
    shared = random_prompts([16], seed=5)[0]  # 4 full blocks of 4
    cached = random_prompts([12], seed=6)[0]
    victim = shared + [MARKER]
    dependent = shared + [11]  # attaches the victim's blocks in the same step
    bystander = PROMPTS[0]
    want = reference(tiny_llama_dir, [dependent, bystander, cached + [3]], greedy(6))

    engine = make_engine(tiny_llama_dir)
    engine.generate([cached + [1]], greedy(1))  # leaves 3 blocks of `cached` in the cache
    model = forward_pass(engine)
    forward = model.forward

    def breaks_on_marker(input_ids, *args):
        if (input_ids == MARKER).any():
            raise RuntimeError("injected kernel fault")
        return forward(input_ids, *args)

    model.forward = breaks_on_marker
    engine.add_request("victim", victim, greedy(6))
    engine.add_request("dependent", dependent, greedy(6))
    engine.add_request("bystander", bystander, greedy(6))
    first = engine.step()
    assert engine.requests["dependent"].num_preemptions == 1  # read the victim's KV
    out = run_to_end(engine)
    for o in first:
        out.setdefault(o.request_id, []).insert(0, o)
    assert out["victim"][-1].finish_reason is FinishReason.ERROR
    assert "engine step failed: RuntimeError: injected kernel fault" in out["victim"][-1].error
    assert tokens(out["victim"]) == []
    assert tokens(out["dependent"]) == want[0]
    assert tokens(out["bystander"]) == want[1]
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0
    # What was cached before the failure is still served from the cache.
    before = stats.prefix_cache_hit_tokens
    assert engine.generate([cached + [3]], greedy(6)) == [want[2]]
    assert engine.stats().prefix_cache_hit_tokens - before == 12


def test_a_forward_pass_failure_that_is_not_one_requests_fails_nothing(tiny_llama_dir):
    """A batch-level fault (here: the first batched call of the step raises) is
    retried request by request, and every request finishes normally."""
    want = reference(tiny_llama_dir, PROMPTS, greedy(5))
    engine = make_engine(tiny_llama_dir)
    model = forward_pass(engine)
    forward = model.forward
    calls = []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return forward(*args)

    model.forward = fails_once
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(5))
    out = run_to_end(engine)
    assert [tokens(out[f"r{i}"]) for i in range(3)] == want
    assert len(calls) == 5 + 3  # 5 batched steps, one of them retried as 3 solo runs


def test_an_out_of_memory_step_fails_only_the_request_that_needs_it(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    forward = engine.runner.forward

    def forward_oom_on_long(scheduled):
        if any(s.num_tokens > 10 for s in scheduled):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return forward(scheduled)

    engine.runner.forward = forward_oom_on_long
    engine.add_request("long", random_prompts([20], seed=3)[0], greedy(3))
    engine.add_request("short", PROMPTS[0], greedy(3))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    assert out["long"][-1].finish_reason is FinishReason.ERROR
    assert "out of memory" in out["long"][-1].error
    assert sum(len(o.new_token_ids) for o in out["short"]) == 3


def test_a_sticky_cuda_error_is_fatal_to_the_engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)

    def broken(scheduled):
        raise RuntimeError("CUDA error: unspecified launch failure")

    engine.runner.forward = broken
    engine.add_request("a", PROMPTS[0], greedy(3))
    with pytest.raises(FatalDeviceError, match="unspecified launch failure"):
        engine.step()


def test_a_failed_step_of_a_model_split_over_ranks_is_fatal(tiny_llama_dir, monkeypatch):
    """Rank 0 cannot rerun requests one by one while its peers wait in the step: the
    engine exits (to be restarted) with the reason."""
    engine = make_engine(tiny_llama_dir)

    def broken(scheduled):
        raise RuntimeError("injected")

    engine.runner.forward = broken
    monkeypatch.setattr(engine.runner, "parallel",
                        dataclasses.replace(engine.runner.parallel, size=2))
    engine.add_request("a", PROMPTS[0], greedy(3))
    with pytest.raises(FatalDeviceError, match="tensor-parallel ranks.*injected"):
        engine.step()
