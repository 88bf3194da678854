"""Soak: a long run of mixed load near capacity, with aborts and disconnects, on a
``roseserve serve`` stack this script starts; printed figures, not a test.

    python benchmarks/soak.py                              # 10 minutes, default model
    python benchmarks/soak.py --duration 60 --concurrency 32 --json soak.json \\
        -- --model /path/to/model --engines 2            # after --: serve's flags

Load: ``--concurrency`` clients, each sending one request after another, drawn at
random: streamed completions (a fresh or a shared prompt), non-streamed chats, n=2,
streams the client abandons after a few chunks, connections dropped before the
response headers, and requests that must be refused (400). Every generation uses
ignore_eos, so its length is known.

Reported: requests by kind and outcome, and requests lost (must be 0): a request
that hung past its timeout, whose connection failed without our dropping it, that
got a 5xx, or that finished with fewer tokens than it asked for. Each process's RSS
and open file descriptors after the warm-up and at the end, and whether everything
was given back once the load stopped (requests in progress, admission, engine
requests, KV blocks in use: all 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.stack import Stack, cpu_model, metric  # noqa: E402

KINDS = ("stream", "shared-prefix", "chat", "n2", "abandon", "drop", "invalid", "responses")
WEIGHTS = (30, 15, 15, 10, 15, 10, 5, 10)
SHARED = "You are a careful assistant. Answer briefly and cite nothing. " * 4


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the first "
                   "resource reading")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens per request")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    return args, serve_args


LEAK_GAUGES = ("roseserve_requests_in_progress", "roseserve_admitted_requests",
               "roseserve_engine_load", "vllm:num_requests_running", "vllm:num_requests_waiting",
               "roseserve_tokenizer_queue")


def held(text: str) -> dict[str, float]:
    out = {name: metric(text, name) for name in LEAK_GAUGES}
    out["roseserve_engine_kv_blocks{state=used}"] = metric(text, "roseserve_engine_kv_blocks",
                                                           state="used")
    return out


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random,
                      args: argparse.Namespace) -> str:
    """Run one request of ``kind``; its outcome: ok, abandoned, dropped, refused or
    lost: <why>."""
    max_tokens = rng.randint(4, args.max_tokens)
    base = {"model": "soak", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.7])}
    if kind == "drop":
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({**base, "prompt": f"drop {rng.random()}", "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        writer.close()
        return "dropped"
    if kind == "invalid":
        r = await client.post(f"{url}/v1/completions", timeout=args.timeout,
                              json={**base, "prompt": "x", "temperature": -1})
        return "refused" if r.status_code == 400 else f"lost: invalid got {r.status_code}"
    if kind == "chat":
        r = await client.post(f"{url}/v1/chat/completions", timeout=args.timeout, json={
            **base, "messages": [{"role": "user", "content": f"Say {rng.random()}"}]})
        if r.status_code != 200:
            return f"lost: chat {r.status_code} {r.text[:100]}"
        got = r.json()["usage"]["completion_tokens"]
        return "ok" if got == max_tokens else f"lost: chat gave {got}/{max_tokens} tokens"
    if kind == "responses":
        return await one_response(client, url, max_tokens, base["temperature"], rng, args)
    prompt = (SHARED + f"Question {rng.randint(0, 1000)}?" if kind == "shared-prefix"
              else " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                            for _ in range(rng.randint(1, 120))))
    n = 2 if kind == "n2" else 1
    body = {**base, "prompt": prompt, "n": n, "stream": True,
            "stream_options": {"include_usage": True}}
    abandon_after = rng.randint(1, 6) if kind == "abandon" else None
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             timeout=args.timeout) as r:
        if r.status_code != 200:
            return f"lost: {kind} {r.status_code} {(await r.aread())[:100]!r}"
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"lost: {kind} error event {chunk['error'].get('message')}"
            usage = chunk.get("usage") or usage
            chunks += 1
            if abandon_after is not None and chunks >= abandon_after:
                return "abandoned"
    got = usage["completion_tokens"] if usage else 0
    return "ok" if got == n * max_tokens else f"lost: {kind} gave {got}/{n * max_tokens} tokens"


async def one_response(client: httpx.AsyncClient, url: str, max_tokens: int,
                       temperature: float, rng: random.Random, args: argparse.Namespace) -> str:
    """A streamed /v1/responses request. It has no ignore_eos: a response may end
    early, but only as completed, and one that ran out must have every token."""
    body = {"model": "soak", "input": f"Tell {rng.random()}", "max_output_tokens": max_tokens,
            "temperature": temperature, "stream": True}
    final = None
    async with client.stream("POST", f"{url}/v1/responses", json=body,
                             timeout=args.timeout) as r:
        if r.status_code != 200:
            return f"lost: responses {r.status_code} {(await r.aread())[:100]!r}"
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["type"] in ("error", "response.failed"):
                    return f"lost: responses {event['type']} {line[:100]}"
                final = event.get("response") or final
    if final is None or final["status"] not in ("completed", "incomplete"):
        return f"lost: responses ended {final and final['status']}"
    got = final["usage"]["output_tokens"]
    if final["status"] == "incomplete" and got != max_tokens or got > max_tokens:
        return f"lost: responses {final['status']} with {got}/{max_tokens} tokens"
    return "ok"


async def load(url: str, args: argparse.Namespace, until: float) -> tuple[Counter, Counter]:
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    losses: Counter = Counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                outcome = await asyncio.wait_for(one_request(client, url, kind, rng, args),
                                                 args.timeout)
            except asyncio.TimeoutError:
                outcome = f"lost: {kind} hung past {args.timeout:.0f} s"
            except (httpx.HTTPError, OSError) as e:
                outcome = f"lost: {kind} {type(e).__name__}: {e}"
            outcomes[(kind, outcome.split(":")[0])] += 1
            if outcome.startswith("lost"):
                losses[outcome[:160]] += 1

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    return outcomes, losses


def main(argv=None) -> int:
    args, serve_args = parse_args(argv)
    stack = Stack(serve_args, name="soak")
    try:
        stack.wait_ready()
        started = time.monotonic()
        end = started + args.duration
        task_result = {}

        def reading_at_warmup():
            time.sleep(min(args.warmup, args.duration / 2))
            task_result["start"] = stack.resources()

        import threading

        reader = threading.Thread(target=reading_at_warmup)
        reader.start()
        outcomes, losses = asyncio.run(load(stack.url, args, end))
        reader.join()
        wall = time.monotonic() - started
        # Everything given back once the load stops (engine stats arrive by heartbeat).
        settle_deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{stack.url}/metrics", timeout=10).text
            left = held(text)
            if not any(left.values()) or time.monotonic() > settle_deadline:
                break
            time.sleep(0.5)
        end_resources = stack.resources()
        alive = stack.proc.poll() is None
        restarts = Path(stack.log.name).read_text(errors="replace").count("roseserve: restarting")
    finally:
        code = stack.stop()
    cpu = cpu_model()
    total = sum(outcomes.values())
    lost = sum(losses.values())
    report = {
        "cpu": cpu, "duration_s": round(wall, 1), "concurrency": args.concurrency,
        "serve_args": serve_args, "requests": total,
        "outcomes": {f"{k} {o}": v for (k, o), v in sorted(outcomes.items())},
        "lost": lost, "losses": dict(losses), "held_after": left,
        "resources_start": task_result.get("start", {}), "resources_end": end_resources,
        "stack_alive_at_end": alive, "component_restarts": restarts, "serve_exit_code": code,
    }
    print(f"soak: {total} requests in {wall:.0f} s at concurrency {args.concurrency} "
          f"({total / wall:.1f}/s) on {cpu}")
    for (kind, outcome), count in sorted(outcomes.items()):
        print(f"  {kind:<14} {outcome:<10} {count}")
    print(f"requests lost: {lost}")
    for why, count in losses.most_common(10):
        print(f"  {count} x {why}")
    print("held once idle: " + ", ".join(f"{k}={v:g}" for k, v in left.items()))
    print(f"{'process':<20} {'RSS MB start':>12} {'RSS MB end':>11} {'fds start':>10} "
          f"{'fds end':>8}")
    start_res = report["resources_start"]
    for name, end_r in end_resources.items():
        s = start_res.get(name, {})
        print(f"{name:<20} {s.get('rss_mb', '-'):>12} {end_r['rss_mb']:>11} "
              f"{s.get('fds', '-'):>10} {end_r['fds']:>8}")
    print(f"component restarts: {restarts}; serve exit code {code}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if lost == 0 and not any(left.values()) and alive else 1


if __name__ == "__main__":
    sys.exit(main())
