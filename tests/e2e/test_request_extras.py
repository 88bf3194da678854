"""vLLM's request extras, end to end (real engine, tokenizer pool and frontend):
``cache_salt`` keeps the prefix cache's blocks among requests with the same salt;
``add_special_tokens`` adds the tokenizer's BOS to a completion's prompt (by default)
or a chat's rendered messages (when asked); ``return_tokens_as_token_ids`` names
logprobs' tokens by id; ``suffix`` has a code model fill in the middle. And what
logprobs say of tokens holding part of a character: their own ``bytes``, and
``text_offset`` in characters. The model is the tiny Llama with a tokenizer that puts
a BOS before a text, as Llama's does (and a code model's, for the suffix)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

import processes
from frontend_stacks import sse_events

BOS = 50256  # the tiny tokenizer's <|endoftext|>, its BOS here
PROMPT = list(range(1000, 1064))   # 64 token ids: 15 full blocks of 4 before the last


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """The model's folder, a frontend, and one started with --return-tokens-as-token-ids."""
    from tokenizers import Tokenizer, processors

    model = tmp_path_factory.mktemp("bos") / "tiny-llama"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name != "tokenizer.json":
            (model / f.name).symlink_to(f)
    tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                      special_tokens=[("<|endoftext|>", BOS)])])
    tok.save(str(model / "tokenizer.json"))
    run = tmp_path_factory.mktemp("run")
    engine = processes.engine(model, f"ipc://{run}/engine.sock")
    pool = processes.tokenizer_pool(model, f"ipc://{run}/tok.sock", workers=1)
    front = processes.frontend(model, engine.address, pool.address)
    as_ids = processes.frontend(model, engine.address, pool.address,
                                "--return-tokens-as-token-ids")
    try:
        for p in (front, as_ids):
            processes.wait_healthy(p)
        yield SimpleNamespace(model=model, url=front.url, url_as_ids=as_ids.url)
    finally:
        for p in (front, as_ids, pool, engine):
            p.stop()


@pytest.fixture(scope="module")
def url(stack):
    return stack.url


def post(url, path, **body) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached(url, path="/v1/completions", **body) -> int:
    """The prompt tokens a request read from the prefix cache."""
    if path == "/v1/responses":
        usage = post(url, path, max_output_tokens=1, **body)["usage"]
        return usage["input_tokens_details"]["cached_tokens"]
    usage = post(url, path, max_tokens=1, **body)["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_the_prefix_cache_is_shared_only_among_requests_with_the_same_salt(url):
    prompt = [t + 1 for t in PROMPT]   # nobody else's
    assert cached(url, prompt=prompt, cache_salt="tenant-a") == 0
    assert cached(url, prompt=prompt, cache_salt="tenant-a") == 60
    assert cached(url, prompt=prompt, cache_salt="tenant-b") == 0
    assert cached(url, prompt=prompt) == 0            # unsalted: its own cache
    assert cached(url, prompt=prompt) == 60
    assert cached(url, prompt=prompt, cache_salt="tenant-b") == 60
    # n > 1: the choices share their salt's blocks.
    body = post(url, "/v1/completions", prompt=prompt[:-1] + [7], n=2, max_tokens=1,
                cache_salt="tenant-a")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 60


def test_chat_and_responses_requests_carry_their_salt(url):
    messages = [{"role": "user", "content": "salted " * 40}]
    assert cached(url, "/v1/chat/completions", messages=messages, cache_salt="c") == 0
    hit = cached(url, "/v1/chat/completions", messages=messages, cache_salt="c")
    assert hit >= 48
    assert cached(url, "/v1/chat/completions", messages=messages, cache_salt="d") == 0
    assert cached(url, "/v1/chat/completions", messages=messages) == 0
    # The same conversation through the Responses API renders the same prompt.
    assert cached(url, "/v1/responses", input=messages[0]["content"], cache_salt="c") == hit
    assert cached(url, "/v1/responses", input=messages[0]["content"], cache_salt="e") == 0


@pytest.mark.parametrize("salt, fragment", [
    ("", "cache_salt must be a non-empty string of at most 1024 characters, got 0"),
    ("s" * 1025, "cache_salt must be a non-empty string of at most 1024 characters, got 1025"),
])
def test_a_salt_that_is_no_secret_is_refused(url, salt, fragment):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = httpx.post(url + path, json={**body, "cache_salt": salt}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "cache_salt" and fragment in error["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "cache_salt": 5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def prompt_ids(url, path, **body) -> list[int]:
    out = post(url, path, max_tokens=1, return_token_ids=True, **body)
    return out["choices"][0]["prompt_token_ids"]


def test_echoed_offsets_start_at_the_text_after_the_bos_the_tokenizer_added(stack):
    """Scoring a text (echo, logprobs, max_tokens 0), as evaluation clients do: the
    prompt's tokens are [BOS] + the text's, its echo the text; offsets are in it."""
    body = post(stack.url, "/v1/completions", prompt="Hello 🌹 world", echo=True, logprobs=0,
                max_tokens=0, return_token_ids=True)["choices"][0]
    ids = body["prompt_token_ids"]
    assert ids[0] == BOS and body["text"] == "Hello 🌹 world"
    assert body["logprobs"]["text_offset"] == [0] + offsets_in(stack.model, body["text"], ids[1:])


def test_add_special_tokens_puts_the_bos_before_a_prompt_by_default_and_a_chat_when_asked(url):
    text = post(url, "/tokenize", prompt="Hello world", add_special_tokens=False)["tokens"]
    assert text and BOS not in text
    assert post(url, "/tokenize", prompt="Hello world")["tokens"] == [BOS] + text
    assert prompt_ids(url, "/v1/completions", prompt="Hello world") == [BOS] + text
    assert prompt_ids(url, "/v1/completions", prompt="Hello world",
                      add_special_tokens=False) == text
    # Token ids are the prompt as given.
    assert prompt_ids(url, "/v1/completions", prompt=text) == text

    messages = [{"role": "user", "content": "Hello world"}]
    rendered = post(url, "/tokenize", messages=messages)["tokens"]
    assert rendered and rendered[0] != BOS
    assert post(url, "/tokenize", messages=messages,
                add_special_tokens=True)["tokens"] == [BOS] + rendered
    assert prompt_ids(url, "/v1/chat/completions", messages=messages) == rendered
    assert prompt_ids(url, "/v1/chat/completions", messages=messages,
                      add_special_tokens=True) == [BOS] + rendered


ROSE = "🌹 héllo"   # the rose is four bytes the byte-level tokenizer splits


def forced_chat(url, **body) -> dict:
    return post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                guided_choice=[ROSE], logprobs=True, top_logprobs=2, return_token_ids=True,
                **body)["choices"][0]


def test_chat_logprobs_bytes_are_each_tokens_own_and_join_into_the_text(url):
    choice = forced_chat(url)
    assert choice["message"]["content"] == ROSE
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert b"".join(bytes(e["bytes"]) for e in content) == ROSE.encode()
    partial = [e for e in content if "\ufffd" in e["token"]]
    assert partial, "the rose should be split across tokens"
    for e in partial:   # a token holding part of the rose: not the replacement's bytes
        assert bytes(e["bytes"]) != "\ufffd".encode()
        assert bytes(e["bytes"])[0] >= 0x80
    for e in content:
        for top in e["top_logprobs"]:
            assert top["bytes"] and isinstance(top["bytes"][0], int)


def test_return_tokens_as_token_ids_names_tokens_by_id(stack):
    url = stack.url
    choice = forced_chat(url, return_tokens_as_token_ids=True)
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])
    assert b"".join(bytes(e["bytes"]) for e in content) == ROSE.encode()   # still the token's

    # Completions: tokens and top_logprobs' keys by id, offsets still in the text.
    body = post(url, "/v1/completions", prompt="Hi", guided_choice=[ROSE], logprobs=2,
                return_token_ids=True, return_tokens_as_token_ids=True)["choices"][0]
    assert body["text"] == ROSE
    lp = body["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in body["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) and f"token_id:{t}" in top
               for top, t in zip(lp["top_logprobs"], body["token_ids"]))
    assert lp["text_offset"] == offsets_in(stack.model, ROSE, body["token_ids"])

    # The server's flag makes it the default; a request's false wins.
    as_ids = forced_chat(stack.url_as_ids)
    assert as_ids["logprobs"]["content"][0]["token"] == f"token_id:{as_ids['token_ids'][0]}"
    as_text = forced_chat(stack.url_as_ids, return_tokens_as_token_ids=False)
    assert not as_text["logprobs"]["content"][0]["token"].startswith("token_id:")


def offsets_in(model, text: str, token_ids: list[int], start: int = 0) -> list[int]:
    """Where each token starts in ``text``: the characters its predecessors' bytes
    complete (a token holding part of a character starts where that character does)."""
    from tokenizers import Tokenizer

    from common.tokenizer import TokenStrings

    strings = TokenStrings(Tokenizer.from_file(str(model / "tokenizer.json")))
    raw = [strings.raw(t) for t in token_ids]
    assert b"".join(raw) == text[start:].encode()
    return [start + len(b"".join(raw[:i]).decode("utf-8", "ignore"))
            for i in range(len(raw))]


def test_text_offset_counts_characters_of_the_text(stack):
    """Characters split across tokens count once, echoed or generated, whole or
    streamed (a replacement character per token of the split before)."""
    for echo in (False, True):
        body = post(stack.url, "/v1/completions", prompt="🌹 ok", echo=echo,
                    guided_choice=[ROSE], logprobs=0, return_token_ids=True,
                    add_special_tokens=False)["choices"][0]
        lp = body["logprobs"]
        generated = offsets_in(stack.model, body["text"], body["token_ids"],
                               len(body["text"]) - len(ROSE))
        if echo:
            prompt = offsets_in(stack.model, "🌹 ok", body["prompt_token_ids"])
            assert lp["text_offset"] == prompt + generated
        else:
            assert lp["text_offset"] == generated
        r = httpx.post(stack.url + "/v1/completions", timeout=60, json={
            "prompt": "🌹 ok", "echo": echo, "guided_choice": [ROSE], "logprobs": 0,
            "add_special_tokens": False, "stream": True})
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
        assert [o for c in chunks if c["choices"][0]["logprobs"]
                for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


@pytest.fixture(scope="module")
def coder(tmp_path_factory, tiny_coder_dir):
    """A model with fill-in-the-middle tokens (Qwen2.5-Coder's)."""
    with processes.local_stack(tiny_coder_dir, tmp_path_factory.mktemp("coder")) as front:
        yield front.url


def test_a_suffix_has_a_code_model_fill_in_the_middle(coder):
    pre, suf, mid = 50257, 50258, 50259   # <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>
    head = post(coder, "/tokenize", prompt="def f(")["tokens"]
    tail = post(coder, "/tokenize", prompt="):\n    return 1\n")["tokens"]
    fim = [pre] + head + [suf] + tail + [mid]
    assert prompt_ids(coder, "/v1/completions", prompt="def f(",
                      suffix="):\n    return 1\n") == fim
    # Each prompt gets the suffix; a stream is the same request.
    body = post(coder, "/v1/completions", prompt=["def f(", "x"], suffix="):\n    return 1\n",
                max_tokens=2, return_token_ids=True)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [
        fim, [pre] + post(coder, "/tokenize", prompt="x")["tokens"] + [suf] + tail + [mid]]
    r = httpx.post(coder + "/v1/completions", timeout=60, json={
        "prompt": "def f(", "suffix": "):\n    return 1\n", "max_tokens": 3, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert sse_events(r)[-2]["usage"]["prompt_tokens"] == len(fim)
    # An empty suffix is none.
    assert prompt_ids(coder, "/v1/completions", prompt="def f(", suffix="") == head


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": [1, 2, 3]}, "a suffix goes with text prompts"),
    ({"prompt": "x", "echo": True}, "echo cannot be combined with a suffix"),
    ({"prompt": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens cannot be combined"),
])
def test_a_suffix_that_cannot_be_served_is_refused(coder, body, fragment):
    r = httpx.post(coder + "/v1/completions", json={**body, "suffix": "y"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert fragment in r.json()["error"]["message"]


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "suffix": "y"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in r.json()["error"]["message"]
