"""A model's recommended sampling (its generation_config.json's temperature, top_p,
top_k, min_p and repetition_penalty) is the default of requests that leave those fields
out, as vLLM's --generation-config auto makes it; a request's own values win, and
--generation-config none gives OpenAI's defaults. End to end, on a tiny model whose
generation_config.json asks for top_k 1 (greedy whatever the seed)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

import processes
from common.sampling_params import recommended_sampling

RECOMMENDED = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.3, "do_sample": True}


@pytest.fixture(scope="module")
def urls(tmp_path_factory, tiny_llama_dir):
    """Frontends with the defaults (auto) and without (none), on one engine and pool."""
    model = tmp_path_factory.mktemp("recommending") / "tiny-llama"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps(
        {**json.loads((tiny_llama_dir / "generation_config.json").read_text()), **RECOMMENDED}))
    run = tmp_path_factory.mktemp("run")
    engine = processes.engine(model, f"ipc://{run}/engine.sock")
    pool = processes.tokenizer_pool(model, f"ipc://{run}/tok.sock", workers=1)
    auto = processes.frontend(model, engine.address, pool.address)
    none = processes.frontend(model, engine.address, pool.address, "--generation-config", "none")
    try:
        for front in (auto, none):
            processes.wait_healthy(front)
        assert ("requests that do not set them get the sampling of the model's "
                "generation_config.json: temperature 0.7, top_k 1, repetition_penalty 1.3"
                in auto.output())
        yield auto.url, none.url
    finally:
        for p in (auto, none, pool, engine):
            p.stop()


def tokens(url, path="/v1/completions", **body) -> list[int]:
    body = {"max_tokens": 12, "ignore_eos": True, "return_token_ids": True, **body}
    if path == "/v1/completions":
        body.setdefault("prompt", "The sky is")
    else:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_requests_that_leave_sampling_out_get_the_models_recommendation(urls):
    auto, _ = urls
    recommended = tokens(auto, temperature=0.7, top_k=1, repetition_penalty=1.3, seed=5)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert tokens(auto, path, seed=1) == tokens(auto, path, seed=2)   # top_k 1
    assert tokens(auto, seed=1) == recommended
    # a request's own values win: every token may be drawn again
    assert tokens(auto, top_k=-1, seed=1) != tokens(auto, top_k=-1, seed=2)
    r = httpx.post(auto + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["temperature"] == 0.7, r.text


def test_generation_config_none_gives_openais_defaults(urls):
    _, none = urls
    assert tokens(none, seed=1) != tokens(none, seed=2)   # temperature 1, every token
    r = httpx.post(none + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2},
                   timeout=60)
    assert r.json()["temperature"] == 1.0


def test_what_is_out_of_bounds_or_not_a_number_is_left_out(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": -1, "top_p": 0.9, "top_k": 0, "min_p": "0.1",
         "repetition_penalty": True}))
    with caplog.at_level(logging.WARNING):
        assert recommended_sampling(tmp_path) == {"top_p": 0.9}   # top_k 0: no cut
    assert len(caplog.records) == 3 and "temperature must be non-negative" in caplog.text
    assert recommended_sampling(tmp_path / "nowhere") == {}


def test_a_generation_config_that_cannot_be_read_gives_no_defaults(tmp_path, caplog):
    path = tmp_path / "generation_config.json"
    for text in ('{"temperature": 0.7,', '[0.7]'):   # broken JSON; not an object
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert recommended_sampling(tmp_path) == {}
        assert len(caplog.records) == (1 if text.endswith(",") else 0)
    path.unlink()
    path.mkdir()   # a folder where the file should be: an OSError
    with caplog.at_level(logging.WARNING):
        assert recommended_sampling(tmp_path) == {}
    assert "cannot be read" in caplog.records[-1].getMessage()


def test_a_generation_config_setting_other_than_auto_or_none_is_refused():
    from common.config import FrontendConfig

    with pytest.raises(ValueError, match="generation_config must be auto or none, got 'vllm'"):
        FrontendConfig(generation_config="vllm")
