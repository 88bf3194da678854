"""A model of an architecture beyond Llama's served end to end, over the real processes
(engine, tokenizer pool, frontend) and HTTP: the multimodal Gemma 3 checkpoint's
language model, whose config nests the text model's fields (the tokenizer pool once
refused to start on it: 'declares no context length')."""

from __future__ import annotations

import requests

import processes
from helpers import greedy, make_engine


def test_a_multimodal_gemma3_serves_chats_as_its_engine_does(tiny_gemma3_vision_dir,
                                                             tmp_path):
    with processes.local_stack(tiny_gemma3_vision_dir, tmp_path,
                               "--served-model-name", "g") as front:
        r = requests.post(f"{front.url}/v1/chat/completions", timeout=120, json={
            "model": "g", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        models = requests.get(f"{front.url}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 512   # its text_config's context
    engine = make_engine(tiny_gemma3_vision_dir)
    assert choice["token_ids"] == engine.generate([choice["prompt_token_ids"]], greedy(8))[0]
    assert len(choice["token_ids"]) == 8
