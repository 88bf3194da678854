"""The frontend's limits and deadlines, end to end: what one request may ask for, what
admission counts, and how long tokenization and a whole request may take. Each limit
answers before any work is done (or aborts the work), and gives its share back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import processes
from helpers import greedy, make_engine
from test_frontend import complete, engine_stats, pool_jobs, sse_events, wait_engine_idle

HANG = "HANG-THE-TOKENIZER"
FAIL_TOKEN = 4242


@pytest.fixture(scope="module")
def limited(tmp_path_factory, tiny_llama_dir):
    """An engine that decodes one request at a time at 20 ms a step (and fails any
    request holding token 4242), a pool that hangs on a marker text, and a frontend
    with small limits: 4 waiting engine requests, 16 choices per request, 1 s to
    tokenize, 4 s per request."""
    d = tmp_path_factory.mktemp("limited")
    engine = processes.engine(tiny_llama_dir, f"ipc://{d}/engine.sock", "--max-batch-size", "1",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02",
                                   "ROSESERVE_FAULT_FAIL_TOKEN": str(FAIL_TOKEN)})
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{d}/tok.sock", 1,
                                    {"ROSESERVE_FAULT_HANG_MARKER": HANG}, "--job-timeout", "60")
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--served-model-name", "tiny-llama",
                               "--max-waiting-requests", "4", "--max-choices-per-request", "16",
                               "--tokenize-timeout", "1", "--request-timeout", "4")
    try:
        processes.wait_healthy(front)
        yield {"engine": engine, "pool": pool, "url": front.url}
    finally:
        for p in (front, pool, engine):
            p.stop()


def test_a_request_for_too_many_choices_is_refused_before_any_work(limited):
    url = limited["url"]
    before_engine = engine_stats(limited["engine"].address)
    before_jobs = pool_jobs(limited["pool"].address)
    started = time.monotonic()
    # The request from the issue: 20,000 one-token prompts, n = 64.
    r = complete(url, prompt=[[1]] * 20_000, n=64, max_tokens=1)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_choices" and error["param"] == "prompt"
    assert "1280000 completions (20000 prompt(s) x n=64); at most 16" in error["message"]
    r = complete(url, prompt=["a"] * 5_000, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices"
    r = complete(url, prompt="a", n=17, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert time.monotonic() - started < 10
    after = engine_stats(limited["engine"].address)
    assert after.prefix_cache_query_tokens == before_engine.prefix_cache_query_tokens
    assert pool_jobs(limited["pool"].address) == before_jobs  # nothing was tokenized


def test_admission_counts_engine_requests_not_http_requests(limited):
    url = limited["url"]
    r = complete(url, prompt=[5, 6], n=5, max_tokens=1)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny-llama", "prompt": [5, 6], "max_tokens": 200,
                    "ignore_eos": True, "stream": True}
            # One request decodes (the engine's only slot); three choices of another wait.
            running = client.build_request("POST", url + "/v1/completions", json=body)
            waiting = client.build_request("POST", url + "/v1/completions",
                                           json={**body, "n": 3})
            r1 = await client.send(running, stream=True)
            lines = r1.aiter_lines()  # kept: dropping the iterator closes the stream
            await lines.__anext__()
            r2 = await client.send(waiting, stream=True)
            address = limited["engine"].address

            async def until_waiting(count: int) -> None:
                deadline = time.monotonic() + 5
                while (await asyncio.to_thread(engine_stats, address)).num_waiting < count:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)

            await until_waiting(3)
            refused = await client.post(url + "/v1/completions", json={
                "model": "tiny-llama", "prompt": [7], "n": 2, "max_tokens": 1})
            admitted = asyncio.ensure_future(client.post(url + "/v1/completions", json={
                "model": "tiny-llama", "prompt": [7], "max_tokens": 1}))
            await until_waiting(4)  # admitted, and queued in the engine behind the others
            await r1.aclose()  # the clients leave: their engine requests end
            await r2.aclose()
            return refused, await admitted

    refused, admitted = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert "limit of 4 waiting requests" in refused.json()["error"]["message"]
    assert admitted.status_code == 200  # 3 waiting + 1 fits
    stats = wait_engine_idle(limited["engine"].address)
    assert stats.num_running == 0 and stats.num_blocks_used == 0


def test_a_hung_tokenizer_gives_504_and_frees_the_admission_slots(limited):
    url = limited["url"]
    started = time.monotonic()
    results = []
    for _ in range(5):  # more than the 4 slots: each gives its slot back
        results.append(complete(url, prompt=f"{HANG} text", max_tokens=1))
    assert all(r.status_code == 504 for r in results), [r.text for r in results]
    assert results[0].json()["error"]["code"] == "tokenize_timeout"
    assert "tokenization did not finish within 1.0 s" in results[0].json()["error"]["message"]
    assert time.monotonic() - started < 15
    assert complete(url, prompt=[3, 4], max_tokens=2).status_code == 200


def test_the_request_timeout_ends_the_request_and_aborts_it_in_the_engine(limited):
    url = limited["url"]
    before = engine_stats(limited["engine"].address).num_generated_tokens
    # 400 tokens at 20 ms a step take 8 s; the limit is 4 s.
    r = complete(url, prompt=[9, 10], max_tokens=400, ignore_eos=True)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": [9, 11], "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    stats = wait_engine_idle(limited["engine"].address)
    assert stats.num_running == 0 and stats.num_blocks_used == 0
    # Two requests of ~4 s each at 20 ms a step: far from the 800 tokens asked for.
    assert stats.num_generated_tokens - before < 500


def test_a_request_that_fails_in_the_engine_is_500_and_alone(limited, tiny_llama_dir):
    url = limited["url"]
    expected = make_engine(tiny_llama_dir).generate([[5, 6, 7]], greedy(6))[0]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            def post(prompt, stream=False):
                return client.post(url + "/v1/completions", json={
                    "model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True, "stream": stream})
            return await asyncio.gather(post([FAIL_TOKEN, 5]), post([5, 6, 7]),
                                        post([FAIL_TOKEN, 6], stream=True))

    bad, good, bad_stream = asyncio.run(main())
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["code"] == "engine_error" and error["type"] == "internal_error"
    assert "injected per-request failure" in error["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == expected
    events = [json.loads(line[6:]) for line in bad_stream.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "engine_error"


def test_a_tiny_temperature_is_greedy_and_fails_no_neighbour(limited, tiny_llama_dir):
    url = limited["url"]
    expected = make_engine(tiny_llama_dir).generate([[8, 9], [10, 11]], greedy(5))

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            def post(prompt, temperature):
                return client.post(url + "/v1/completions", json={
                    "model": "tiny-llama", "prompt": prompt, "max_tokens": 5,
                    "temperature": temperature, "ignore_eos": True, "return_token_ids": True})
            return await asyncio.gather(post([8, 9], 1e-39), post([10, 11], 0))

    tiny, valid = asyncio.run(main())
    assert tiny.status_code == 200 and valid.status_code == 200
    assert [tiny.json()["choices"][0]["token_ids"],
            valid.json()["choices"][0]["token_ids"]] == expected


def test_a_job_left_mid_setup_gives_back_what_it_took_even_if_the_setup_finished():
    """A client gone while its request was being set up: the set-up is cancelled, but
    a cancellation can be swallowed (asyncio.wait_for before 3.12) and the set-up
    finish anyway, holding an admission share. The soak found 8 such jobs held forever
    in a minute of dropped connections. The job records each share as it is taken and
    its response closes it, whatever the set-up did."""
    from types import SimpleNamespace

    from frontend.admission import Admission
    from frontend.job import Job
    from frontend.routes import JobResponse

    admission, never = Admission(max_requests=8, max_tokens=1000), asyncio.Event()
    closed: list = []

    async def prepare(job, body, formatter=None) -> None:
        job.ticket = admission.admit(2, 100)
        try:
            await never.wait()
        except asyncio.CancelledError:
            return  # the cancellation swallowed: the set-up "finished"

    def submit(job) -> None:
        raise AssertionError("a job whose client left must not reach the engines")

    pipe = SimpleNamespace(inputs=SimpleNamespace(prepare=prepare),
                           outputs=SimpleNamespace(submit=submit))

    async def main() -> list:
        events: asyncio.Queue = asyncio.Queue()
        sent: list = []

        async def send(message) -> None:
            sent.append(message)

        job = Job(request_id="cmpl-1", created=0, model="m", received=0.0, stream=True,
                  on_close=closed.append)
        served = asyncio.ensure_future(JobResponse(pipe, job, None)(
            {"type": "http"}, events.get, send))
        await asyncio.sleep(0.01)
        assert admission.requests == 2  # taken, and held while the set-up runs
        events.put_nowait({"type": "http.disconnect"})
        await served
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 499
    assert (admission.requests, admission.tokens) == (0, 0)
    assert [job.request_id for job in closed] == ["cmpl-1"]


def test_embeddings_past_the_request_timeout_give_504_and_are_aborted_in_the_engine(limited):
    url = limited["url"]
    before = engine_stats(limited["engine"].address).num_prompt_tokens_computed
    # 400 inputs, one engine step of 20 ms each (one at a time): 8 s; the limit is 4 s.
    r = httpx.post(url + "/v1/embeddings", timeout=60,
                   json={"model": "tiny-llama", "input": [[9, 10]] * 400})
    assert r.status_code == 504, r.text[:300]
    assert r.json()["error"] == {
        "message": "the embeddings took longer than the request timeout (4 s)",
        "type": "error", "param": None, "code": "request_timeout"}
    stats = wait_engine_idle(limited["engine"].address)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0
    # the inputs not embedded by then were aborted, not computed
    assert stats.num_prompt_tokens_computed - before < 700
