"""vLLM's request extras that change what the engine sees, end to end (real engine,
tokenizer pool and frontend): ``cache_salt`` keeps the prefix cache's blocks among
requests with the same salt; ``add_special_tokens`` adds the tokenizer's BOS to a
completion's prompt (by default) or a chat's rendered messages (when asked). The model
is the tiny Llama with a tokenizer that puts a BOS before a text, as Llama's does."""

from __future__ import annotations

import httpx
import pytest

import processes

BOS = 50256  # the tiny tokenizer's <|endoftext|>, its BOS here
PROMPT = list(range(1000, 1064))   # 64 token ids: 15 full blocks of 4 before the last


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_llama_dir):
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
    try:
        processes.wait_healthy(front)
        yield front.url
    finally:
        for p in (front, pool, engine):
            p.stop()


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
