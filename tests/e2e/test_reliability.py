"""The reliability suite: faults injected into the real stack under ``roseserve serve``.

Each kill test runs 32 streaming requests, kills one process kind with SIGKILL while
they run, and checks that every request ends with its full output or with an explicit
error (an SSE error event or an OpenAI-shaped 5xx) within 5 s of the kill, that nothing
hangs, and that the supervisor brings the stack back. An engine's streams do not end:
they continue on another engine, or on the same one restarted (failover), with the
tokens they would have had. The disconnect test checks that
clients that go away leak nothing (hostile HTTP bodies: tests/e2e/test_hostile_http.py).
Recovery times are printed (``-s``) for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import pytest

import processes
from processes import metric, serves

N_STREAMS = 32
MAX_TOKENS = 48
END_WITHIN_S = 5.0
RECOVER_WITHIN_S = 60.0


@dataclass
class Outcome:
    status: int = 0
    tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[dict] = None
    transport_error: Optional[str] = None
    first_chunk: float = 0.0
    ended: float = 0.0
    token_ids: list = field(default_factory=list)
    # the longest wait between two chunks with tokens, and when it ended
    max_gap: float = 0.0
    last_token: float = 0.0

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finish_reason == "length" and \
            self.tokens == MAX_TOKENS and self.error is None

    @property
    def explicit_error(self) -> bool:
        if self.status >= 500:
            return self.error is not None and self.error.get("message") is not None
        return self.status == 200 and self.error is not None and \
            self.error.get("message") is not None


async def stream(client: httpx.AsyncClient, url: str, body: dict,
                 out: Optional[Outcome] = None) -> Outcome:
    """One streamed request, read to its end; how it ended (filled in as it goes)."""
    out = out or Outcome()
    try:
        async with client.stream("POST", url, json=body, timeout=120) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = json.loads(await r.aread()).get("error")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]
                    continue
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    now = time.monotonic()
                    if not out.first_chunk:
                        out.first_chunk = now
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if choice.get("token_ids"):
                        if out.last_token:
                            out.max_gap = max(out.max_gap, now - out.last_token)
                        out.last_token = now
                        out.token_ids += choice["token_ids"]
    except httpx.HTTPError as e:
        out.transport_error = f"{type(e).__name__}: {e}"
    finally:
        out.ended = time.monotonic()
    return out


def completion_body(prompt="Hello there", **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **kw}


def wait_for(predicate, timeout_s: float, what: str, log=lambda: "") -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s\n{log()}")


@pytest.fixture
def stack(tiny_llama_dir, tmp_path, request):
    """A ``roseserve serve`` stack; ROSESERVE_FAULT_* in the test's ``faults`` marker."""
    marker = request.node.get_closest_marker("faults")
    s = processes.Serve(tiny_llama_dir, tmp_path / "serve.log",
                        env=marker.args[0] if marker else None)
    s.wait_ready()
    yield s
    assert s.stop() == 0, s.log()


def kill_during_streams(stack, kind: str, bodies: list[dict], when) -> tuple[list[Outcome], float]:
    """Run the streams, SIGKILL the first process of ``kind`` once ``when(outcomes,
    seconds since the start)`` holds; the outcomes and the kill time."""
    victim = stack.pids()[kind][0]
    outcomes = [Outcome() for _ in bodies]
    kill_time = 0.0

    async def run():
        nonlocal kill_time
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
            tasks = [asyncio.create_task(stream(client, f"{stack.url}/v1/completions", b, o))
                     for b, o in zip(bodies, outcomes)]
            started = time.monotonic()
            while not when(outcomes, time.monotonic() - started):
                assert time.monotonic() - started < 60, "the kill condition never held"
                await asyncio.sleep(0.02)
            os.kill(victim, signal.SIGKILL)
            kill_time = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(run())
    return outcomes, kill_time


def all_streaming(outcomes: list[Outcome], _elapsed: float) -> bool:
    return all(o.first_chunk for o in outcomes)


def bodies_greedy_and_seeded(n: int) -> list[dict]:
    """Distinct one-token prompts (under a block: spread by load), half greedy, half
    sampled with a seed each: what a failover must continue exactly."""
    return [completion_body([100 + i], return_token_ids=True,
                            **({"temperature": 0.0} if i % 2 else {"seed": i}))
            for i in range(n)]


def stalls(outcomes: list[Outcome]) -> str:
    gaps = sorted(o.max_gap for o in outcomes)
    return f"p50 {gaps[len(gaps) // 2]:.2f} s, max {gaps[-1]:.2f} s"


@pytest.mark.faults({"ROSESERVE_FAULT_STEP_DELAY_S": "0.05"})
def test_the_only_engine_killed_mid_stream_its_streams_wait_and_continue(stack):
    """Its restart takes a few seconds; every stream waits for it (up to
    --failover-timeout) and continues with the tokens it would have had."""
    bodies = bodies_greedy_and_seeded(N_STREAMS)
    reference = asyncio.run(_streams(stack.url, bodies))
    assert all(o.complete for o in reference), reference
    outcomes, killed = kill_during_streams(stack, "engine", bodies, all_streaming)
    assert all(o.complete and not o.transport_error for o in outcomes), outcomes
    assert [o.token_ids for o in outcomes] == [o.token_ids for o in reference]
    assert metric(stack.url, "roseserve_request_failovers_total") == N_STREAMS
    print(f"\nthe only engine killed: {N_STREAMS}/{N_STREAMS} streams continued once it was "
          f"restarted, token for token; the longest stall a client saw: {stalls(outcomes)}")
    assert "roseserve: engine-0 exited with code -9" in stack.log()


@pytest.mark.faults({"ROSESERVE_FAULT_SLOW_MARKER": "slowtok", "ROSESERVE_FAULT_SLOW_S": "1"})
def test_one_tokenizer_worker_killed_while_tokenizing(stack):
    workers = stack.pids()["tokenizer_worker"]
    assert len(workers) == 2
    bodies = [completion_body(f"slowtok {i}") for i in range(N_STREAMS)]
    outcomes, killed = kill_during_streams(
        stack, "tokenizer_worker", bodies, lambda outcomes, elapsed: elapsed > 0.4)
    # Its jobs go to the other worker (retried once): every request completes.
    assert all(o.complete for o in outcomes), [o for o in outcomes if not o.complete]
    # Failover delays a request's tokenization, so its first token: by two slow batches
    # at most. (Its end also waits for 48 tokens of 32 streams, which is throughput.)
    slowest = max(o.first_chunk - killed for o in outcomes)
    assert slowest < END_WITHIN_S + 2 * 1.0, slowest
    replaced = wait_for(lambda: len(stack.pids()["tokenizer_worker"]) == 2 and
                        set(stack.pids()["tokenizer_worker"]) != set(workers), 10,
                        "worker replaced")
    ended = max(o.ended for o in outcomes) - killed
    print(f"\none tokenizer worker killed: {N_STREAMS}/{N_STREAMS} complete, the last "
          f"started {slowest:.2f} s and ended {ended:.2f} s after the kill; worker replaced "
          f"within {replaced:.1f} s")
    assert serves(stack.url)


@pytest.mark.faults({"ROSESERVE_FAULT_SLOW_MARKER": "slowtok", "ROSESERVE_FAULT_SLOW_S": "1",
                     "ROSESERVE_FAULT_STEP_DELAY_S": "0.05"})
def test_tokenizer_pool_killed(stack):
    pool = stack.pids()["tokenizer"][0]
    old_workers = stack.pids()["tokenizer_worker"]
    # Half the requests are generating when the pool dies (token-id prompts, which
    # skip the pool), half are being tokenized.
    half = N_STREAMS // 2
    generating = [completion_body([15496, 612, i]) for i in range(half)]
    tokenizing = [completion_body(f"slowtok {i}") for i in range(half)]
    outcomes, killed = kill_during_streams(
        stack, "tokenizer", generating + tokenizing,
        lambda outcomes, elapsed: elapsed > 0.5 and all_streaming(outcomes[:half], elapsed))
    late = [o for o in outcomes if not o.complete and o.ended - killed > END_WITHIN_S]
    assert not late, late
    failed = [o for o in outcomes if not o.complete]
    assert failed and all(o.explicit_error and o.status == 503 for o in failed), failed
    assert all(o.complete for o in outcomes[:half]), outcomes[:half]
    assert len(failed) == half
    # The workers die with their pool (no orphans), and the pool comes back.
    wait_for(lambda: not set(old_workers) & set(stack.pids()["tokenizer_worker"]), 10,
             "old workers gone")
    assert pool not in stack.pids()["tokenizer"]
    wait_for(lambda: serves(stack.url), RECOVER_WITHIN_S, "service back", stack.log)
    print(f"\ntokenizer pool killed: {len(failed)} requests being tokenized got 503 within "
          f"{max(o.ended - killed for o in failed):.2f} s, the others completed; served "
          f"again {time.monotonic() - killed:.1f} s after the kill")


@pytest.mark.faults({"ROSESERVE_FAULT_STEP_DELAY_S": "0.1"})
def test_frontend_killed(stack):
    # Long requests: at 0.1 s a step they would run for 40 s after the kill.
    outcomes, killed = kill_during_streams(stack, "frontend",
                                           [completion_body(max_tokens=400)] * N_STREAMS,
                                           all_streaming)
    # The connection is the only thing a client of a dead process can see end.
    assert all(o.transport_error for o in outcomes), outcomes
    assert max(o.ended - killed for o in outcomes) < END_WITHIN_S
    wait_for(lambda: serves(stack.url), RECOVER_WITHIN_S, "service back", stack.log)
    back = time.monotonic() - killed
    # The engine drops the dead frontend's requests (its next output to the gone peer
    # fails; a peer that is only silent expires after --client-timeout) instead of
    # running them to max_tokens for nobody.
    wait_for(lambda: metric(stack.url, "vllm:num_requests_running") == 0
             and metric(stack.url, "roseserve_engine_kv_blocks", state="used") == 0,
             30, "the dead frontend's requests dropped", stack.log)
    dropped = time.monotonic() - killed
    assert dropped < 30
    print(f"\nfrontend killed: {N_STREAMS} connections reset; served again {back:.1f} s "
          f"after the kill; its engine requests dropped {dropped:.1f} s after it")


def test_one_of_two_engines_killed(tiny_llama_dir, tmp_path):
    stack = processes.Serve(tiny_llama_dir, tmp_path / "serve.log", engines=2,
                            env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.05"})
    try:
        stack.wait_ready()
        wait_for(lambda: metric(stack.url, "roseserve_engines_healthy") == 2, 60, "both up")
        bodies = bodies_greedy_and_seeded(N_STREAMS)
        reference = asyncio.run(_streams(stack.url, bodies))
        assert all(o.complete for o in reference), reference
        outcomes, killed = kill_during_streams(stack, "engine", bodies, all_streaming)
        others = time.monotonic()
        assert serves(stack.url)  # at once, by the engine still up
        others = time.monotonic() - others
        # the streams on it continued on the other, token for token
        assert all(o.complete and not o.transport_error for o in outcomes), outcomes
        assert [o.token_ids for o in outcomes] == [o.token_ids for o in reference]
        moved = metric(stack.url, "roseserve_request_failovers_total")
        assert 0 < moved < N_STREAMS
        moved_outcomes = sorted(outcomes, key=lambda o: o.max_gap)[-int(moved):]
        wait_for(lambda: metric(stack.url, "roseserve_engines_healthy") == 2,
                 RECOVER_WITHIN_S, "the killed engine back", stack.log)
        rejoined = time.monotonic() - killed
        before = {e: metric(stack.url, "roseserve_engine_routed_requests_total", engine=e)
                  for e in (f"ipc://{d}" for d in _engine_sockets(stack))}
        asyncio.run(_streams(stack.url, [completion_body([300 + i]) for i in range(8)]))
        after = {e: metric(stack.url, "roseserve_engine_routed_requests_total", engine=e)
                 for e in before}
        assert all(after[e] > before[e] for e in before), (before, after)
        print(f"\none of two engines killed: {moved:.0f}/{N_STREAMS} streams (those on it) "
              f"continued on the other, token for token, every stream complete; the "
              f"longest stall of those: {stalls(moved_outcomes)}; a new request was served "
              f"by the other in {others:.2f} s; the killed one rejoined "
              f"{rejoined:.1f} s after the kill")
    finally:
        assert stack.stop() == 0, stack.log()


def test_a_rolling_restart_under_load_fails_nothing(tiny_llama_dir, tmp_path):
    """SIGHUP to ``roseserve serve --engines 2`` while 8 clients stream 48-token
    completions without pause: each engine drains and is restarted in turn, and every
    request completes in full (none fails, none is cut short). The drain timeout is
    shorter than a request: what a draining engine still runs then fails over to the
    other, with the tokens it would have had."""
    stack = processes.Serve(tiny_llama_dir, tmp_path / "serve.log", "--drain-timeout", "0.1",
                            engines=2, env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    try:
        stack.wait_ready()
        wait_for(lambda: metric(stack.url, "roseserve_engines_healthy") == 2, 60, "both up")
        before = set(stack.pids()["engine"])
        outcomes: list[Outcome] = []
        bodies: list[dict] = []
        restarted = asyncio.Event()

        async def client(i: int, http: httpx.AsyncClient) -> None:
            n = 0
            while not restarted.is_set():
                bodies.append(completion_body([100 + 8 * n + i], temperature=0.0,
                                              return_token_ids=True))
                outcomes.append(Outcome())
                await stream(http, f"{stack.url}/v1/completions", bodies[-1], outcomes[-1])
                n += 1

        async def run() -> float:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as http:
                clients = [asyncio.create_task(client(i, http)) for i in range(8)]
                await asyncio.sleep(1.0)
                began = time.monotonic()
                os.kill(stack.proc.pid, signal.SIGHUP)
                while "rolling restart of 2 engine(s) done" not in stack.log():
                    assert time.monotonic() - began < 120, stack.log()
                    assert not any(c.done() for c in clients), [c.exception() for c in clients]
                    await asyncio.sleep(0.1)
                took = time.monotonic() - began
                await asyncio.sleep(1.0)  # and the restarted engines serve
                restarted.set()
                await asyncio.wait_for(asyncio.gather(*clients), 60)
                return took

        took = asyncio.run(run())
        after = set(stack.pids()["engine"])
        failed = [o for o in outcomes if not o.complete]
        retries = metric(stack.url, "roseserve_request_retries_total")
        moved = metric(stack.url, "roseserve_request_failovers_total")
        print(f"\nrolling restart of 2 engines (drain timeout 0.1 s) under 8 streaming "
              f"clients: {len(outcomes)} requests, {len(failed)} failed, {retries:.0f} "
              f"retried and {moved:.0f} failed over mid-stream to the other engine; the "
              f"restart took {took:.1f} s")
        assert not failed, failed
        assert len(outcomes) >= 16
        assert len(after) == 2 and not after & before  # both were restarted
        assert moved > 0   # (a drain that outlasts its timeout)
        reference = asyncio.run(_streams(stack.url, bodies))
        assert [o.token_ids for o in outcomes] == [o.token_ids for o in reference]
    finally:
        assert stack.stop() == 0, stack.log()


def _engine_sockets(stack) -> list[str]:
    import psutil

    out = []
    for pid in stack.pids()["engine"]:
        cmd = psutil.Process(pid).cmdline()
        out.append(cmd[cmd.index("--bind") + 1].removeprefix("ipc://"))
    return out


async def _streams(url: str, bodies: list[dict]) -> list[Outcome]:
    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(stream(client, f"{url}/v1/completions", b)
                                      for b in bodies))


def test_the_frontend_starts_alone_and_serves_once_an_engine_joins(tiny_llama_dir, tmp_path):
    """The engine's address given by DNS name (localhost), as a cluster gives it."""
    port = processes.free_port()
    engine_address, pool_address = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/tok.sock"
    front = processes.frontend(tiny_llama_dir, f"tcp://localhost:{port}", pool_address,
                               "--served-model-name", "tiny", "--dns-refresh", "0.5")
    started: list = []
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{front.url}/health", timeout=5).status_code == 503
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "the frontend answering without any engine")
        assert ("frontend up, waiting for the tokenizer pool and an engine (503 until then): "
                "tiny, 0 of 1 engine(s) answering") in front.output()
        r = httpx.post(f"{front.url}/v1/completions", timeout=10,
                       json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        started += [processes.engine(tiny_llama_dir, engine_address),
                    processes.tokenizer_pool(tiny_llama_dir, pool_address, workers=1)]
        joined = wait_for(lambda: serves(front.url), 120, "served once the engine is up")
        print(f"\nfrontend first: served {joined:.1f} s after its engine was started")
    finally:
        for p in (front, *started):
            p.stop()


def test_a_stopping_frontend_lets_its_streams_finish_within_its_drain_timeout(
        tiny_llama_dir, tmp_path):
    """SIGTERM to two frontends in the middle of a 3-s stream each: the one with
    --drain-timeout 15 refuses new connections at once and finishes its stream, whole;
    the one with --drain-timeout 1 cuts its stream at about a second."""
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    fronts = [processes.frontend(tiny_llama_dir, engine.address, pool.address,
                                 "--served-model-name", "tiny", "--drain-timeout", drain)
              for drain in ("15", "1")]
    body = completion_body(max_tokens=150)  # 150 steps of 20 ms or more
    try:
        for front in fronts:
            processes.wait_healthy(front)

        async def run():
            async with httpx.AsyncClient() as client:
                outcomes = [Outcome(), Outcome()]
                tasks = [asyncio.create_task(stream(client, f"{f.url}/v1/completions", body, o))
                         for f, o in zip(fronts, outcomes)]
                while not all(o.first_chunk for o in outcomes):
                    await asyncio.sleep(0.02)
                stopped = time.monotonic()
                for front in fronts:
                    front.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(httpx.ConnectError):  # no new work once stopping
                    await client.get(f"{fronts[0].url}/health")
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return outcomes, stopped

        (whole, cut), stopped = asyncio.run(run())
        assert whole.finish_reason == "length" and whole.tokens == 150, whole
        assert whole.ended - stopped > 1.5  # it ran on well past the other's cut
        assert cut.transport_error is not None and cut.finish_reason is None, cut
        assert 0.5 < cut.ended - stopped < 5, cut
        # Exited by themselves (uvicorn re-raises the SIGTERM it handled once it is done).
        assert all(f.proc.wait(30) in (0, -signal.SIGTERM) for f in fronts)
    finally:
        for p in (*fronts, pool, engine):
            p.stop()


async def connect_and_ask(port: int, request: bytes) -> Optional[bytes]:
    """One request on a new connection, read to its end: the response, or None when
    the connection was never made (refused, or no handshake within 3 s). A reset or a
    close before the response ends raises."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), 3)
    except (ConnectionRefusedError, asyncio.TimeoutError):
        return None
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        return head + await reader.readexactly(length)
    finally:
        writer.close()


def test_a_stopping_frontend_answers_every_connection_it_took(tiny_llama_dir, tmp_path):
    """Clients opening a new connection for each request, as fast as they can, while
    the frontend gets SIGTERM: a connection is refused (never taken: a balancer tries
    another frontend) or answered in full; none is reset or closed unanswered. Closing
    a listening socket resets every connection still in its accept queue, whose clients
    had seen their connect() succeed; the frontend stops new handshakes first and takes
    in what the kernel had queued before it closes."""
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock")
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--served-model-name", "tiny", "--no-access-log")
    port = int(front.url.rsplit(":", 1)[1])
    request = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    try:
        processes.wait_healthy(front)

        async def client(answers: list, failures: list) -> None:
            while True:
                try:
                    response = await connect_and_ask(port, request)
                except (OSError, asyncio.IncompleteReadError) as e:
                    failures.append(repr(e))
                    continue
                if response is None:
                    return  # the frontend takes no more connections
                answers.append(response.split(b"\r\n", 1)[0])

        async def run():
            answers, failures = [], []
            clients = [asyncio.create_task(client(answers, failures)) for _ in range(32)]
            await asyncio.sleep(1.0)
            front.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*clients), 30)
            return answers, failures

        answers, failures = asyncio.run(run())
        assert failures == [], f"{len(failures)} of {len(answers) + len(failures)}"
        assert len(answers) > 100 and set(answers) == {b"HTTP/1.1 200 OK"}, set(answers)
        assert front.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        for p in (front, pool, engine):
            p.stop()


# -- clients that go away --------------------------------------------------------------

N_DISCONNECTS = 200


async def raw_post(port: int, path: str, body: bytes, close_after_s: float,
                   read_first: bool = False) -> None:
    """POST over a bare socket and hang up after ``close_after_s`` (before or after
    the response headers, as the timing falls)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    if read_first:
        await reader.readline()
    await asyncio.sleep(close_after_s)
    writer.close()


@pytest.mark.faults({"ROSESERVE_FAULT_SLOW_MARKER": "slowtok", "ROSESERVE_FAULT_SLOW_S": "0.5",
                     "ROSESERVE_FAULT_STEP_DELAY_S": "0.01"})
def test_clients_that_go_away_leak_nothing(stack):
    rng = random.Random(0)
    kinds = {"before headers": 0, "while tokenizing": 0, "mid-stream": 0, "finished": 0}

    async def one(client, i: int) -> Optional[Outcome]:
        kind = rng.choice(list(kinds))
        kinds[kind] += 1
        body = completion_body(f"prompt {i}", max_tokens=rng.randint(8, 64))
        if kind == "before headers":
            await raw_post(stack.port, "/v1/completions", json.dumps(body).encode(),
                           rng.uniform(0.0, 0.03))
        elif kind == "while tokenizing":
            body["prompt"] = f"slowtok {i}"
            await raw_post(stack.port, "/v1/completions", json.dumps(body).encode(),
                           rng.uniform(0.05, 0.3))
        elif kind == "mid-stream":
            async with client.stream("POST", f"{stack.url}/v1/completions", json=body,
                                     timeout=60) as r:
                assert r.status_code == 200
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if lines > rng.randint(2, 10):
                        break  # leaving the block closes the connection
        else:
            out = await stream(client, f"{stack.url}/v1/completions", body)
            assert out.status == 200 and out.finish_reason == "length", out
            assert out.tokens == body["max_tokens"]
            return out
        return None

    async def run():
        gate = asyncio.Semaphore(48)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
            async def bounded(i):
                async with gate:
                    return await one(client, i)
            await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(N_DISCONNECTS))),
                                   240)

    asyncio.run(run())
    assert all(kinds.values()), kinds

    def quiet() -> bool:
        values = [metric(stack.url, "roseserve_requests_in_progress"),
                  metric(stack.url, "roseserve_admitted_requests"),
                  metric(stack.url, "roseserve_admitted_prompt_tokens"),
                  metric(stack.url, "roseserve_engine_load"),
                  metric(stack.url, "vllm:num_requests_running"),
                  metric(stack.url, "vllm:num_requests_waiting"),
                  metric(stack.url, "roseserve_engine_kv_blocks", state="used"),
                  metric(stack.url, "roseserve_tokenizer_queue")]
        return not any(values)

    settled = wait_for(quiet, 15, "every request, slot and KV block given back",
                       lambda: httpx.get(f"{stack.url}/metrics").text)
    print(f"\n{N_DISCONNECTS} clients ({kinds}): nothing held {settled:.1f} s after the last")
    assert serves(stack.url)
