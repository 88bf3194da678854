"""A model of an architecture beyond Llama's served end to end, over the real processes
(engine, tokenizer pool, frontend) and HTTP: the multimodal Gemma 3 and Mistral Small 3
checkpoints' language models, whose configs nest the text model's fields (the tokenizer
pool once refused to start on one: 'declares no context length')."""

from __future__ import annotations

import pytest
import requests

import processes
from helpers import greedy, make_engine


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
