"""Per-request constraints inside a batch (grammars, logit_bias, allowed and banned
tokens) and prompt logprobs, on the in-process engine with the tiny Llama model."""

from __future__ import annotations

import re

import pytest
import torch

from common.errors import InvalidRequestError
from common.protocol import FinishReason, SamplingParams
from common.structured import StructuredOutput
from helpers import greedy, make_engine, random_prompts, run_to_end, tokens

PROMPTS = random_prompts([7, 12, 5], seed=5)
NEVER = 50255  # a token id the tiny model's greedy outputs here do not hold


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "layers"])
def engine(request, tiny_llama_dir):
    return make_engine(tiny_llama_dir, budget=16, cpu_kernels=request.param)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_match_hf_through_chunks_and_the_prefix_cache(engine, hf):
    """A 40-token prompt in chunks of 16, asked twice: the second time its blocks are
    cached, and it must still get every prompt logprob (it computes the prompt)."""
    prompt = random_prompts([40], seed=9)[0]
    ref = _hf_logprobs(hf, prompt)
    for attempt in range(2):
        engine.add_request(f"p{attempt}", prompt, greedy(2, prompt_logprobs=3))
        first = run_to_end(engine)[f"p{attempt}"][0]
        got = first.prompt_logprobs
        assert len(got) == 39
        for p, lp in enumerate(got):
            assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < 1e-3
            assert lp.top_token_ids == ref[p].topk(3).indices.tolist()
    stats = engine.stats()
    assert stats.num_blocks_used == 0


def test_a_grammar_constrains_only_its_own_request(engine):
    """Three greedy requests, one with a regex: the other two are as without it."""
    alone = engine.generate(PROMPTS[:2], greedy(8))
    pattern = r" (cat|dog|bird) [0-9]{2}\."
    engine.add_request("g", PROMPTS[2], greedy(
        30, structured=StructuredOutput(kind="regex", spec=pattern)))
    engine.add_request("a", PROMPTS[0], greedy(8))
    engine.add_request("b", PROMPTS[1], greedy(8))
    outs = run_to_end(engine)
    assert [tokens(outs["a"]), tokens(outs["b"])] == alone
    assert outs["g"][-1].finish_reason is FinishReason.STOP
    assert outs["g"][-1].stop_token_id is None  # the grammar completed: all text
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    assert re.fullmatch(pattern, tok.decode(tokens(outs["g"])))


def test_a_grammar_after_a_token_starts_once_that_token_is_generated(engine):
    """structured_after (a reasoning model's end of thinking: a token, or harmony's
    run of them): the tokens up to it are the free output's, the rest match the
    grammar; ids never generated in a row leave the output free (one of them alone
    is not enough)."""
    plain = engine.generate([PROMPTS[2]], greedy(12))[0]
    k = next(i for i in range(2, 12) if plain[i] not in plain[:i])
    pattern = r" (cat|dog|bird) [0-9]{2}\."
    regex = StructuredOutput(kind="regex", spec=pattern)
    engine.add_request("late", PROMPTS[2], greedy(40, structured=regex,
                                                  structured_after=[plain[k]]))
    engine.add_request("run", PROMPTS[2], greedy(40, structured=regex,
                                                 structured_after=plain[k - 2:k + 1]))
    engine.add_request("never", PROMPTS[2], greedy(12, structured=regex,
                                                   structured_after=[NEVER]))
    engine.add_request("broken", PROMPTS[2], greedy(12, structured=regex,
                                                    structured_after=[NEVER, plain[k]]))
    outs = run_to_end(engine)
    late = tokens(outs["late"])
    assert tokens(outs["run"]) == late and tokens(outs["broken"]) == plain
    assert late[:k + 1] == plain[:k + 1]
    assert outs["late"][-1].finish_reason is FinishReason.STOP
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    assert re.fullmatch(pattern, tok.decode(late[k + 1:]))
    assert NEVER not in plain and tokens(outs["never"]) == plain
    with pytest.raises(InvalidRequestError, match="needs a structured output"):
        engine.add_request("bad", PROMPTS[0], greedy(4, structured_after=[3]))
    with pytest.raises(InvalidRequestError, match="1 to 16 token ids"):
        engine.add_request("bad", PROMPTS[0], greedy(4, structured=regex, structured_after=[]))


def test_invalid_grammar_is_refused_at_add_request(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", PROMPTS[0], greedy(4, structured=StructuredOutput(
            kind="regex", spec="(", param="guided_regex")))
    assert info.value.param == "guided_regex" and not engine.has_unfinished_requests()


def test_logit_bias_allowed_and_bad_words_per_request(engine):
    plain = engine.generate([PROMPTS[0]], greedy(6))[0]
    forced = greedy(6, logit_bias={77: 100.0})
    allowed = SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True,
                             allowed_token_ids=[5, 6, 7])
    # Ban the plain output's 2nd token after its 1st: the 2nd token changes.
    banned = greedy(6, bad_words_ids=[plain[:2]])
    outs = [engine.generate([PROMPTS[0]], p)[0] for p in (forced, allowed, banned)]
    assert outs[0] == [77] * 6
    assert set(outs[1]) <= {5, 6, 7} and len(outs[1]) == 20
    assert outs[2][0] == plain[0] and outs[2][1] != plain[1]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("x", PROMPTS[0], greedy(2, logit_bias={50257: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        engine.add_request("x", PROMPTS[0], greedy(2, logit_bias={1: 101.0}))
