"""Sliding-window layers' blocks in a pool of their own, against one pool for every
layer, at the same KV memory, in one run.

    python benchmarks/window_pool.py --model-config gemma-3-1b --layers 6 \\
        --quantization int8 --kv-cache-memory-mb 96

Loads the model twice in this process (random weights from a shipped model shape,
``--load-format dummy``; ``--layers`` keeps its first layers: Gemma 3's first six are
five sliding and one full, its own mix): once with the sliding layers' pool
(engine_worker/window_blocks.py) and once with one pool. Each gets the same KV memory.
Then, ``--repeats`` rounds alternating the two, it serves ``--num-requests`` requests of
``--input-len`` prompt tokens and ``--output-len`` generated ones (greedy, all
submitted at once) and prints per engine: the tokens of context its pool holds, the
most requests that ran at once, the preemptions, and output tokens/s (medians), and
whether the two gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.stack import add_shape_args, cpu_model, shape_dir  # noqa: E402
from common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from engine_worker.engine import LLMEngine  # noqa: E402

KINDS = ("two pools", "one pool")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, "gemma-3-1b")
    p.add_argument("--kv-cache-memory-mb", type=float, default=96)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def engine(args: argparse.Namespace, path: Path, window_pool: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), device="cpu", load_format=args.load_format,
        quantization=args.quantization, num_threads=args.threads,
        cache=CacheConfig(block_size=args.block_size, window_pool=window_pool,
                          kv_cache_memory_bytes=int(args.kv_cache_memory_mb * 2**20)),
        scheduler=SchedulerConfig(max_batch_size=args.max_batch_size,
                                  max_num_batched_tokens=args.max_num_batched_tokens)))


def serve(e: LLMEngine, prompts: list[list[int]], params: SamplingParams
          ) -> tuple[dict[str, list[int]], float, int, int]:
    """Every prompt at once, stepped to the end: (tokens by request, seconds, the most
    requests running at once, preemptions)."""
    preempted = e.scheduler.num_preemptions
    for i, prompt in enumerate(prompts):
        e.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    most = 0
    started = time.perf_counter()
    while e.has_unfinished_requests():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        most = max(most, len(e.scheduler.running))
    return (tokens, time.perf_counter() - started, most,
            e.scheduler.num_preemptions - preempted)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = shape_dir(args.model_config, args.layers, args.load_format, Path(tmp))
        engines = dict(zip(KINDS, (engine(args, path, True), engine(args, path, False))))
    two = engines["two pools"]
    if not two.runner.windowed:
        raise SystemExit(f"{args.model_config}: its layers do not mix full attention and a "
                         f"sliding window")
    cfg = two.model_config
    print(f"CPU: {cpu_model()}; model: {args.model_config}, {cfg.num_layers} layers "
          f"({sum(1 for w in cfg.windows if w)} sliding, a window of {two.runner.window}), "
          f"weights {two.runner.weight_format}, KV memory {args.kv_cache_memory_mb} MiB")
    gen = random.Random(0)
    vocab = min(cfg.vocab_size, 32000)
    prompts = [[gen.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for e in engines.values():  # warm: the first step of an engine pays for its set-up
        serve(e, prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    rounds: dict[str, list[tuple]] = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        for kind, e in engines.items():
            rounds[kind].append(serve(e, prompts, params))
    report = {"cpu": cpu_model(), "model": args.model_config, "layers": cfg.num_layers,
              "window": two.runner.window, "weights": two.runner.weight_format,
              "kv_cache_memory_mb": args.kv_cache_memory_mb, "requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len,
              "same_tokens": rounds[KINDS[0]][-1][0] == rounds[KINDS[1]][-1][0],
              "results": {}}
    for kind, e in engines.items():
        done = rounds[kind]
        rates = [args.num_requests * args.output_len / seconds for _, seconds, _, _ in done]
        row = {"context_tokens": e.runner.num_blocks * args.block_size,
               "local_blocks": max(0, e.runner.num_local_blocks - 1),
               "most_running": max(most for _, _, most, _ in done),
               "preemptions": statistics.median(p for _, _, _, p in done),
               "tokens_per_s": statistics.median(rates), "rounds": rates}
        report["results"][kind] = row
        print(f"{kind}: {row['context_tokens']} tokens of context, {row['most_running']} "
              f"requests at once, {row['preemptions']} preemptions, "
              f"{row['tokens_per_s']:.1f} output tokens/s "
              f"(rounds {', '.join(f'{r:.1f}' for r in rates)})", flush=True)
    ratio = [b[1] / a[1] for a, b in zip(rounds[KINDS[0]], rounds[KINDS[1]])]
    report["ratio"] = statistics.median(ratio)
    print(f"two pools / one pool: {report['ratio']:.2f}x the tokens/s (median of the "
          f"rounds' pairs); same tokens: {report['same_tokens']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
