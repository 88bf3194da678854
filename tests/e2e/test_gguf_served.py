"""GGUF files served through the real processes (engine, tokenizer pool, frontend all
given the file): the chat template and tokenizer from its metadata, the engine's greedy
tokens over HTTP; the file's weights: tests/models/test_gguf.py."""

from __future__ import annotations

import pytest
import requests

from common.model_files import _find_gguf, resolve_model_dir
from common.tokenizer import load_tokenizer
from helpers import greedy, make_engine
from gguf_files import gguf_from_hf
from processes import local_stack


@pytest.fixture(scope="module")
def gguf_path():
    return _find_gguf()


CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
            7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 1232,
            216, 34, 47, 2, 198, 1, 520, 9531, 198]


def test_a_gguf_file_served_through_the_real_processes(gguf_path, tmp_path):
    """Engine, tokenizer pool and frontend all given the file: a chat completion uses
    the chat template from its metadata, and the text is the engine's greedy tokens."""
    with local_stack(str(gguf_path), tmp_path) as front:
        models = requests.get(f"{front.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
        r = requests.post(f"{front.url}/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8
        choice = body["choices"][0]
        # the file's template: its system prompt, then <|im_start|>user\n ... and
        # <|im_start|>assistant\n
        assert choice["prompt_token_ids"] == CHAT_IDS
        assert choice["token_ids"] == \
            make_engine(resolve_model_dir(str(gguf_path))).generate([CHAT_IDS], greedy(8))[0]


def test_a_qwen2_file_with_q8_0_blocks_serves_through_the_real_processes(tiny_qwen2_dir,
                                                                         tmp_path):
    """Its matrices as Q8_0 (the int8 format, as they are), its biases and norms F32, the
    tokenizer and chat template from its metadata: a chat through HTTP gives the tokens
    the engine gives in process."""
    path = gguf_from_hf(tiny_qwen2_dir, tmp_path / "qwen2.q8_0.gguf", "qwen2", "Q8_0")
    folder = resolve_model_dir(str(path))
    engine = make_engine(folder)
    assert engine.runner.weight_format == "int8"
    assert engine.runner.model.layers[0].self_attn.qkv_proj.fmt == "int8"
    with local_stack(str(path), tmp_path) as front:
        r = requests.post(f"{front.url}/v1/chat/completions", json={
            "model": "qwen2.q8_0", "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    # the tiny models' template: <|user|>\nHi there\n<|assistant|>\n, GPT-2's BPE
    prompt = choice["prompt_token_ids"]
    assert prompt == load_tokenizer(tiny_qwen2_dir).encode("<|user|>\nHi there\n<|assistant|>\n")
    assert choice["token_ids"] == engine.generate([prompt], greedy(8))[0]
