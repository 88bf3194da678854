"""Multi-turn conversations against a KV pool too small for them: the tiers below the
pool off, then on; then two engines behind round-robin routing sharing a KV store,
through a rolling restart of both.

    python benchmarks/multiturn.py --json docs/bench/multiturn.json
    python benchmarks/multiturn.py --conversations 8 -- --model DIR --device cpu   # after --:
                                                                                    # serve's flags

Each conversation starts with its own prompt (``--first-len`` tokens) and each later
turn sends the previous prompt, the reply (``--max-new-tokens``, greedy) and a new
message (``--message-len`` tokens on average, lengths from ``--seed``): the growing
prefix agents and chat clients resend. Turns go round: every conversation's first
turn, then every second turn, ``--concurrency`` requests at a time, so that between a
conversation's turns the others pass through the pool (``--conversations`` of them
hold more than it does). Each configuration is a fresh ``roseserve serve`` (cold
caches):

  * "pool only": one engine, a pool of ``--pool-gb``;
  * "host tier": the same and a host-memory tier (``--kv-offload-memory``);
  * "1 engine, 2x pool": one engine with the two engines' pool;
  * "store, 2 engines": two engines of ``--pool-gb`` each, ``--routing round-robin``
    (each turn of a conversation likely on the other engine) and ``--kv-store``; after
    its turns both engines are restarted one at a time (SIGHUP) and every conversation
    takes one more turn.

Prints per configuration TTFT p50/p90 of the first turns and of the later ones, output
tokens/s and the prefix-cache hit rate (prompt tokens served from a cache / prompt
tokens, from each response's usage); then the targets' ratios: later turns' TTFT p50
without the host tier over with it (>= 3) and tokens/s with it over without (>= 1);
the store's hit rate over one engine's with the same total pool (>= 0.9); the hit
rate of the turn after the rolling restart over the last turn's before it (>= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stack import Stack, cpu_model, metric, scrape  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=384)
    p.add_argument("--message-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pool-gb", type=float, default=0.1,
                   help="each engine's KV pool (--kv-cache-memory-gb)")
    p.add_argument("--offload-gb", type=float, default=2.0,
                   help="the host tier of the second configuration")
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids drawn below it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:cut]), argv[cut + 1:]


def messages(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each conversation's messages, turn by turn (the first one its opening prompt)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.conversations):
        turns = [[rng.randrange(args.vocab) for _ in range(args.first_len)]]
        for _ in range(args.turns - 1):
            n = rng.randint(args.message_len // 2, args.message_len * 3 // 2)
            turns.append([rng.randrange(args.vocab) for _ in range(n)])
        out.append(turns)
    return out


async def turn(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
               ) -> tuple[float, list[int], int]:
    """(TTFT in seconds, the reply's token ids, prompt tokens served from a cache) of one
    streamed completion."""
    start = time.perf_counter()
    ttft, reply, cached = None, [], None
    body = {"model": "multiturn", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"stream error: {event['error']}")
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in event["choices"]:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - start
                reply += ids
    assert ttft is not None and len(reply) == max_tokens and cached is not None, \
        (ttft, len(reply), cached)
    return ttft, reply, cached


class Conversations:
    """Every conversation's turns so far, and what each turn measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.messages = messages(args)
        self.history: list[list[int]] = [[] for _ in self.messages]
        self.replies: list[list[list[int]]] = [[] for _ in self.messages]
        # per turn: TTFTs (s), prompt tokens, of those served from a cache
        self.ttfts: list[list[float]] = []
        self.prompt_tokens: list[int] = []
        self.cached_tokens: list[int] = []
        self.wall_s = 0.0

    async def round(self, url: str, message: Optional[list[list[int]]] = None) -> None:
        """One turn of every conversation, ``--concurrency`` at a time (the next
        message of each, or ``message[c]``)."""
        t = len(self.ttfts)
        self.ttfts.append([])
        self.prompt_tokens.append(0)
        self.cached_tokens.append(0)
        gate = asyncio.Semaphore(self.args.concurrency)
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(c: int) -> None:
                async with gate:
                    new = message[c] if message is not None else self.messages[c][t]
                    prompt = self.history[c] + new
                    ttft, reply, cached = await turn(client, url, prompt,
                                                     self.args.max_new_tokens)
                    self.history[c] = prompt + reply
                    self.replies[c].append(reply)
                    self.ttfts[t].append(ttft)
                    self.prompt_tokens[t] += len(prompt)
                    self.cached_tokens[t] += cached
            await asyncio.gather(*(one(c) for c in range(len(self.messages))))
        self.wall_s += time.perf_counter() - start

    def hit_rate(self, turns: slice) -> float:
        return sum(self.cached_tokens[turns]) / max(1, sum(self.prompt_tokens[turns]))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def run(name: str, serve_args: list[str], args: argparse.Namespace,
        restart: bool = False) -> dict:
    stack = Stack(serve_args, name="multiturn")
    convs = Conversations(args)
    try:
        stack.wait_ready()
        for _ in range(args.turns):
            asyncio.run(convs.round(stack.url))
        wall_s = convs.wall_s
        if restart:   # both engines, one at a time; then one more turn each
            stack.rolling_restart()
            rng = random.Random(args.seed + 1)
            asyncio.run(convs.round(stack.url, [
                [rng.randrange(args.vocab) for _ in range(args.message_len)]
                for _ in convs.messages]))
        time.sleep(1.5)   # the engines' figures, as of their next heartbeat
        text = scrape(stack.url)
    finally:
        stack.stop()
    first = convs.ttfts[0]
    later = [x for t in convs.ttfts[1:args.turns] for x in t]
    result = {
        "config": name, "serve_args": serve_args,
        "first_turn_ttft_ms": {"p50": pct(first, 50) * 1e3, "p90": pct(first, 90) * 1e3},
        "later_turns_ttft_ms": {"p50": pct(later, 50) * 1e3, "p90": pct(later, 90) * 1e3},
        "output_tokens_per_s": args.max_new_tokens * args.turns * args.conversations / wall_s,
        "prefix_cache_hit_rate": convs.hit_rate(slice(0, args.turns)),
        "hit_rate_by_turn": [convs.hit_rate(slice(t, t + 1)) for t in range(len(convs.ttfts))],
        "blocks_copied_back": {tier: metric(text, "roseserve_kv_offload_loaded_blocks_total",
                                            tier=tier) for tier in ("host", "disk")},
        "store_hits": metric(text, "roseserve_kv_store_hits_total"),
        "store_misses": metric(text, "roseserve_kv_store_misses_total"),
        "store_errors": metric(text, "roseserve_kv_store_errors_total"),
        "replies": [r[:args.turns] for r in convs.replies]}
    if restart:
        result["after_restart_hit_rate"] = result["hit_rate_by_turn"][args.turns]
    return result


def main(argv=None) -> int:
    args, serve_args = parse_args(argv)
    pool = ["--kv-cache-memory-gb", str(args.pool_gb)]
    configs = [
        ("pool only", [*serve_args, "--engines", "1", *pool], False),
        ("host tier", [*serve_args, "--engines", "1", *pool,
                       "--kv-offload-memory-gb", str(args.offload_gb)], False),
        ("1 engine, 2x pool", [*serve_args, "--engines", "1",
                               "--kv-cache-memory-gb", str(2 * args.pool_gb)], False),
        ("store, 2 engines", [*serve_args, "--engines", "2", *pool, "--routing",
                              "round-robin", "--kv-store", "--kv-store-memory",
                              str(args.offload_gb)], True)]
    results = [run(name, config, args, restart) for name, config, restart in configs]
    off, on, one, store = results
    # Where KV comes from changes, never what it holds: the same replies everywhere.
    same = all(r["replies"] == off["replies"] for r in results)
    report = {
        "cpu": cpu_model(), "args": vars(args), "serve_args": serve_args,
        "results": [{k: v for k, v in r.items() if k != "replies"} for r in results],
        "later_ttft_p50_ratio": off["later_turns_ttft_ms"]["p50"]
        / on["later_turns_ttft_ms"]["p50"],
        "tokens_per_s_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        # (None where one engine found nothing: any store rate is above it)
        "store_vs_one_engine_hit_rate": store["prefix_cache_hit_rate"]
        / one["prefix_cache_hit_rate"] if one["prefix_cache_hit_rate"] else None,
        "after_restart_vs_before": store["after_restart_hit_rate"]
        / max(1e-9, store["hit_rate_by_turn"][args.turns - 1]),
        "same_replies": same}
    print(f"=== multiturn: {args.conversations} conversations x {args.turns} turns, "
          f"concurrency {args.concurrency}, on {report['cpu']}")
    for r in report["results"]:
        print(f"{r['config']:>18}: TTFT p50/p90 first turn {r['first_turn_ttft_ms']['p50']:.0f}/"
              f"{r['first_turn_ttft_ms']['p90']:.0f} ms, later turns "
              f"{r['later_turns_ttft_ms']['p50']:.0f}/{r['later_turns_ttft_ms']['p90']:.0f} ms; "
              f"{r['output_tokens_per_s']:.1f} tok/s; hit rate {r['prefix_cache_hit_rate']:.2f} "
              f"(by turn {', '.join(f'{h:.2f}' for h in r['hit_rate_by_turn'])}); blocks "
              f"copied back {r['blocks_copied_back']}, from the store {r['store_hits']:.0f}")
    print(f"later turns' TTFT p50, pool only / host tier: {report['later_ttft_p50_ratio']:.2f} "
          f"(target >= 3); tokens/s, host tier / pool only: {report['tokens_per_s_ratio']:.2f} "
          f"(>= 1)")
    ratio = report["store_vs_one_engine_hit_rate"]
    print(f"hit rate, store with 2 engines / 1 engine with their pool: "
          f"{store['prefix_cache_hit_rate']:.2f} / {one['prefix_cache_hit_rate']:.2f}"
          f"{f' = {ratio:.2f}' if ratio is not None else ''} (>= 0.9); the turn after a rolling "
          f"restart / the turn before: {report['after_restart_vs_before']:.2f} (>= 0.8); "
          f"replies identical: {same}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
