"""The API fields and endpoints clients of vLLM and OpenAI rely on, end to end on the
tiny model: logit_bias, allowed_token_ids, bad_words, include_stop_str_in_output,
echo, best_of, stop_reason, continue_final_message, /tokenize, /detokenize, /version,
/v1/models/{id}, model name aliases and requests that name no model."""

from __future__ import annotations

import json
from importlib.metadata import version

import httpx
import pytest

import processes


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_llama_dir):
    with processes.local_stack(tiny_llama_dir, tmp_path_factory.mktemp("surface"),
                               "--served-model-name", "tiny-llama", "tiny") as front:
        yield front.url


def post(url, path="/v1/completions", **body):
    body.setdefault("model", "tiny-llama")
    return httpx.post(url + path, json=body, timeout=60)


def greedy(url, prompt="The sky is", n_tokens=12, **extra) -> dict:
    r = post(url, prompt=prompt, max_tokens=n_tokens, temperature=0, ignore_eos=True,
             return_token_ids=True, **extra)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logit_bias_forces_and_bans(url):
    plain = greedy(url)["token_ids"]
    target = next(t for t in range(100, 200) if t not in plain)
    assert greedy(url, logit_bias={str(target): 100})["token_ids"] == [target] * 12
    banned = greedy(url, logit_bias={str(plain[0]): -100})["token_ids"]
    assert banned[0] != plain[0] and plain[0] not in banned


def test_top_k_minus_one_and_zero_take_every_token_as_in_vllm(url):
    reference = post(url, prompt="The sky is", max_tokens=6, temperature=1.0, seed=7,
                     ignore_eos=True).json()["choices"][0]["text"]
    for top_k in (-1, 0):
        r = post(url, prompt="The sky is", max_tokens=6, temperature=1.0, seed=7,
                 ignore_eos=True, top_k=top_k)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
    r = post(url, prompt="x", top_k=-2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_allowed_token_ids_limit_every_sample(url):
    allowed = [11, 290, 1000, 5000]
    r = post(url, prompt="Hello", max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
             allowed_token_ids=allowed, return_token_ids=True)
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 30 and set(ids) <= set(allowed) and len(set(ids)) > 1


def test_bad_words_are_never_generated(url):
    plain = greedy(url)
    first_id = plain["token_ids"][0]
    word = httpx.post(url + "/detokenize", json={"tokens": [first_id]}).json()["prompt"].strip()
    out = greedy(url, bad_words=[word])
    assert first_id not in out["token_ids"] and out["token_ids"] != plain["token_ids"]


def test_include_stop_str_in_output_and_stop_reason(url):
    text = greedy(url, n_tokens=16)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    without = greedy(url, n_tokens=16, stop=[stop])
    assert without["text"] == cut and without["finish_reason"] == "stop"
    assert without["stop_reason"] == stop
    kept = greedy(url, n_tokens=16, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == cut + stop and kept["stop_reason"] == stop
    assert greedy(url)["stop_reason"] is None  # length
    # A stop token id is the stop_reason too (it is not text).
    ids = greedy(url)["token_ids"]
    by_id = greedy(url, stop_token_ids=[ids[3]])
    assert by_id["token_ids"] == ids[:4] and by_id["stop_reason"] == ids[3]


def test_echo_puts_the_prompt_before_the_completion(url):
    plain = greedy(url, prompt="Once upon")
    echoed = greedy(url, prompt="Once upon", echo=True)
    assert echoed["text"] == "Once upon" + plain["text"]
    by_ids = post(url, prompt=[7454, 2402], max_tokens=4, temperature=0, echo=True).json()
    assert by_ids["choices"][0]["text"].startswith("Once upon")
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": "tiny-llama", "prompt": "Once upon", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "echo": True, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "Once upon"
    assert "".join(e["choices"][0]["text"] for e in events) == echoed["text"]


def test_best_of_returns_the_most_likely_choices(url):
    body = dict(prompt="Colors:", max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    # The same seeds draw the same candidates: n=4 shows all of them with logprobs.
    every = post(url, n=4, logprobs=0, **body).json()["choices"]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = post(url, n=2, best_of=4, **body).json()
    ranked = sorted(range(4), key=lambda i: -totals[i])[:2]
    assert [c["text"] for c in best["choices"]] == [every[i]["text"] for i in sorted(ranked)]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == 24  # every candidate is generated
    r = post(url, n=1, best_of=2, stream=True, prompt="x")
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_tokenize_and_detokenize(url):
    done = greedy(url, prompt="Hello world")
    r = httpx.post(url + "/tokenize", json={"model": "tiny-llama", "prompt": "Hello world",
                                           "return_token_strs": True}).json()
    assert r["tokens"] == done.get("prompt_token_ids") == [15496, 995]
    assert r["count"] == 2 and r["max_model_len"] == 512
    assert r["token_strs"] == ["Hello", " world"]
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    messages = [{"role": "user", "content": "Hi!"}]
    chat = post(url, "/v1/chat/completions", messages=messages, max_tokens=1).json()
    counted = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    for path, body, status, param in (
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
            ("/detokenize", {"tokens": [70000]}, 400, "tokens"),
            ("/detokenize", {"tokens": "x"}, 400, "tokens")):
        r = httpx.post(url + path, json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, body)


def test_continue_final_message_goes_on_with_the_assistants_text(url):
    # The tests' chat template: "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    opened = httpx.post(url + "/tokenize", json={"messages": messages,
                                                 "continue_final_message": True}).json()
    text = "<|user|>\nCount\n<|assistant|>\n1, 2,"   # the message left open: no "\n"
    assert opened["tokens"] == httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]
    closed = httpx.post(url + "/tokenize", json={"messages": messages,
                                                 "add_generation_prompt": False}).json()
    assert closed["tokens"] != opened["tokens"]
    chat = post(url, "/v1/chat/completions", messages=messages, continue_final_message=True,
                max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True)
    assert chat.status_code == 200, chat.text
    chat = chat.json()
    assert chat["choices"][0]["prompt_token_ids"] == opened["tokens"]
    same = greedy(url, prompt=opened["tokens"], n_tokens=8)
    assert chat["choices"][0]["token_ids"] == same["token_ids"]
    assert chat["choices"][0]["message"]["content"] == same["text"]
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        for body, fragment in (
                ({"messages": messages[:1]}, "it is a user message"),
                ({"messages": messages, "add_generation_prompt": True},
                 "cannot be combined with add_generation_prompt true")):
            r = post(url, path, continue_final_message=True, **body, **extra)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "continue_final_message", r.text
            assert fragment in error["message"]


def test_version_models_and_aliases(url):
    assert httpx.get(url + "/version").json() == {"version": version("roseserve")}
    listed = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny-llama", "tiny"]
    assert all(m["root"] == "tiny-llama" and m["max_model_len"] == 512 for m in listed)
    one = httpx.get(url + "/v1/models/tiny")
    assert one.status_code == 200 and one.json()["id"] == "tiny"
    missing = httpx.get(url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    by_alias = post(url, model="tiny", prompt="x", max_tokens=2)
    assert by_alias.status_code == 200 and by_alias.json()["model"] == "tiny"


def test_a_request_without_a_model_gets_the_first_name_served(url):
    """model may be left out (vLLM and llama.cpp's server take that): the response
    names the first name served; the same tokens as a request that names it."""
    named = greedy(url)["token_ids"]
    for path, body in [("/v1/completions", {"prompt": "The sky is", "max_tokens": 4}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 4})]:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama", (path, r.text)
    r = httpx.post(url + "/v1/completions", json={
        "prompt": "The sky is", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=60)
    assert r.json()["choices"][0]["token_ids"] == named


def test_an_unknown_route_or_method_is_told_what_is_served(url):
    r = httpx.post(url + "/v1/images/generations", json={"model": "tiny-llama",
                                                         "prompt": "x"})
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.startswith(
        "there is no route /v1/images/generations;")
    assert "POST /v1/chat/completions" in message and "GET /v1/models;" in message
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "/v1/completions does not take GET; it takes POST"
    # A long path is cut at 200 characters in the message.
    r = httpx.get(url + "/" + "x" * 5000)
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.startswith(f"there is no route /{'x' * 199}...;")


def test_prompt_logprobs_and_echo_with_logprobs(url):
    body = post(url, prompt="Hello world again", max_tokens=2, temperature=0,
                prompt_logprobs=1).json()["choices"][0]
    plp = body["prompt_logprobs"]
    assert len(plp) == 3 and plp[0] is None
    assert "995" in plp[1] and plp[1]["995"]["decoded_token"] == " world"
    assert all(1 <= len(entry) <= 2 for entry in plp[1:])
    # The same number, read from the raw distribution when " world" is generated
    # after "Hello" (logit_bias forces it; logprobs come before any bias).
    forced = post(url, prompt=[15496], max_tokens=1, logprobs=0,
                  logit_bias={"995": 100}).json()["choices"][0]["logprobs"]
    assert forced["tokens"] == [" world"]
    assert abs(forced["token_logprobs"][0] - plp[1]["995"]["logprob"]) < 1e-4
    echoed = post(url, prompt="Hello world again", max_tokens=2, temperature=0, echo=True,
                  logprobs=1).json()["choices"][0]
    lp = echoed["logprobs"]
    assert lp["tokens"][:3] == ["Hello", " world", " again"] and len(lp["tokens"]) == 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # each token among its own top_logprobs, as OpenAI's are (up to logprobs + 1)
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:]):
        assert top[token] == value and 1 <= len(top) <= 2
    sampled = post(url, prompt="Hello", max_tokens=8, temperature=2.0, seed=1,
                   logprobs=1).json()["choices"][0]["logprobs"]
    assert any(len(top) == 2 for top in sampled["top_logprobs"])   # sampled past the best
    assert all(top[t] == v for t, v, top in zip(sampled["tokens"], sampled["token_logprobs"],
                                                 sampled["top_logprobs"]))
    assert lp["token_logprobs"][1] == pytest.approx(plp[1]["995"]["logprob"], abs=1e-4)
    assert lp["text_offset"] == [0, 5, 11, 17, 17 + len(lp["tokens"][3])]
    assert "prompt_logprobs" not in echoed  # not asked for
    chat = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=1, prompt_logprobs=0).json()["choices"][0]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3



def streamed_logprobs(url, **body) -> list[tuple[str, dict]]:
    """Each choice's text and logprobs, put together from a completions stream."""
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": "tiny-llama", "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    choices: dict = {}
    for e in events:
        for c in e["choices"]:
            text, lp = choices.setdefault(c["index"], ["", {}])
            choices[c["index"]][0] = text + c["text"]
            for key, values in (c["logprobs"] or {}).items():
                lp.setdefault(key, []).extend(values)
    return [tuple(choices[i]) for i in sorted(choices)]


@pytest.mark.parametrize("body", [
    dict(prompt="Hello world again", max_tokens=5, temperature=0, logprobs=1),
    dict(prompt=[[15496, 995], [15496]], max_tokens=3, temperature=0.9, seed=4, n=2,
         logprobs=2),
    dict(prompt="Hello world again", max_tokens=0, logprobs=1)])   # scoring
def test_echo_with_logprobs_streams_what_the_whole_response_holds(url, body):
    """The prompt and its logprobs come with each choice's first chunk (they come
    with the first token from the engine), then its tokens' (vLLM streams them too)."""
    whole = post(url, echo=True, **body).json()["choices"]
    assert streamed_logprobs(url, echo=True, **body) == [
        (c["text"], c["logprobs"]) for c in whole]


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(url):
    # What evaluation clients send to score a text (OpenAI's completions took it).
    with_tokens = post(url, prompt="Hello world again", max_tokens=2, temperature=0,
                       echo=True, logprobs=1).json()["choices"][0]["logprobs"]
    r = post(url, prompt="Hello world again", max_tokens=0, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    body = r.json()
    scored = body["choices"][0]
    assert scored["text"] == "Hello world again" and scored["finish_reason"] == "length"
    assert scored["logprobs"] == {key: value[:3] for key, value in with_tokens.items()}
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 3
    # Several prompts, by token ids, n of each; streamed: the echo, then the end.
    many = post(url, prompt=[[15496, 995], [15496]], max_tokens=0, echo=True, n=2).json()
    assert [c["text"] for c in many["choices"]] == ["Hello world"] * 2 + ["Hello"] * 2
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": "tiny-llama", "prompt": "Hello world", "max_tokens": 0, "echo": True,
            "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
        ("Hello world", None), ("", "length")]
    for extra, param in (({}, "max_tokens"), ({"echo": True, "min_tokens": 1}, "max_tokens")):
        r = post(url, prompt="x", max_tokens=0, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_forced_tool_call_and_another_constraint_are_refused(url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                 tools=tools, tool_choice=choice, response_format={"type": "json_object"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tool_choice" and "response_format" in error["message"]
    # tool_choice "none" forces nothing: the response format alone holds.
    r = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
             tools=tools, tool_choice="none", response_format={"type": "json_object"},
             max_tokens=4)
    assert r.status_code == 200, r.text
