"""roseserve against another OpenAI-compatible server: the same workload, back to back.

    roseserve serve &                                   # http://127.0.0.1:8000
    llama-server -m SmolLM2-135M-Instruct.F32.gguf --port 8090 -np 64 -c 65536 -t 2 &
    python benchmarks/peers.py --peer-url http://127.0.0.1:8090 --json docs/bench/peers-f32.json

(llama.cpp's server; docs/performance.md says how its GGUF files were made.)

The workload: random prompts of ``--input-len`` token ids (32), ``--output-len``
output tokens (128) with ignore_eos, greedy, streamed, at each concurrency of
``--streams`` (1, 8, 64; ``max(--min-requests, 2 x streams)`` requests each). At every
concurrency the two servers run alternately ``--rounds`` times (roseserve first), on
the same prompts, new ones each round (so no prompt cache serves them),
each run through benchmarks/stream.py, which needs nothing roseserve-specific from
the peer: without token ids or a usage chunk it counts one token per text chunk.
Printed: per concurrency and server, the median output tokens/s and TTFT p50, and
roseserve / peer as a ratio of those medians. Name the CPU with the figures: it is
printed too. A run in which requests failed (a server that crashed, say) is recorded
with its errors and left out of the medians; the other runs go on, the JSON is written
after each concurrency, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import stream  # noqa: E402
from benchmarks.stack import cpu_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="roseserve")
    p.add_argument("--peer-url", required=True)
    p.add_argument("--peer-name", default="peer")
    p.add_argument("--streams", default="1,8,64", help="concurrencies, comma-separated")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokenizer", default=None,
                   help="model directory whose vocabulary the random prompts use "
                        "(default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def run(url: str, streams: int, args: argparse.Namespace, label: str, seed: int) -> dict:
    num_requests = max(args.min_requests, 2 * streams)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = ["--url", url, "--dataset", "random", "--input-len", str(args.input_len),
                "--num-requests", str(num_requests),
                "--max-new-tokens", str(args.output_len), "--no-stop-on-eos",
                "--max-concurrency", str(streams), "--seed", str(seed),
                "--warmup-runs", "0", "--no-progress", "--label", label, "--json", str(out),
                *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
        errors = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            code = stream.main(argv)  # the full report is in the JSON
        if not out.exists():  # it could not start (the server is unreachable)
            summary = {"num_failed": num_requests, "failures": [errors.getvalue().strip()]}
        else:
            summary = json.loads(out.read_text())
    if code != 0:  # recorded, and the other runs go on: one server's failure is a result
        print(f"{label}: {summary['num_failed']} requests failed: {summary['failures'][:3]}",
              flush=True)
        return {"failed": summary["num_failed"], "errors": summary["failures"][:3]}
    return {"tokens_per_s": summary["throughput_completion"],
            "ttft_ms_p50": summary["ttft_ms"][0], "completion_tokens": summary["completion_tokens"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = [("roseserve", args.url), (args.peer_name, args.peer_url)]
    levels = [int(s) for s in args.streams.split(",")]
    results: list[dict] = []
    cpu = cpu_model()
    for streams in levels:
        runs: dict[str, list[dict]] = {name: [] for name, _ in servers}
        for r in range(args.rounds):
            # Prompts new to both servers in every round: a repeated prompt would be
            # served from their prompt caches (llama-server's slots, our prefix cache).
            seed = args.seed + 1000 * streams + r
            for name, url in servers:
                one = run(url, streams, args, f"{name} x{streams} round {r + 1}", seed)
                runs[name].append(one)
                if "failed" not in one:
                    print(f"{streams:>3} streams, round {r + 1}: {name:<10} "
                          f"{one['tokens_per_s']:7.1f} tokens/s, TTFT p50 "
                          f"{one['ttft_ms_p50']:.0f} ms", flush=True)
        results.append(summarize(streams, runs, args.peer_name))
        if args.json_path:  # after every level: what was measured outlives a crash
            Path(args.json_path).write_text(json.dumps(
                {"cpu": cpu, "workload": vars(args), "results": results}, indent=2) + "\n")
    peer = args.peer_name
    print(f"\n=== roseserve vs {peer}: {args.input_len}-token random prompts, "
          f"{args.output_len} output tokens, median of {args.rounds} alternating rounds; "
          f"{cpu} ===")
    print(f"{'streams':>7} {'roseserve tok/s':>16} {peer + ' tok/s':>16} {'ratio':>6} "
          f"{'roseserve TTFT p50':>19} {peer + ' TTFT p50':>19}")
    for row in results:
        mine, theirs, ratio = row["roseserve"], row[peer], row["ratio_tokens_per_s"]
        print(f"{row['streams']:>7} {_figure(mine, 'tokens_per_s', 16, '.1f')} "
              f"{_figure(theirs, 'tokens_per_s', 16, '.1f')} "
              f"{'-' if ratio is None else format(ratio, '.2f'):>6} "
              f"{_figure(mine, 'ttft_ms_p50', 16, '.0f')} ms "
              f"{_figure(theirs, 'ttft_ms_p50', 16, '.0f')} ms")
    if args.json_path:
        print(f"wrote {args.json_path}")
    failed = sum(x.get("failed", 0) for row in results for name, _ in servers
                 for x in row[name]["runs"])
    if failed:
        print(f"{failed} requests failed (their runs are left out of the medians)")
    return 1 if failed else 0


def summarize(streams: int, runs: dict[str, list[dict]], peer: str) -> dict:
    """One concurrency's row: each server's medians over the runs that completed (None
    where none did) and its runs, failed ones included; the ratio where both ran."""
    row: dict = {"streams": streams}
    for name, theirs in runs.items():
        done = [x for x in theirs if "failed" not in x]
        row[name] = {key: statistics.median(x[key] for x in done) if done else None
                     for key in ("tokens_per_s", "ttft_ms_p50")}
        row[name]["runs"] = theirs
    mine, other = row["roseserve"]["tokens_per_s"], row[peer]["tokens_per_s"]
    row["ratio_tokens_per_s"] = mine / other if mine and other else None
    return row


def _figure(server: dict, key: str, width: int, spec: str) -> str:
    value = server[key]
    return f"{'-' if value is None else format(value, spec):>{width}}"


if __name__ == "__main__":
    sys.exit(main())
