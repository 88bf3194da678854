"""The seed experiments on this architecture, each a before/after pair (or table).

    python benchmarks/experiments.py pretok prefix-key frames admission tokenizer-pool
    python benchmarks/experiments.py http-ratio

Every variant starts its own ``roseserve serve`` on the default model with the
variant's server flags (with ``--smoke``, one after another with the same flags share
one), runs benchmarks/stream.py against it (writing
docs/bench/<experiment>-<variant>.json), and stops it; then the variants are printed
side by side (benchmarks/compare.py). ``http-ratio`` alternates in-process engine runs
and HTTP runs of one workload and prints HTTP tokens/s as a ratio of in-process.

Server flags after ``--`` go to every server (and ``--model`` to the in-process engine
too); ``--smoke`` shrinks every workload to a few requests and tokens, and ``--out``
writes the JSON elsewhere (the CI smoke test runs them all on a tiny model that way).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.compare import compare  # noqa: E402

OUT = ROOT / "docs" / "bench"
# --smoke: the most any workload flag may ask for.
SMOKE_CAPS = {"--num-requests": 4, "--max-new-tokens": 4, "--prompt-repeats": 4}

# Seed 046/047: 256 unique prompts, one output token: the cost is all in submission.
SUBMIT = ["--prompt", "Hello", "--prompt-repeats", "32", "--unique-prompts", "--num-requests",
          "256", "--max-new-tokens", "1", "--no-stop-on-eos"]
EXPERIMENTS: dict[str, list[tuple[str, list[str], list[str]]]] = {
    # (variant, server flags, stream.py flags)
    "pretok": [
        ("text", [], SUBMIT),
        ("pretok", [], SUBMIT + ["--pretok"]),
    ],
    # Texts differ by a suffix; their token ids are the same (seed 048).
    "prefix-key": [
        ("prefix-cache-on", [], SUBMIT + ["--pretok", "--pretok-base-token-ids"]),
        ("prefix-cache-off", ["--no-prefix-cache"],
         SUBMIT + ["--pretok", "--pretok-base-token-ids"]),
    ],
    # Seed 052: 64 concurrent streams, submitted 20 ms apart.
    "frames": [
        ("per-step-frames", [], ["--prompt", "Hello", "--pretok", "--num-requests", "64",
                                 "--max-new-tokens", "128", "--no-stop-on-eos",
                                 "--submit-interval-ms", "20", "--submit-schedule", "absolute"]),
        ("per-token-frames", ["--per-token-output-frames"],
         ["--prompt", "Hello", "--pretok", "--num-requests", "64", "--max-new-tokens", "128",
          "--no-stop-on-eos", "--submit-interval-ms", "20", "--submit-schedule", "absolute"]),
    ],
    # Seed 030: decode batch 8; prefill admission 8 vs 32.
    "admission": [
        ("prefill-8", ["--max-batch-size", "8", "--prefill-max-batch-size", "8"],
         ["--prompt", "Hello", "--unique-prompts", "--num-requests", "32",
          "--max-new-tokens", "8", "--no-stop-on-eos"]),
        ("prefill-32", ["--max-batch-size", "8", "--prefill-max-batch-size", "32"],
         ["--prompt", "Hello", "--unique-prompts", "--num-requests", "32",
          "--max-new-tokens", "8", "--no-stop-on-eos"]),
    ],
    # Long texts (~9,000 characters); the engine keeps only their last 16 tokens, so
    # what is measured is tokenization.
    "tokenizer-pool": [
        (f"workers-{n}", ["--tokenizer-workers", str(n)],
         ["--prompt", "The quick brown fox jumps over the lazy dog. ", "--prompt-repeats", "200",
          "--unique-prompts", "--num-requests", "128", "--max-new-tokens", "1",
          "--truncate-prompt-tokens", "16", "--no-stop-on-eos"])
        for n in (1, 2, 4)
    ],
}


def smoke(args: list[str]) -> list[str]:
    """stream.py flags with every workload size capped (SMOKE_CAPS)."""
    out = list(args)
    for i, flag in enumerate(out[:-1]):
        if flag in SMOKE_CAPS:
            out[i + 1] = str(min(int(out[i + 1]), SMOKE_CAPS[flag]))
    return out


class Server:
    def __init__(self, flags: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        # Its output goes to a file: a pipe read only until "ready" would fill and
        # block the server at a later log line.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "roseserve", "serve", "--port", str(port), "--device", "cpu",
             "--log-level", "WARNING", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.log.seek(0)
            if b"roseserve is ready" in self.log.read():
                return
            time.sleep(0.3)
        raise RuntimeError(f"server with {flags} did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream(url: str, args: list[str], out: Path, label: str) -> dict:
    cmd = [sys.executable, "benchmarks/stream.py", "--url", url, "--json", str(out),
           "--label", label, "--no-progress", *args]
    print("$ python " + " ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(result.stdout, flush=True)
    if result.returncode not in (0, 1):
        raise RuntimeError(result.stderr)
    return json.loads(out.read_text())


class Servers:
    """The server each variant runs against: its own, started afresh; with --smoke,
    the one running when the last variant had the same flags (what the smoke checks
    is that each variant's flags serve, not its figures)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.current: Optional[tuple[list[str], Server]] = None

    def get(self, flags: list[str]) -> Server:
        if self.current is not None and not (self.args.smoke and self.current[0] == flags):
            self.close()
        if self.current is None:
            self.current = (flags, Server(flags + self.args.server_flags, self.args.port))
        return self.current[1]

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None


def run_experiment(name: str, args: argparse.Namespace, servers: Servers) -> None:
    print(f"##### {name}", flush=True)
    summaries = []
    for variant, server_flags, stream_args in EXPERIMENTS[name]:
        print(f"--- {variant}: roseserve serve {' '.join(server_flags)}", flush=True)
        server = servers.get(server_flags)
        summaries.append(stream(server.url, smoke(stream_args) if args.smoke else stream_args,
                                args.out / f"{name}-{variant}.json", variant))
    for other in summaries[1:]:
        print("\n".join(compare(summaries[0], other)), flush=True)


def http_ratio(args: argparse.Namespace) -> None:
    """One workload in-process and over HTTP, alternated; HTTP / in-process tokens/s."""
    from benchmarks.engine import make_prompts, run_engine
    from common.config import EngineConfig, SchedulerConfig
    from engine_worker.engine import LLMEngine

    print("##### http-ratio", flush=True)
    model = args.server_flags[args.server_flags.index("--model") + 1] \
        if "--model" in args.server_flags else None
    num_requests, tokens, repeats = (4, 4, 1) if args.smoke else (64, 128, 3)
    engine = LLMEngine(EngineConfig(device="cpu", num_threads=2, model=model,
                                    scheduler=SchedulerConfig(max_batch_size=num_requests)))
    wl = argparse.Namespace(seed=0, shared_prefix=0, input_len=16, num_requests=num_requests)
    prompts = make_prompts(wl, engine.vocab_size)
    run_engine(engine, prompts[:4], 4)
    server = Server(["--threads", "2", *args.server_flags], args.port)
    pairs = []
    try:
        stream(server.url, ["--dataset", "random", "--input-len", "16", "--num-requests", "8",
                            "--max-new-tokens", "8", "--no-stop-on-eos", "--warmup-runs", "0"],
               args.out / "http-ratio-warmup.json", "warmup")
        for r in range(repeats):
            engine.block_manager.reset_prefix_cache()
            local = run_engine(engine, prompts, tokens)["tokens_per_s"]
            remote = stream(server.url, [
                "--dataset", "random", "--input-len", "16", "--num-requests", str(num_requests),
                "--max-new-tokens", str(tokens), "--no-stop-on-eos", "--warmup-runs", "0",
                "--seed", str(r)], args.out / f"http-ratio-{r}.json", f"http-{r}")
            pairs.append((local, remote["throughput_completion"]))
            print(f"pair {r}: in-process {local:.1f} tokens/s, HTTP "
                  f"{remote['throughput_completion']:.1f} tokens/s", flush=True)
    finally:
        server.stop()
    ratios = [b / a for a, b in pairs]
    print(f"HTTP / in-process output tokens/s: {statistics.median(ratios):.3f} "
          f"(median of {', '.join(f'{x:.3f}' for x in ratios)})")
    (args.out / "http-ratio.json").write_text(json.dumps({"pairs": pairs, "ratios": ratios}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="+",
                        choices=[*EXPERIMENTS, "http-ratio"])
    parser.add_argument("--port", type=int, default=8077)
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true",
                        help="a few requests and tokens per workload (CI)")
    parser.usage = "%(prog)s [-h] [--port PORT] [--out OUT] [--smoke] NAME [NAME ...] " \
                   "[-- SERVER FLAGS]"
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.server_flags = argv[cut + 1:]   # for every roseserve serve
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    servers = Servers(args)
    try:
        for name in args.experiments:
            if name == "http-ratio":
                servers.close()   # (its server has flags of its own, on the same port)
                http_ratio(args)
            else:
                run_experiment(name, args, servers)
    finally:
        servers.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
