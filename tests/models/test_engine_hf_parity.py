"""Greedy output equals Hugging Face transformers' generate, token for token (fp32),
under every way the scheduler can batch, cache, chunk and preempt."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.protocol import FinishReason, SamplingParams
from engine_worker.engine import LLMEngine
from helpers import greedy, make_engine, random_prompts, run_staggered, run_to_end
from hf_reference import assert_matches, hf_greedy

MAX_NEW = 12
GREEDY = greedy(MAX_NEW)
# Granite: its scaling constants; Phi-3: its fused tensors; SmolLM3: a layer without
# RoPE; yarn: a Qwen2 with YaRN RoPE; sliding: Mistral's window of 16 keys in every
# layer; qwen2_sliding: a window of 11 in one layer of two; gemma2: soft-capped scores
# and logits; gemma3: Gemma 3's layers; gemma3_vision and mistral3_vision: the language
# model of a multimodal Gemma 3 or Mistral Small 3 checkpoint; mixtral, qwen3_moe and
# qwen2_moe (with a shared expert): mixtures of experts; gpt_oss: sinks, a sliding
# layer, biased routers and experts, the clamped SwiGLU; olmo2: norms after each part,
# q and k normed whole (layer by layer on the C kernels: the one C call has no such norms)
ARCHS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_gpt2_dir",
         "tiny_granite_dir", "tiny_phi3_dir", "tiny_smollm3_dir", "tiny_yarn_dir",
         "tiny_sliding_dir", "tiny_qwen2_sliding_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
         "tiny_gemma3_vision_dir", "tiny_mistral3_vision_dir", "tiny_mixtral_dir",
         "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_gpt_oss_dir", "tiny_olmo2_dir"]


PROMPTS = random_prompts([1, 5, 17, 33, 60])


@pytest.fixture(params=ARCHS)
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def refs(model_dir):
    return hf_greedy(model_dir, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_admitted_together(model_dir, refs, cpu_kernels):
    engine = make_engine(model_dir, cpu_kernels=cpu_kernels)
    assert_matches(engine.generate(PROMPTS, GREEDY), refs, "together")


def test_staggered(model_dir, refs):
    engine = make_engine(model_dir)
    assert_matches(run_staggered(engine, PROMPTS, GREEDY), refs, "staggered")


def test_chunked_prefill(model_dir, refs):
    # A budget of 8 tokens per step splits the 17-, 33- and 60-token prompts into chunks.
    engine = make_engine(model_dir, budget=8)
    assert_matches(run_staggered(engine, PROMPTS, GREEDY, every=1), refs, "chunked")
    assert engine.stats().num_prompt_tokens_computed == sum(len(p) for p in PROMPTS)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_prefix_cache_hits(model_dir, cpu_kernels):
    shared = random_prompts([45], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 1, 20], seed=8)]
    refs = hf_greedy(model_dir, prompts, MAX_NEW)
    engine = make_engine(model_dir, cpu_kernels=cpu_kernels)
    first = engine.generate(prompts[:1], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert_matches(first + rest, refs, "prefix hits")
    stats = engine.stats()
    # 45 shared tokens = 11 full blocks of 4 reused by each of the three later prompts.
    assert stats.prefix_cache_hit_tokens == 3 * 44


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_preemption(model_dir, refs, cpu_kernels):
    # 40 blocks of 4 tokens: the five requests need 4+5+8+12+18 = 47 blocks at the end,
    # so some are preempted and recomputed. Where every layer slides by fewer keys
    # than the prompts hold, blocks go as the window passes: 10 blocks then, steps of
    # 8 tokens (a request holds at most 8 blocks: a window of 16 keys and a step's
    # tokens; 6 with 9 keys).
    engine = make_engine(model_dir, num_blocks=40, cpu_kernels=cpu_kernels)
    if engine.runner.sliding and engine.runner.window < len(PROMPTS[-1]):
        engine = make_engine(model_dir, num_blocks=10, budget=8, cpu_kernels=cpu_kernels)
    assert_matches(engine.generate(PROMPTS, GREEDY), refs, "preemption")
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_used == stats.num_window_blocks_used == 0  # none leaked
    assert stats.num_blocks_free == engine.runner.num_blocks


def test_preemption_without_prefix_cache(model_dir, refs):
    engine = make_engine(model_dir, num_blocks=40, budget=16, prefix_caching=False)
    if engine.runner.sliding and engine.runner.window < len(PROMPTS[-1]):
        engine = make_engine(model_dir, num_blocks=10, budget=8, prefix_caching=False)
    assert_matches(engine.generate(PROMPTS, GREEDY), refs, "preempt+chunk")
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_free == engine.runner.num_blocks
    assert stats.num_window_blocks_used == 0


def test_default_model_matches_hf(default_model_dir):
    """The real SmolLM2-135M-Instruct, chat-formatted prompts, batched together."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for t in texts]
    refs = hf_greedy(default_model_dir, prompts, 16)
    engine = LLMEngine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_matches(engine.generate(prompts, params), refs, "SmolLM2")


def test_default_model_matches_hf_on_a_long_prompt(default_model_dir):
    """About 1,100 tokens of real text in chunks of 256 (each chunk's tiles over the
    cached prefix before it), then decode steps whose keys are split into parts across
    threads: HF's greedy tokens."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = "".join(topics[k] for k in ("assert", "if", "while", "for", "try", "with"))
    prompt = tok.encode(text, add_special_tokens=False)[:1100]
    assert len(prompt) == 1100
    refs = hf_greedy(default_model_dir, [prompt], 12)
    engine = LLMEngine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=96),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=256)))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_matches(engine.generate([prompt], params), refs, "long prompt")


def test_default_model_stops_on_eos(default_model_dir):
    engine = LLMEngine(EngineConfig(device="cpu", cache=CacheConfig(num_blocks=64)))
    # "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n" ends quickly.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Say OK."}],
                                   add_generation_prompt=True, tokenize=False)
    engine.add_request("r", tok.encode(text, add_special_tokens=False),
                       SamplingParams(max_tokens=200, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].new_token_ids == [2]  # <|im_end|>
    assert len(outputs) < 200


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch-ops"])
def test_longrope_over_part_of_each_head_matches_hf(tiny_phi4_mini_dir, cpu_kernels):
    """Phi-4-mini's RoPE: LongRoPE over 3/4 of each head. Served at its original context
    (--max-model-len 64) the short factors, as Hugging Face takes them for sequences
    that fit it; served longer, the long ones, as Hugging Face takes them for a
    sequence past it (recomputed whole each step: its cache would hold keys turned
    with the short factors)."""
    short_prompts = random_prompts([1, 5, 17, 33, 50])
    engine = make_engine(tiny_phi4_mini_dir, cpu_kernels=cpu_kernels, max_model_len=64)
    assert_matches(engine.generate(short_prompts, GREEDY),
                   hf_greedy(tiny_phi4_mini_dir, short_prompts, MAX_NEW), "longrope short")
    long_prompts = random_prompts([70, 100], seed=3)
    engine = make_engine(tiny_phi4_mini_dir, cpu_kernels=cpu_kernels)
    assert_matches(engine.generate(long_prompts, GREEDY),
                   hf_greedy(tiny_phi4_mini_dir, long_prompts, MAX_NEW,
                             round_inputs=lambda x: x), "longrope long")


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c", "torch"])
def test_gemma2s_logprobs_are_of_its_soft_capped_logits(tiny_gemma2_dir, cpu_kernels):
    """The logits are soft-capped (2.5 tanh(x / 2.5)), which no greedy token shows (tanh
    keeps their order): the logprobs of the first token are Hugging Face's, capped."""
    import torch

    from hf_reference import hf_model

    prompt = random_prompts([9], seed=4)[0]
    engine = make_engine(tiny_gemma2_dir, cpu_kernels=cpu_kernels)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5,
                                                   ignore_eos=True))
    got = run_to_end(engine)["r"][-1].logprobs[0]
    with torch.no_grad():
        logits = hf_model(tiny_gemma2_dir)(torch.tensor([prompt])).logits[0, -1]
    assert logits.abs().max() < 2.5   # capped
    want = torch.log_softmax(logits.double(), -1).topk(5)
    assert got.top_token_ids == want.indices.tolist()
    assert got.top_logprobs == pytest.approx(want.values.tolist(), abs=1e-4)

