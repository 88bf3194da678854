"""A model of an architecture beyond Llama's served end to end, over the real processes
(engine, tokenizer pool, frontend) and HTTP: the multimodal Gemma 3 and Mistral Small 3
checkpoints' language models, whose configs nest the text model's fields (the tokenizer
pool once refused to start on one: 'declares no context length')."""

from __future__ import annotations

import json
import time

import pytest
import requests

import processes
from helpers import greedy, make_engine, random_prompts
from hf_reference import assert_matches, hf_greedy


@pytest.mark.parametrize("model", ["tiny_gemma3_vision_dir", "tiny_mistral3_vision_dir"])
def test_a_multimodal_checkpoint_serves_chats_as_its_engine_does(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    with processes.local_stack(model_dir, tmp_path, "--served-model-name", "g") as front:
        r = requests.post(f"{front.url}/v1/chat/completions", timeout=120, json={
            "model": "g", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        models = requests.get(f"{front.url}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 512   # its text_config's context
    engine = make_engine(model_dir)
    assert choice["token_ids"] == engine.generate([choice["prompt_token_ids"]], greedy(8))[0]
    assert len(choice["token_ids"]) == 8


def test_gpt_oss_serves_its_harmony_chat_over_http(tiny_gpt_oss_chat_dir, tmp_path):
    """gpt-oss over the real processes: its own tokens as the in-process engine's
    (sinks, biased experts, the clamped gate on the C path), and a chat reply (its first
    tokens scripted: random weights write no harmony) split by the gpt_oss parser the
    template chose."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_gpt_oss_chat_dir / "tokenizer.json"))
    reply = ("<|channel|>analysis<|message|>Hmm.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Yes.<|return|>")
    [trigger] = tok.encode("think", add_special_tokens=False).ids
    script = {str(trigger): tok.encode(reply, add_special_tokens=False).ids}
    prompt = list(range(200, 219))
    with processes.local_stack(tiny_gpt_oss_chat_dir, tmp_path, "--served-model-name", "o",
                               engine_env={"ROSESERVE_FAULT_SCRIPTS": json.dumps(script)}
                               ) as front:
        r = requests.post(f"{front.url}/v1/completions", timeout=120, json={
            "model": "o", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["token_ids"]
        r = requests.post(f"{front.url}/v1/chat/completions", timeout=120, json={
            "model": "o", "messages": [{"role": "user", "content": "think"}],
            "max_tokens": 30, "temperature": 0})
        assert r.status_code == 200, r.text
        # its sliding layers' own pool (a window of 8 keys), in the engine's heartbeat:
        # once both requests ended, every block of theirs is cached, none used
        deadline = time.monotonic() + 30
        while [processes.metric(front.url, "roseserve_engine_window_kv_blocks", state=state)
               > 0 for state in ("used", "cached")] != [False, True]:
            assert time.monotonic() < deadline, "the window blocks are not in the metrics"
            time.sleep(0.2)
    assert tokens == make_engine(tiny_gpt_oss_chat_dir).generate([prompt], greedy(8))[0]
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Hmm.", "Yes.")


def test_olmo2_over_http_gives_hugging_faces_greedy_tokens(tiny_olmo2_dir, tmp_path):
    """OLMo 2, served by its family file and its line in the registry alone
    (engine_worker/models/olmo2.py: norms after the attention and the MLP, q and k normed
    over the whole projection): over the real processes and HTTP, each completion's
    tokens are Hugging Face's greedy ones."""
    prompts = random_prompts([7, 21], seed=27)
    with processes.local_stack(tiny_olmo2_dir, tmp_path, "--served-model-name", "o") as front:
        got = greedy_completions(front, "o", prompts, 8)
    assert_matches(got, hf_greedy(tiny_olmo2_dir, prompts, 8), "olmo2 over HTTP")


def greedy_completions(front, model: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens from /v1/completions."""
    got = []
    for prompt in prompts:
        r = requests.post(f"{front.url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    return got


def test_an_fp8_checkpoint_over_http_is_its_dequantized_weights(tiny_llama_dir, tmp_path):
    """A compressed-tensors fp8 checkpoint served on a CPU (models/quantization.py): its
    weights dequantized as they load; without the C kernels (float32) each completion's
    tokens over the real processes and HTTP are Hugging Face's greedy ones on the
    dequantized checkpoint."""
    from fp8_checkpoints import dequantized, fp8_checkpoint

    fp8 = fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8")
    plain = dequantized(fp8, tmp_path / "plain")
    prompts = random_prompts([9, 16], seed=12)
    with processes.local_stack(fp8, tmp_path, "--served-model-name", "f",
                               engine_args=("--no-cpu-kernels",)) as front:
        got = greedy_completions(front, "f", prompts, 8)
    assert_matches(got, hf_greedy(plain, prompts, 8), "fp8 checkpoint over HTTP")
