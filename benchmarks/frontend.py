"""What the HTTP frontend costs: HTTP / in-process throughput, and the frontend's CPU
per output token, at 1 and 64 streams, for float32 and int8 weights, in one run.

    python benchmarks/frontend.py --json docs/bench/frontend.json
    python benchmarks/frontend.py --formats int8 --concurrency 1 --repeats 5

For each weight format it starts ``roseserve serve`` and an in-process engine on the
same model and flags, and for each concurrency alternates the two (``--repeats``
rounds): the in-process engine runs the workload (random token-id prompts, every
request forced to --output-len tokens), then the same workload goes over HTTP
(streaming completions with token-id prompts, so tokenization is not measured). It
prints the median of each ratio, HTTP tokens/s / in-process tokens/s, and the
frontend process's CPU time (all its threads, from the scheduler's counters) per
output token, which is what the frontend spends on each token whatever the machine's
other load, and beside it the client's own CPU per token (it shares the machine's
cores with the server: see over_http).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import uvloop  # noqa: E402

from benchmarks.engine import random_prompts, run_engine  # noqa: E402
from benchmarks.stack import Stack, cpu_model  # noqa: E402
from common.config import EngineConfig  # noqa: E402

FORMAT_FLAGS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"],
                "int8": ["--quantization", "int8"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    p.add_argument("--formats", default="float32,int8")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve-flag", action="append", default=[],
                   help="an extra flag for roseserve serve (repeatable)")
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def in_process(engine, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of the in-process engine on the workload (a cold prefix cache)."""
    engine.block_manager.reset_prefix_cache()
    return run_engine(engine, prompts, output_len)["tokens_per_s"]


async def stream_completion(host: str, port: int, body: bytes) -> int:
    """One streamed completion over its own HTTP/1.1 connection: the response's chunks
    are read as they come and only the usage event is parsed. Returns its
    completion_tokens (0 if the stream carried none)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (host.encode(), port, len(body), body))
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if status.split()[1:2] != [b"200"] or b"transfer-encoding: chunked" not in headers:
            raise RuntimeError(f"unexpected response: {status!r} {headers!r}")
        tokens = 0
        while size := int((await reader.readline()).split(b";")[0], 16):
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if b'"completion_tokens"' in data:
                for event in data.split(b"\n\n"):
                    if event.startswith(b"data: {") and b'"completion_tokens"' in event:
                        tokens = json.loads(event[6:])["usage"]["completion_tokens"]
        return tokens
    finally:
        writer.close()


async def over_http(url: str, model: str, prompts: list[list[int]], output_len: int
                    ) -> tuple[float, int]:
    """Output tokens/s over HTTP (every prompt a streaming request, all at once) and
    the output tokens the server reported. On 2 cores the client shares the CPU with
    the server, so it does little: one connection per request, the chunks read as
    they come, only the usage event parsed, on uvloop (run_http). Its
    CPU per token is measured and printed beside the frontend's: aiohttp, which an
    earlier version used, cost 0.15-0.24 ms a token at one stream (as much as the
    frontend), httpx 0.64."""
    parts = urlsplit(url)

    async def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
        return await stream_completion(parts.hostname, parts.port, json.dumps(body).encode())

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(p) for p in prompts]))
    elapsed = time.perf_counter() - start
    if tokens != len(prompts) * output_len:  # every request is forced to output_len
        raise RuntimeError(f"the server reported {tokens} output tokens for "
                           f"{len(prompts)} requests of {output_len}")
    return tokens / elapsed, tokens


def run_http(url: str, model: str, prompts: list[list[int]], output_len: int
             ) -> tuple[float, int, float]:
    """over_http on uvloop: tokens/s, tokens, and the client's CPU seconds per token."""
    before = time.thread_time()
    rate, tokens = uvloop.run(over_http(url, model, prompts, output_len))
    return rate, tokens, (time.thread_time() - before) / tokens


def cpu_seconds(process: psutil.Process) -> float:
    """The process's CPU time, all threads. From the scheduler's nanosecond counters
    (/proc/PID/task/*/schedstat) where Linux has them: user + system time counts in
    10 ms ticks, which at one stream is 0.08 ms per token of 128."""
    tasks = Path(f"/proc/{process.pid}/task")
    try:
        return sum(int((t / "schedstat").read_text().split()[0])
                   for t in tasks.iterdir()) / 1e9
    except OSError:  # no schedstat (or a thread ended while read): ticks
        times = process.cpu_times()
        return times.user + times.system


def measure_format(fmt: str, args, concurrencies: list[int]) -> dict:
    from common.model_files import resolve_model_dir
    from engine_worker.engine import LLMEngine
    from engine_worker.models.registry import load_model_config

    model = str(resolve_model_dir(args.model))
    flags = ["--model", model, "--device", "cpu", "--threads", str(args.threads),
             "--max-batch-size", str(max(concurrencies)), *FORMAT_FLAGS[fmt],
             *args.serve_flag]
    stack = Stack(flags, name="frontend-bench")
    stack.wait_ready()
    try:
        frontend = psutil.Process(stack.resources()["frontend"]["pid"])
        vocab = load_model_config(Path(model)).vocab_size
        engine = LLMEngine(EngineConfig(
            model=model, device="cpu", num_threads=args.threads,
            quantization="int8" if fmt == "int8" else None,
            dtype="bfloat16" if fmt == "bfloat16" else "auto"))
        warm = random_prompts(2, args.input_len, vocab, 0)
        in_process(engine, warm, 4)
        run_http(stack.url, "frontend-bench", warm, 4)
        rows = {}
        for c in concurrencies:
            ratios, cpu_per_token, client_cpu, local_rates, http_rates = [], [], [], [], []
            for r in range(args.repeats):
                prompts = random_prompts(c, args.input_len, vocab, 1000 * c + r)
                local = in_process(engine, prompts, args.output_len)
                before = cpu_seconds(frontend)
                remote, tokens, client = run_http(stack.url, "frontend-bench", prompts,
                                                  args.output_len)
                cpu_per_token.append((cpu_seconds(frontend) - before) / tokens)
                client_cpu.append(client)
                ratios.append(remote / local)
                local_rates.append(local)
                http_rates.append(remote)
                print(f"{fmt:8s} {c:3d} streams, round {r}: in-process {local:7.1f}, HTTP "
                      f"{remote:7.1f} tokens/s ({remote / local:.3f}); frontend CPU "
                      f"{1e3 * cpu_per_token[-1]:.3f} ms/token, client's {1e3 * client:.3f}",
                      flush=True)
            rows[str(c)] = {"http_over_in_process": statistics.median(ratios),
                            "frontend_cpu_ms_per_token": 1e3 * statistics.median(cpu_per_token),
                            "in_process_tokens_per_s": statistics.median(local_rates),
                            "http_tokens_per_s": statistics.median(http_rates),
                            "client_cpu_ms_per_token": 1e3 * statistics.median(client_cpu),
                            "ratios": ratios, "cpu_ms_per_token": [1e3 * x for x in cpu_per_token]}
        return rows
    finally:
        stack.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    report = {"cpu": cpu_model(), "model": args.model or "SmolLM2-135M-Instruct",
              "input_len": args.input_len, "output_len": args.output_len,
              "repeats": args.repeats, "formats": {}}
    for fmt in args.formats.split(","):
        report["formats"][fmt] = measure_format(fmt, args, concurrencies)
    print(f"\nCPU: {report['cpu']}; {args.input_len} prompt / {args.output_len} output "
          f"tokens; medians of {args.repeats} alternating rounds")
    print("weights  streams  HTTP / in-process  frontend CPU per token  client's")
    for fmt, rows in report["formats"].items():
        for c, row in rows.items():
            print(f"{fmt:8s} {c:>7s}  {row['http_over_in_process']:17.3f}  "
                  f"{row['frontend_cpu_ms_per_token']:18.3f} ms  "
                  f"{row['client_cpu_ms_per_token']:.3f} ms")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
