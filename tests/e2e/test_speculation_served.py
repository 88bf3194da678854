"""Speculation through the engine process and HTTP: n-gram proposals and a predicted
output give the tokens decoding one at a time gives; in process:
tests/unit/test_speculation.py."""

from __future__ import annotations

import time

from helpers import greedy, make_engine

# a prompt that repeats itself: n-gram proposals find what follows
LOOP = [11, 22, 33, 44] * 5


def test_through_the_engine_process_and_http(tiny_llama_dir, tmp_path):
    """--speculative-tokens on the engine worker: the same tokens over HTTP as the
    in-process engine without it, and the frontend's metrics count what was kept."""
    import httpx

    import processes

    expected = make_engine(tiny_llama_dir).generate([LOOP], greedy(30))[0]
    with processes.local_stack(tiny_llama_dir, tmp_path, "--served-model-name", "t",
                               engine_args=("--speculative-tokens", "4")) as front:
        r = httpx.post(front.url + "/v1/completions", timeout=60, json={
            "model": "t", "prompt": LOOP, "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == expected
        deadline = time.monotonic() + 10  # the engine's next heartbeat carries them
        while processes.metric(front.url, "vllm:spec_decode_num_accepted_tokens_total") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert processes.metric(front.url, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_a_prediction_through_http(tiny_llama_dir, tmp_path):
    """OpenAI's prediction field, on chat and completions: the same tokens as without
    it, in far fewer steps where it is right (the engine's count of kept proposals)."""
    import httpx

    import processes

    with processes.local_stack(tiny_llama_dir, tmp_path,
                               engine_args=("--speculative-tokens", "8")) as front:
        def ask(path, **body):
            body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, **body}
            r = httpx.post(front.url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            return choice["token_ids"], text, usage.get("completion_tokens_details")

        def kept():
            time.sleep(1.2)   # the engine's next heartbeat carries its counts
            return processes.metric(front.url, "vllm:spec_decode_num_accepted_tokens_total")

        for path, body in (("/v1/completions", {"prompt": "Once upon"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Once upon"}]})):
            ids, text, details = ask(path, **body)
            assert details is None
            before = kept()
            again, _, details = ask(path, **body, prediction={"type": "content", "content": text})
            assert again == ids and kept() - before >= 30
            # OpenAI's counts: the prediction's tokens the output holds, and the rest.
            predicted = httpx.post(front.url + "/tokenize", timeout=60, json={
                "prompt": text, "add_special_tokens": False}).json()["count"]
            assert details["accepted_prediction_tokens"] >= 30
            assert details["accepted_prediction_tokens"] + details[
                "rejected_prediction_tokens"] == predicted
            _, _, details = ask(path, **body, prediction={"type": "content",
                                                          "content": "Nothing like it."})
            assert details["accepted_prediction_tokens"] == 0
            assert details["rejected_prediction_tokens"] > 0
            parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
            assert ask(path, **body, prediction={"type": "content", "content": parts})[0] == ids
        r = httpx.post(front.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "prediction": {"type": "other", "content": "y"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction.type"
