"""The seeds' streaming benchmark, over real HTTP, against a running roseserve.

    python benchmarks/stream.py                                # 64 x "Hello" x 128 tokens
    python benchmarks/stream.py --pretok --unique-prompts --prompt-repeats 256 \\
        --num-requests 256 --max-new-tokens 1 --json a.json
    python benchmarks/stream.py --dataset shared-prefix --input-len 512 \\
        --shared-prefix-len 448 --request-rate 8 --max-concurrency 32 --plot run.png

Every request is a streaming completion (SSE, return_token_ids, usage). The report
has the seeds' lines: Submit wall (first submission until the server has accepted
every request), add_request latency
(sending a request until its response headers arrive), the server's own breakdown
(Tokenize, Queue wait, Prefill->first token), TTFT, TPOT, ITL, Latency, Throughput,
and every failed request with its error. benchmarks/compare.py puts two --json
reports side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.stream_stats import (arrival_offsets, itls, p50_95_99,  # noqa: E402
                                     tokens_per_second_over_time, tpot)

Prompt = Union[str, list[int]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", dest="urls",
                   help="the server (default http://127.0.0.1:8000); repeated: several "
                        "frontends of one cluster, sent requests in turn (a round-robin "
                        "balancer)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None,
                   help="model name to send (default: the server's only model)")
    p.add_argument("--tokenizer", default=None,
                   help="model directory whose tokenizer --pretok uses (default: the "
                        "default model)")
    p.add_argument("--dataset", choices=["fixed", "random", "shared-prefix"], default="fixed")
    p.add_argument("--prompt", default="Hello", help="fixed dataset: the prompt text")
    p.add_argument("--prompt-repeats", type=int, default=1,
                   help="fixed dataset: the prompt is --prompt repeated this many times")
    p.add_argument("--unique-prompts", action="store_true",
                   help="fixed dataset: append a different suffix to every prompt's text")
    p.add_argument("--pretok", action="store_true",
                   help="tokenize on the client and send token-id prompts")
    p.add_argument("--pretok-base-token-ids", action="store_true",
                   help="with --pretok --unique-prompts: tokenize the prompt before its "
                        "suffix, so texts differ and token ids do not")
    p.add_argument("--input-len", type=int, default=128,
                   help="random/shared-prefix datasets: prompt tokens")
    p.add_argument("--shared-prefix-len", type=int, default=64,
                   help="shared-prefix dataset: leading tokens common to all prompts")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix dataset: distinct shared prefixes (each prompt "
                        "starts with one of them, drawn at random)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", "--output-len", dest="max_new_tokens", type=int,
                   default=128)
    p.add_argument("--no-stop-on-eos", action="store_true",
                   help="ignore_eos: every request generates exactly --max-new-tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--truncate-prompt-tokens", type=int, default=None,
                   help="the server keeps only the last N prompt tokens (measures "
                        "tokenization of long text without its prefill)")
    p.add_argument("--submit-interval-ms", type=float, default=0.0,
                   help="pause between submissions (without --request-rate)")
    p.add_argument("--submit-schedule", choices=["relative", "absolute"], default="relative",
                   help="relative: sleep the interval after each submission; absolute: "
                        "submit request i at start + i x interval")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (overrides the interval)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight; the wait is reported as "
                        "client queue wait, not in TTFT")
    p.add_argument("--warmup-runs", type=int, default=1)
    p.add_argument("--repeat-runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--json", dest="json_path", default=None,
                   help="write the summary and every per-request record here")
    p.add_argument("--plot", default=None, help="write a PNG: TTFT and ITL distributions, "
                                                 "output tokens/s over time")
    p.add_argument("--label", default=None, help="a name for this run in reports")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.urls = args.urls or ["http://127.0.0.1:8000"]
    args.url = args.urls[0]
    return args


# -- workload ------------------------------------------------------------------------


def load_tokenizer(path: Optional[str]):
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(path)))


def build_prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[Prompt], bool]:
    """The prompts, and whether they are token ids."""
    rng = random.Random(args.seed)
    n = args.num_requests
    if args.dataset == "random":
        return [[rng.randrange(100, vocab_size) for _ in range(args.input_len)]
                for _ in range(n)], True
    if args.dataset == "shared-prefix":
        prefixes = [[rng.randrange(100, vocab_size) for _ in range(args.shared_prefix_len)]
                    for _ in range(args.num_prefixes)]
        tail = max(0, args.input_len - args.shared_prefix_len)
        return [rng.choice(prefixes) + [rng.randrange(100, vocab_size) for _ in range(tail)]
                for _ in range(n)], True
    base = args.prompt * args.prompt_repeats
    texts = [f"{base} [request {i}]" if args.unique_prompts else base for i in range(n)]
    if not args.pretok:
        return texts, False
    tok = load_tokenizer(args.tokenizer)
    sources = [base] * n if args.pretok_base_token_ids else texts
    cache: dict[str, list[int]] = {}
    ids = [cache.setdefault(s, tok.encode(s, add_special_tokens=False)) for s in sources]
    return ids, True


# -- one request ---------------------------------------------------------------------


@dataclass
class Record:
    index: int
    prompt_tokens: int = 0
    # Of the prompt tokens, those served from the prefix cache (usage, when reported).
    cached_tokens: int = 0
    completion_tokens: int = 0
    submitted_s: float = 0.0  # when it was submitted, from the run's start
    sent_s: float = 0.0  # when it left the client (after any client-side queue)
    client_queue_ms: float = 0.0
    add_request_ms: Optional[float] = None
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    latency_ms: Optional[float] = None
    itl_ms: list[float] = field(default_factory=list)
    # Arrival times (from the run's start) and token counts of token-carrying chunks.
    token_times_s: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    server_timing: dict = field(default_factory=dict)
    finish_reason: Optional[str] = None
    error: Optional[str] = None


async def run_request(client: httpx.AsyncClient, url: str, body: dict, record: Record,
                      t0: float, headers: dict) -> None:
    sent = time.perf_counter()
    record.sent_s = sent - t0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            record.add_request_ms = (time.perf_counter() - sent) * 1e3
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            times: list[float] = []
            reported = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    record.error = chunk["error"].get("message", str(chunk["error"]))
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens = usage["prompt_tokens"]
                    reported = usage.get("completion_tokens")
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
                if chunk.get("timing"):
                    record.server_timing = chunk["timing"]
                for choice in chunk.get("choices", []):
                    # Token ids when the server sends them (roseserve, vLLM); else a
                    # chunk with text is one token (llama.cpp streams one per chunk),
                    # and the usage chunk, when there is one, corrects the total.
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))
                    if n:
                        times.append(now)
                        record.token_times_s.append(now - t0)
                        record.token_counts.append(n)
                        record.completion_tokens += n
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return
    if reported is not None:
        record.completion_tokens = reported
    if times:
        record.ttft_ms = (times[0] - sent) * 1e3
        record.latency_ms = (times[-1] - sent) * 1e3
        record.itl_ms = [x * 1e3 for x in itls(times)]
        value = tpot(times, record.completion_tokens)
        record.tpot_ms = None if value is None else value * 1e3
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a finish reason"


# -- one run -------------------------------------------------------------------------


async def run_once(args: argparse.Namespace, prompts: list[Prompt], model: str,
                   progress_label: Optional[str]) -> dict:
    urls = [u.rstrip("/") + "/v1/completions" for u in args.urls]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed,
                              args.submit_interval_ms / 1e3)
    records = [Record(index=i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=args.max_concurrency or len(prompts) + 8,
                          max_keepalive_connections=args.max_concurrency or len(prompts) + 8)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if progress_label and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc=progress_label, file=sys.stderr, leave=False)

    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()
        submit_times: list[float] = []

        async def one(i: int) -> None:
            due = time.perf_counter()
            if semaphore is not None:
                async with semaphore:
                    records[i].client_queue_ms = (time.perf_counter() - due) * 1e3
                    await run_request(client, urls[i % len(urls)], body(i), records[i], t0,
                                      headers)
            else:
                await run_request(client, urls[i % len(urls)], body(i), records[i], t0, headers)
            if bar is not None:
                bar.update(1)

        def body(i: int) -> dict:
            out = {"model": model, "prompt": prompts[i], "max_tokens": args.max_new_tokens,
                   "temperature": args.temperature, "stream": True,
                   "stream_options": {"include_usage": True}}
            if args.no_stop_on_eos:
                out["ignore_eos"] = True  # vLLM's and llama.cpp's extension too
            if getattr(args, "roseserve", True):
                out["return_token_ids"] = True
            if args.truncate_prompt_tokens is not None:
                out["truncate_prompt_tokens"] = args.truncate_prompt_tokens
            return out

        tasks = []
        relative = args.request_rate is None and args.submit_schedule == "relative"
        for i in range(len(prompts)):
            if relative:
                if i and args.submit_interval_ms:
                    await asyncio.sleep(args.submit_interval_ms / 1e3)
            else:
                delay = t0 + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            submit_times.append(time.perf_counter() - t0)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for record, submitted in zip(records, submit_times):
        record.submitted_s = submitted
    # Submit wall: from the first submission until the server has accepted every
    # request (its response headers arrived): how long it takes to push the whole
    # workload into the system, which the seeds' blocking add_request loop measured.
    accepted = [r.sent_s + r.add_request_ms / 1e3 for r in records if r.add_request_ms is not None]
    submit_wall = max(accepted) - min(submit_times) if accepted else 0.0
    return summarize(args, records, wall, submit_wall, model)


def summarize(args: argparse.Namespace, records: list[Record], wall: float, submit_wall: float,
              model: str) -> dict:
    ok = [r for r in records if r.error is None]

    def dist(values) -> list[Optional[float]]:
        return list(p50_95_99([v for v in values if v is not None]))

    server = {key: dist(r.server_timing.get(key) for r in ok)
              for key in ("tokenize_ms", "queue_ms", "prefill_ms", "ttft_ms")}
    completion = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    engines: dict[str, int] = {}
    for r in ok:
        address = r.server_timing.get("engine")
        if address:
            engines[address] = engines.get(address, 0) + 1
    return {
        "label": args.label, "model": model, "url": " ".join(args.urls), "pretok": bool(args.pretok or
                                                                              args.dataset != "fixed"),
        "dataset": args.dataset, "num_requests": len(records), "num_failed": len(records) - len(ok),
        "max_new_tokens": args.max_new_tokens, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "submit_interval_ms": args.submit_interval_ms,
        "submit_schedule": args.submit_schedule, "max_concurrency": args.max_concurrency,
        "prompt_tokens": prompt, "completion_tokens": completion,
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "engines": dict(sorted(engines.items())),
        "wall_s": wall, "submit_wall_s": submit_wall,
        "add_request_ms": dist(r.add_request_ms for r in ok),
        "client_queue_ms": dist(r.client_queue_ms for r in ok),
        "tokenize_ms": server["tokenize_ms"], "queue_ms": server["queue_ms"],
        "prefill_ms": server["prefill_ms"], "server_ttft_ms": server["ttft_ms"],
        "ttft_ms": dist(r.ttft_ms for r in ok), "tpot_ms": dist(r.tpot_ms for r in ok),
        "itl_ms": dist(x for r in ok for x in r.itl_ms),
        "latency_ms": dist(r.latency_ms for r in ok),
        "throughput_completion": completion / wall if wall else 0.0,
        "throughput_total": (completion + prompt) / wall if wall else 0.0,
        "failures": [{"index": r.index, "error": r.error} for r in records if r.error],
        "requests": [asdict(r) for r in records],
    }


# -- report --------------------------------------------------------------------------


def fmt3(values: list[Optional[float]], unit: str = "ms") -> str:
    if not values or values[0] is None:
        return "n/a"
    return "/".join(f"{v:.2f}" for v in values) + f" {unit}"


def report_lines(s: dict) -> list[str]:
    lines = [f"Model: {s['model']}", f"URL: {s['url']}", f"Pretok: {s['pretok']}",
             f"Dataset: {s['dataset']}",
             f"Requests: {s['num_requests']} (failed: {s['num_failed']})",
             f"Prompt tokens (total): {s['prompt_tokens']}",
             f"Completion tokens (total): {s['completion_tokens']}",
             f"Prefix cache hit rate: {s.get('prefix_cache_hit_rate', 0.0):.3f} (prompt "
             f"tokens served from the cache)"]
    if s.get("engines"):
        lines.append("Requests per engine: " + ", ".join(
            f"{address} {count}" for address, count in s["engines"].items()))
    lines.append(f"Submit wall: {s['submit_wall_s']:.6f} s")
    if s["request_rate"] is not None:
        lines.append(f"Request rate: {s['request_rate']:.2f} req/s (burstiness "
                     f"{s['burstiness']:.2f})")
    elif s["submit_interval_ms"]:
        lines.append(f"Submit interval/schedule: {s['submit_interval_ms']:.3f} ms / "
                     f"{s['submit_schedule']}")
    lines.append(f"add_request latency p50/p95/p99: {fmt3(s['add_request_ms'])}")
    if s["max_concurrency"]:
        lines.append(f"Client queue wait (max concurrency {s['max_concurrency']}) "
                     f"p50/p95/p99: {fmt3(s['client_queue_ms'])}")
    lines += [f"Tokenize p50/p95/p99: {fmt3(s['tokenize_ms'])}",
              f"Queue wait p50/p95/p99: {fmt3(s['queue_ms'])}",
              f"Prefill->first token p50/p95/p99: {fmt3(s['prefill_ms'])}",
              f"TTFT p50/p95/p99: {fmt3(s['ttft_ms'])}",
              f"TPOT p50/p95/p99: {fmt3(s['tpot_ms'], 'ms/token')}",
              f"ITL p50/p95/p99: {fmt3(s['itl_ms'])}",
              f"Latency p50/p95/p99: {fmt3(s['latency_ms'])}",
              f"Throughput (completion,total): {s['throughput_completion']:.2f} / "
              f"{s['throughput_total']:.2f} tokens/s"]
    if s["failures"]:
        lines.append(f"Failed requests ({len(s['failures'])}):")
        errors: dict[str, list[int]] = {}
        for f in s["failures"]:
            errors.setdefault(f["error"], []).append(f["index"])
        for error, indices in errors.items():
            lines.append(f"  {len(indices)} x {error} (requests {indices[:10]}"
                         f"{'...' if len(indices) > 10 else ''})")
    return lines


def median_summary(runs: list[dict]) -> dict:
    """The runs' summary with every p50/p95/p99 triple and scalar replaced by its
    median across runs (requests and failures of all runs are kept)."""
    out = dict(runs[-1])
    for key, value in runs[0].items():
        if isinstance(value, list) and len(value) == 3 and all(
                isinstance(v, (int, float)) or v is None for v in value):
            out[key] = [statistics.median([r[key][i] for r in runs if r[key][i] is not None])
                        if any(r[key][i] is not None for r in runs) else None for i in range(3)]
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    out["failures"] = [f for r in runs for f in r["failures"]]
    out["num_failed"] = len(out["failures"])
    return out


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in summary["requests"] if r["error"] is None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None], bins=40)
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[1].hist([x for r in reqs for x in r["itl_ms"]], bins=60)
    axes[1].set(title="ITL", xlabel="ms", ylabel="intervals")
    times = [t for r in reqs for t in r["token_times_s"]]
    counts = [n for r in reqs for n in r["token_counts"]]
    starts, rates = tokens_per_second_over_time(times, counts,
                                                bin_s=max(0.01, summary["wall_s"] / 50))
    axes[2].step(starts, rates, where="post")
    axes[2].set(title="Output tokens/s over time", xlabel="s since start", ylabel="tokens/s")
    fig.suptitle(f"{summary['model']}: {summary['num_requests']} requests"
                 + (f" ({summary['label']})" if summary.get("label") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def server_model(args: argparse.Namespace) -> tuple[str, bool]:
    """The server's (first) model, and whether the server is roseserve (then requests
    also ask for its extensions; any OpenAI-compatible server works without them)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    response = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    first = response.json()["data"][0]
    return first["id"], first.get("owned_by") == "roseserve"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model, args.roseserve = server_model(args)
        model = args.model or model
    except httpx.HTTPError as e:
        print(f"cannot reach {args.url}: {e}", file=sys.stderr)
        return 2
    vocab = 50000
    if args.dataset != "fixed":
        vocab = len(load_tokenizer(args.tokenizer))
    prompts, _ = build_prompts(args, vocab)
    for i in range(args.warmup_runs):
        print(f"=== warmup {i + 1}/{args.warmup_runs} ===", flush=True)
        asyncio.run(run_once(args, prompts, model, "warmup"))
    runs = []
    for i in range(args.repeat_runs):
        summary = asyncio.run(run_once(args, prompts, model, f"run {i + 1}"))
        runs.append(summary)
        title = "=== streaming benchmark ===" if args.repeat_runs == 1 else (
            f"=== streaming benchmark: run {i + 1}/{args.repeat_runs} ===")
        print("\n".join([title, *report_lines(summary)]), flush=True)
    final = runs[0] if len(runs) == 1 else median_summary(runs)
    if len(runs) > 1:
        print("\n".join([f"=== median of {len(runs)} runs ===", *report_lines(final)]))
    final["runs"] = [{k: v for k, v in r.items() if k != "requests"} for r in runs]
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(final, separators=(",", ":")))
        print(f"wrote {args.json_path}")
    if args.plot:
        plot(final, args.plot)
        print(f"wrote {args.plot}")
    return 0 if final["num_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
