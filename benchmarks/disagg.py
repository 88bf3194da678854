"""Prefill/decode disaggregation against mixed engines: streams decoding while long
prompts keep arriving.

    python benchmarks/disagg.py --json docs/bench/disagg.json
    python benchmarks/disagg.py --long-len 64 -- --model DIR --device cpu   # after --:
                                                                            # serve's flags

Two ``roseserve serve`` stacks in turn, each started fresh, with the same threads in
all: one prefill and one decode engine (``--prefill-engines 1 --decode-engines 1``),
and two mixed engines (``--engines 2``), each engine ``cores / 2`` threads. The
workload: ``--num-streams`` streams with short prompts decode ``--stream-tokens``
tokens each; once they are all going, ``--num-long`` prompts of ``--long-len``
tokens arrive every ``--long-interval`` seconds, each asking for
``--long-tokens`` tokens. Prints, per stack: the decode streams' inter-token latency
p50/p99 (every gap between two tokens of a stream, over all streams) and the long
prompts' TTFT p50/p99; for P/D also the KV transfer: bytes and blocks the decode
engine pulled, transfer time per long prompt against the prefill engine's compute
time for it, and the loopback throughput.

The random token-id prompts are distinct from their first token, so no prefix cache
helps; every run is greedy with EOS ignored, so every request makes its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stack import Stack, cpu_model, metric, scrape  # noqa: E402
from benchmarks.stream import Record, run_request  # noqa: E402
from benchmarks.stream_stats import percentile  # noqa: E402

PD, MIXED = "1 prefill + 1 decode engine", "2 mixed engines"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-streams", type=int, default=4)
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=2.0)
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="prompt token ids are drawn below this (default: SmolLM2's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:cut]), argv[cut + 1:]


def prompts(n: int, length: int, rng: random.Random, vocab: int) -> list[list[int]]:
    # Ids from the low range every tokenizer of these models covers.
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


async def workload(url: str, args: argparse.Namespace, model: str, vocab: int) -> dict:
    rng = random.Random(args.seed)
    short = prompts(args.num_streams, args.stream_prompt_len, rng, vocab)
    long = prompts(args.num_long, args.long_len, rng, vocab)
    endpoint = f"{url}/v1/completions"

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}

    streams = [Record(i) for i in range(args.num_streams)]
    longs = [Record(i) for i in range(args.num_long)]
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:
        tasks = [asyncio.create_task(run_request(client, endpoint,
                                                 body(p, args.stream_tokens), r, t0, {}))
                 for p, r in zip(short, streams)]
        while sum(r.completion_tokens > 0 for r in streams) < len(streams):  # all decoding
            await asyncio.sleep(0.01)
        for p, r in zip(long, longs):
            tasks.append(asyncio.create_task(run_request(client, endpoint,
                                                         body(p, args.long_tokens), r, t0, {})))
            await asyncio.sleep(args.long_interval)
        await asyncio.gather(*tasks)
    errors = [r.error for r in streams + longs if r.error]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    itl = [x for r in streams for x in r.itl_ms]
    ttft = [r.ttft_ms for r in longs]
    return {"itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
            "long_ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "long_prefill_ms": [r.server_timing.get("prefill_ms") for r in longs],
            "long_kv_transfer_ms": [r.server_timing.get("kv_transfer_ms") for r in longs],
            "long_kv_outcome": [r.server_timing.get("kv_outcome") for r in longs],
            "stream_tokens": sum(r.completion_tokens for r in streams)}


def run_stack(name: str, serve_args: list[str], args: argparse.Namespace) -> dict:
    stack = Stack(serve_args, name="bench")
    try:
        stack.wait_ready()
        models = httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"]
        result = asyncio.run(workload(stack.url, args, models[0]["id"], args.vocab_size))
        time.sleep(3)  # the engines' figures arrive with their heartbeats
        text = scrape(stack.url)
        result["kv"] = {
            "bytes": metric(text, "roseserve_kv_transfer_bytes_total", direction="received"),
            "blocks": metric(text, "roseserve_kv_transfer_blocks_total", direction="received"),
            "seconds": metric(text, "roseserve_kv_transfer_seconds_total"),
            "fallbacks": metric(text, "roseserve_kv_transfer_fallbacks_total")}
    finally:
        stack.stop()
    result["config"] = name
    return result


def report(results: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"=== disagg: {args.num_streams} streams x {args.stream_tokens} tokens, "
             f"{args.num_long} prompts of {args.long_len} tokens every "
             f"{args.long_interval:g} s; {cpu_model()} ==="]
    for r in results:
        lines.append(f"{r['config']:>28}: stream ITL p50 {r['itl_ms']['p50']:.1f} ms, "
                     f"p99 {r['itl_ms']['p99']:.1f} ms; long prompts' TTFT p50 "
                     f"{r['long_ttft_ms']['p50']:.0f} ms, p99 {r['long_ttft_ms']['p99']:.0f} ms")
    pd = next(r for r in results if r["config"] == PD)
    kv = pd["kv"]
    if kv["seconds"] > 0:
        transfer = [t for t in pd["long_kv_transfer_ms"] if t is not None]
        prefill = [t for t in pd["long_prefill_ms"] if t is not None]
        lines.append(f"KV transfer (loopback TCP or ipc): {kv['bytes'] / 2**20:.1f} MiB in "
                     f"{kv['blocks']:.0f} blocks, {kv['bytes'] / 2**20 / kv['seconds']:.0f} MiB/s; "
                     f"per long prompt {statistics.median(transfer):.0f} ms against "
                     f"{statistics.median(prefill):.0f} ms to compute it (median); "
                     f"fallbacks {kv['fallbacks']:.0f}")
    mixed = next(r for r in results if r["config"] == MIXED)
    lines.append(f"P/D / mixed: ITL p99 {pd['itl_ms']['p99'] / mixed['itl_ms']['p99']:.2f}, "
                 f"long TTFT p50 {pd['long_ttft_ms']['p50'] / mixed['long_ttft_ms']['p50']:.2f}")
    return lines


def main(argv=None) -> int:
    args, serve_args = parse_args(argv)
    cores = os.cpu_count() or 2
    threads = ["--threads", str(max(1, cores // 2))]
    configs = [(PD, ["--prefill-engines", "1", "--decode-engines", "1",
                     "--disagg-min-prompt-tokens", str(min(256, args.long_len)), *threads]),
               (MIXED, ["--engines", "2", *threads])]
    results = [run_stack(name, flags + serve_args, args) for name, flags in configs]
    lines = report(results, args)
    print("\n".join(lines))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"cpu": cpu_model(), "args": vars(args), "serve_args": serve_args,
             "results": results, "report": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
