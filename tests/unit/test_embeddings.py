"""Embeddings (SamplingParams.embed, engine_worker/forward.py's pool): the default
model's final hidden states pooled (last token, mean) and normalized equal Hugging
Face's, chunked prompts and batched beside generations included."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.errors import InvalidRequestError
from common.protocol import SamplingParams
from engine_worker.engine import LLMEngine
from helpers import greedy, random_prompts

PROMPTS = random_prompts([5, 40, 17], seed=3, vocab=49152)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_hf_pooled_hidden_states(default_model_dir, pooling):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = []
        for p in PROMPTS:
            h = hf(torch.tensor([p])).last_hidden_state[0]
            refs.append(torch.nn.functional.normalize(h[-1] if pooling == "last"
                                                      else h.mean(0), dim=0))
    # a budget of 16 tokens: the 40-token prompt in three chunks, beside a generation
    e = LLMEngine(EngineConfig(device="cpu", pooling=pooling,
                               cache=CacheConfig(block_size=16),
                               scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    alone = e.generate([PROMPTS[1]], greedy(6))[0]
    e.block_manager.reset_prefix_cache()
    e.add_request("gen", PROMPTS[1], greedy(6))
    for i, p in enumerate(PROMPTS):
        e.add_request(f"e{i}", p, SamplingParams(max_tokens=1, embed=True))
    outs: dict[str, list] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [t for o in outs["gen"] for t in o.new_token_ids] == alone
    for i, ref in enumerate(refs):
        (out,) = outs[f"e{i}"]   # one output: the embedding, and the end
        assert out.new_token_ids == [] and out.finish_reason.value == "stop"
        got = torch.tensor(out.embedding)
        assert len(got) == 576 and abs(float(got.norm()) - 1.0) < 1e-5
        assert float(got @ ref) >= 0.9999, (i, float(got @ ref))
    assert e.stats().num_blocks_used == 0


def test_an_embedding_takes_a_prompt_alone(tiny_llama_dir):
    """Continuations, KV transfers, structured output and prompt logprobs are refused."""
    from helpers import make_engine

    e = make_engine(tiny_llama_dir)
    embed = SamplingParams(max_tokens=4, embed=True)
    for params, kw in [(SamplingParams(max_tokens=1, embed=True, prompt_logprobs=1), {}),
                       (embed, {"output_token_ids": [5]}), (embed, {"kv_lease_s": 5.0})]:
        with pytest.raises(InvalidRequestError, match="an embedding request takes a "
                                                      "prompt alone"):
            e.add_request("x", [1, 2, 3], params, **kw)
    assert not e.requests


def test_a_pooled_vector_is_its_unit_vector_and_one_not_finite_fails_its_request(
        tiny_llama_dir):
    """forward.unit_vector: the pooled rows normalized, or None where that is not
    finite; the engine then ends the request with an error."""
    from engine_worker.forward import unit_vector
    from helpers import make_engine

    assert unit_vector(torch.tensor([6.0, 8.0])) == pytest.approx([0.6, 0.8])
    assert unit_vector(torch.tensor([1.0, float("nan")])) is None
    assert unit_vector(torch.tensor([float("inf"), 1.0])) is None
    e = make_engine(tiny_llama_dir, cpu_kernels=False)
    with torch.no_grad():
        e.runner.model.norm.weight.fill_(float("nan"))   # every hidden state NaN
    e.add_request("x", [1, 2, 3], SamplingParams(max_tokens=1, embed=True))
    (out,) = e.step()
    assert (out.finish_reason.value, out.error, out.embedding) == (
        "error", "the embedding is not finite", None)
    assert not e.requests and e.stats().num_blocks_used == 0


def test_a_preempted_embedding_pools_each_row_once(default_model_dir):
    """Mean pooling over a prompt in chunks whose request is preempted after its first
    chunk: computed again from the start, each row counted once (it counted the first
    chunk twice)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.nn.functional.normalize(
            hf(torch.tensor([PROMPTS[1]])).last_hidden_state[0].mean(0), dim=0)
    e = LLMEngine(EngineConfig(device="cpu", pooling="mean", cache=CacheConfig(block_size=16),
                               scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    e.add_request("e", PROMPTS[1], SamplingParams(max_tokens=1, embed=True))
    assert e.step() == []
    e.scheduler.preempt(e.requests["e"])
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert float(torch.tensor(outs[0].embedding) @ ref) >= 0.9999
