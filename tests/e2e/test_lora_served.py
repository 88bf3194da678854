"""LoRA adapters through roseserve serve and HTTP: adapters named in the request's
model field, four and the base model in flight at once, each token-identical to
Hugging Face's model with that adapter merged by peft; loaded and unloaded over HTTP;
bad adapters get a 400 that says why."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

import processes
from helpers import random_prompts
from hf_reference import hf_greedy
from lora_adapters import make_adapter, merged_greedy
from processes import Serve

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = random_prompts([11], seed=61)[0]


def test_adapters_over_http(tiny_llama_dir, tiny_llama_hd8_dir, tmp_path):
    made = {name: make_adapter(tiny_llama_dir, tmp_path / name, seed, rank, 16, modules,
                               False)
            for seed, (name, rank, modules) in enumerate([
                ("a", 8, MODULES), ("b", 4, ["q_proj", "v_proj"]), ("c", 8, MODULES[3:]),
                ("d", 16, MODULES), ("big", 32, MODULES)])}
    expected = {name: merged_greedy(tiny_llama_dir, path, [PROMPT], 8)[0].token_ids
                for name, path in made.items() if name != "big"}
    expected["tiny"] = hf_greedy(tiny_llama_dir, [PROMPT], 8)[0].token_ids
    serve = Serve(tiny_llama_dir, tmp_path / "serve.log", "--lora-modules",
                  f"a={made['a']}", f"b={made['b']}", "--max-lora-rank", "16",
                  "--max-loras", "4")
    try:
        serve.wait_ready()
        url = serve.url
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("tiny", None), ("a", "tiny"), ("b", "tiny")]
        assert models[1]["root"] == str(made["a"])

        def load(name: str, path) -> httpx.Response:
            return httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                              json={"lora_name": name, "lora_path": str(path)})

        for name in ("c", "d"):
            r = load(name, made[name])
            assert r.status_code == 200, r.text
        # refusals, each with its reason
        for name, path, why in [
                ("x", tmp_path / "nowhere", "is not a LoRA adapter folder"),
                ("x", made["big"], "rank 32 (layers.0.self_attn.q_proj) is above this "
                                   "engine's --max-lora-rank 16"),
                ("a", made["c"], "the model 'a' exists already")]:
            r = load(name, path)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        other = make_adapter(tiny_llama_hd8_dir, tmp_path / "other", 9, 4, 8, ["q_proj"],
                             False)
        r = load("x", other)
        assert r.status_code == 400 and "is not an adapter of this model" in r.text

        async def complete(client, model):
            r = await client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        async def all_at_once():
            async with httpx.AsyncClient(timeout=60) as client:
                names = ["a", "b", "c", "d", "tiny"]
                return dict(zip(names, await asyncio.gather(
                    *(complete(client, n) for n in names))))

        assert asyncio.run(all_at_once()) == expected
        # unloaded: no longer served, nor listed
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": "c", "prompt": PROMPT,
                                                      "max_tokens": 2})
        assert r.status_code == 404 and "the model 'c' does not exist" in r.text
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 404
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [
            "tiny", "a", "b", "d"]
        # an engine that restarts gets back the adapter loaded over HTTP since it started
        (engine,) = serve.pids()["engine"]
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "d", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            if r.status_code == 200 and serve.pids()["engine"] != [engine]:
                break
            assert time.monotonic() < deadline, serve.log()[-3000:]
            time.sleep(0.5)
        assert r.json()["choices"][0]["token_ids"] == expected["d"]
        assert "c" not in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    finally:
        serve.stop()


def test_an_engine_that_dies_loading_an_adapter_gives_503(tiny_llama_dir, tmp_path):
    adapter = make_adapter(tiny_llama_dir, tmp_path / "doomed", 0, 4, 8, ["q_proj"], False)
    with processes.local_stack(tiny_llama_dir, tmp_path, engine_env={
            "ROSESERVE_FAULT_ADAPTER_EXIT": "doomed"}) as front:
        r = httpx.post(f"{front.url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "doomed", "lora_path": str(adapter)})
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable"
        assert error["message"] == (
            f"the LoRA adapter 'doomed' was not loaded: the engine at ipc://{tmp_path}/"
            f"engine.sock did not answer: lost the connection to the engine at "
            f"ipc://{tmp_path}/engine.sock")
