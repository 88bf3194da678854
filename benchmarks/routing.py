"""Prefix-aware routing against least-loaded, with one frontend and with two, on a
workload of several shared prefixes.

    python benchmarks/routing.py --json docs/bench/routing.json
    python benchmarks/routing.py --num-requests 16 -- --model DIR --device cpu   # after --:
                                                                                  # serve's flags

Runs benchmarks/stream.py's shared-prefix workload (``--num-prefixes`` distinct
prefixes, each prompt one of them plus its own tail) against four ``roseserve serve``
stacks in turn, each started fresh (cold caches): one engine with the whole machine
(the reference hit rate), two engines of ``cores / 2`` threads with ``--routing
prefix``, the same behind two frontends (``--frontends 2``, sent requests in turn as
a round-robin balancer would: each frontend routes by what the engines report they
cache, whoever sent it there), and two engines with ``--routing least-loaded``.
Prints, per configuration, the prefix-cache hit rate (prompt tokens served from the
cache / prompt tokens), TTFT p50/p99, output throughput and requests per engine; then
each two-engine hit rate as a ratio of the one-engine rate (the target for
prefix-aware routing: >= 0.9), and the two frontends' as a ratio of one frontend's
(target: >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import stream  # noqa: E402
from benchmarks.stack import Stack, cpu_model  # noqa: E402

ONE_FRONTEND = "2 engines, prefix-aware"
TWO_FRONTENDS = "2 engines, prefix, 2 frontends"
CONFIGS = [("1 engine", ["--engines", "1"]),
           (ONE_FRONTEND, ["--engines", "2", "--routing", "prefix"]),
           (TWO_FRONTENDS, ["--engines", "2", "--routing", "prefix", "--frontends", "2"]),
           ("2 engines, least-loaded", ["--engines", "2", "--routing", "least-loaded"])]


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--shared-prefix-len", type=int, default=448)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:cut]), argv[cut + 1:]


def main(argv=None) -> int:
    args, serve_args = parse_args(argv)
    model = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else None
    results = []
    for name, config in CONFIGS:
        stack = Stack([*serve_args, *config], name="routing")
        try:
            stack.wait_ready()
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run.json"
                code = stream.main([
                    *[a for url in stack.urls for a in ("--url", url)],
                    "--dataset", "shared-prefix",
                    "--num-prefixes", str(args.num_prefixes),
                    "--shared-prefix-len", str(args.shared_prefix_len),
                    "--input-len", str(args.input_len), "--num-requests", str(args.num_requests),
                    "--max-new-tokens", str(args.max_new_tokens), "--no-stop-on-eos",
                    "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
                    "--warmup-runs", "0", "--no-progress", "--label", name, "--json", str(out),
                    *(["--tokenizer", model] if model else [])])
                summary = json.loads(out.read_text())
        finally:
            stack.stop()
        if code != 0:
            print(f"{name}: {summary['num_failed']} requests failed", file=sys.stderr)
            return 1
        results.append({"config": name, "serve_args": config,
                        "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"],
                        "ttft_ms_p50": summary["ttft_ms"][0], "ttft_ms_p99": summary["ttft_ms"][2],
                        "throughput_completion": summary["throughput_completion"],
                        "engines": summary["engines"]})
    reference = results[0]["prefix_cache_hit_rate"] or 1e-9
    for r in results:
        r["hit_rate_vs_one_engine"] = r["prefix_cache_hit_rate"] / reference
    by_name = {r["config"]: r for r in results}
    two_vs_one = (by_name[TWO_FRONTENDS]["prefix_cache_hit_rate"] /
                  (by_name[ONE_FRONTEND]["prefix_cache_hit_rate"] or 1e-9))
    cpu = cpu_model()
    print(f"\n=== routing: {args.num_requests} requests, {args.num_prefixes} prefixes of "
          f"{args.shared_prefix_len} tokens, {args.input_len}-token prompts, "
          f"{args.max_new_tokens} output tokens, concurrency {args.max_concurrency}; {cpu} ===")
    print(f"{'configuration':<31} {'hit rate':>8} {'vs 1 engine':>11} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'tok/s':>7}  requests per engine")
    for r in results:
        spread = " / ".join(str(n) for n in r["engines"].values())
        print(f"{r['config']:<31} {r['prefix_cache_hit_rate']:>8.3f} "
              f"{r['hit_rate_vs_one_engine']:>11.2f} {r['ttft_ms_p50']:>7.0f}ms "
              f"{r['ttft_ms_p99']:>7.0f}ms {r['throughput_completion']:>7.1f}  {spread}")
    print(f"two frontends' hit rate / one frontend's: {two_vs_one:.3f} "
          f"({by_name[TWO_FRONTENDS]['prefix_cache_hit_rate']:.3f} / "
          f"{by_name[ONE_FRONTEND]['prefix_cache_hit_rate']:.3f}; target >= 0.95)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "cpu": cpu, "workload": vars(args), "serve_args": serve_args, "results": results,
            "two_frontends_vs_one": two_vs_one},
            indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
