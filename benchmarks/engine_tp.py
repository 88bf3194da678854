"""Tensor parallelism on the CPU: one engine split over N ranks (each pinned to its
share of the cores, a thread a core) against one engine not split on all the cores,
in one run.

    python benchmarks/engine.py --tensor-parallel-size 2
    python benchmarks/engine.py --tensor-parallel-size 2 --model qwen3-0.6b \\
        --load-format dummy --output-len 16

(benchmarks/engine.py hands ``--tensor-parallel-size`` to this module.) This process
is rank 0 of the split engine (ranks 1..N-1 are engine worker processes that follow
its steps, engine_worker/tensor_parallel.py) and runs the engine that is not split
too, the two taking turns. For each batch (--batches, default 1, 8 and 64) it runs
that many requests of --input-len random prompt tokens and --output-len greedy tokens
at once, --repeats times each engine, and prints output tokens/s, the split engine's
over the whole one's (the median of the runs' pairs), whether every request's tokens
are the same, and the share of rank 0's run spent in the ranks' collectives: the
all-reduces after each attention and MLP, the logits' gather, and the broadcast of
each step's inputs (each includes the wait for the slowest rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.protocol import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--model", default=None,
                   help="model directory or shipped shape (default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores in all: the whole engine's threads; the split engine's "
                        "ranks share them (default: every core this process may use)")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def engine_argv(args, batch: int) -> list[str]:
    """The split engine's flags, as its other ranks are started with."""
    argv = ["--device", "cpu", "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--threads", str(max(1, args.threads // args.tensor_parallel_size)),
            "--max-batch-size", str(batch), "--load-format", args.load_format,
            "--seed", str(args.seed), "--log-level", "WARNING"]
    return argv + (["--model", args.model] if args.model else [])


def generate(engine, prompts, output_len: int) -> tuple[float, list[list[int]]]:
    """Every prompt at once, greedy: (seconds, each request's tokens)."""
    from benchmarks.engine_steps import timed_generate

    return timed_generate(engine, prompts, SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.stack import cpu_model
    from engine_worker import tensor_parallel
    from engine_worker.__main__ import build_parser, engine_config_from_args
    from engine_worker.engine import LLMEngine
    from engine_worker.models.layers.parallel import CollectiveClock

    batches = [int(b) for b in args.batches.split(",")]
    size = args.tensor_parallel_size
    cores = sorted(os.sched_getaffinity(0))
    flags = engine_argv(args, max(batches))
    config = engine_config_from_args(build_parser().parse_args(flags))
    ranks = tensor_parallel.Ranks(flags, size)
    try:
        device, threads = tensor_parallel.join(0, size, "cpu", config.num_threads)
        split_cores = sorted(os.sched_getaffinity(0))
        split = LLMEngine(dataclasses.replace(config, num_threads=threads))
        os.sched_setaffinity(0, cores)
        whole = LLMEngine(dataclasses.replace(config, tensor_parallel_size=1,
                                              num_threads=args.threads))

        def run(engine, prompts) -> tuple[float, list[list[int]]]:
            one = engine is whole
            os.sched_setaffinity(0, cores if one else split_cores)
            torch.set_num_threads(args.threads if one else threads)
            return generate(engine, prompts, args.output_len)

        cfg = whole.model_config
        rng = random.Random(args.seed)
        print(f"CPU: {cpu_model()}, {len(cores)} cores; model: {cfg.name} "
              f"({cfg.num_params / 1e6:.0f}M params, {whole.runner.weight_format}); "
              f"{size} ranks x {threads} thread(s) against 1 x {args.threads}")
        results = []
        for batch in batches:
            prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(args.input_len)]
                       for _ in range(batch)]
            for e in (whole, split):   # warm-up
                run(e, prompts[:1])
            pairs, same, shares = [], True, []
            for _ in range(args.repeats):
                t_whole, tokens_whole = run(whole, prompts)
                CollectiveClock.seconds.clear()
                CollectiveClock.on = True
                t_split, tokens_split = run(split, prompts)
                CollectiveClock.on = False
                same &= tokens_split == tokens_whole
                n = batch * args.output_len
                pairs.append((n / t_whole, n / t_split))
                shares.append({k: v / t_split for k, v in CollectiveClock.seconds.items()})
            ratios = [s / w for w, s in pairs]
            share = {k: statistics.median(s.get(k, 0.0) for s in shares)
                     for k in ("all_reduce", "gather", "broadcast")}
            results.append({"batch": batch, "whole_tokens_per_s": [w for w, _ in pairs],
                            "split_tokens_per_s": [s for _, s in pairs], "ratios": ratios,
                            "ratio": statistics.median(ratios), "identical": same,
                            "collective_share": share})
            r = results[-1]
            print(f"batch {batch:3d}: whole {statistics.median(r['whole_tokens_per_s']):8.1f} "
                  f"tok/s, split {statistics.median(r['split_tokens_per_s']):8.1f} tok/s -> "
                  f"{r['ratio']:.2f}x (pairs {', '.join(f'{x:.2f}' for x in ratios)}); "
                  f"tokens {'identical' if same else 'DIFFER'}; rank 0 in all-reduce "
                  f"{100 * share['all_reduce']:.0f}%, gather {100 * share['gather']:.0f}%, "
                  f"broadcast {100 * share['broadcast']:.0f}%")
        split.runner.inputs.stop()
    finally:
        ranks.stop()
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "cpu": cpu_model(), "cores": len(cores), "model": cfg.name,
            "weights": whole.runner.weight_format, "tensor_parallel_size": size,
            "threads_per_rank": threads, "threads_whole": args.threads,
            "input_len": args.input_len, "output_len": args.output_len,
            "results": results}, indent=2))
        print(f"wrote {args.json_path}")
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
