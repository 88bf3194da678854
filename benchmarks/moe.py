"""A mixture of experts on the CPU: the one-call C forward against the same C kernels
called layer by layer from Python, in one run.

    python benchmarks/moe.py --model-config qwen3-30b-a3b --layers 4 --quantization int8
    python benchmarks/moe.py --model-config gpt-oss-20b --layers 4 --quantization int8

Loads the model twice in this process (random weights from a shipped model shape with
``--load-format dummy``, the default, its first ``--layers`` layers only so that it
fits in memory; or a checkpoint with ``--load-format auto``): once on the fused forward
(engine_worker/cpu/csrc/llama.c) and once layer by layer. For each concurrency it
alternates the two, ``--repeats`` rounds each, and prints output tokens/s, the median
of each and of the ratio of the rounds' pairs, and whether the tokens are the same. With
random weights the router's logits are nearly tied and the two paths' softmaxes round
differently, so the tokens may part after a while; the tiny checkpoints of the tests
give the same tokens and logprobs within 1e-5 (tests/models/test_kernels.py).
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
from engine_worker.cpu.fused import FusedForward, FusedLlama  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, "qwen3-30b-a3b")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def engine(args: argparse.Namespace, path: Path, fused: bool) -> LLMEngine:
    supports = FusedLlama.supports
    if not fused:
        FusedLlama.supports = staticmethod(lambda model: False)
    try:
        made = LLMEngine(EngineConfig(
            model=str(path), device="cpu", load_format=args.load_format,
            quantization=args.quantization, num_threads=args.threads,
            cache=CacheConfig(num_blocks=2048, block_size=16),
            scheduler=SchedulerConfig(max_batch_size=max(64, *concurrencies(args)))))
    finally:
        FusedLlama.supports = supports
    if isinstance(made.runner.step, FusedForward) != fused:
        raise SystemExit(f"{path}: the fused forward does not run this model")
    return made


def concurrencies(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = shape_dir(args.model_config, args.layers, args.load_format, Path(tmp))
        engines = {"fused": engine(args, path, True), "layered": engine(args, path, False)}
    cfg = engines["fused"].model_config
    if not cfg.moe_layers:
        raise SystemExit(f"{args.model_config} is not a mixture of experts")
    print(f"CPU: {cpu_model()}; model: {args.model_config}, {cfg.num_layers} layers, "
          f"{cfg.num_experts} experts ({cfg.experts_per_token} a token), weights "
          f"{engines['fused'].runner.weight_format}")
    report = {"cpu": cpu_model(), "model": args.model_config, "layers": cfg.num_layers,
              "weights": engines["fused"].runner.weight_format, "results": {}}
    vocab = min(cfg.vocab_size, 32000)
    for conc in concurrencies(args):
        gen = random.Random(conc)
        prompts = [[gen.randrange(vocab) for _ in range(args.input_len)] for _ in range(conc)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        rates: dict[str, list[float]] = {"fused": [], "layered": []}
        tokens = {}
        for _ in range(args.repeats):
            for name, e in engines.items():
                started = time.perf_counter()
                tokens[name] = e.generate(prompts, params)
                rates[name].append(conc * args.output_len / (time.perf_counter() - started))
        pairs = [f / lay for f, lay in zip(rates["fused"], rates["layered"])]
        row = {"fused_tokens_per_s": statistics.median(rates["fused"]),
               "layered_tokens_per_s": statistics.median(rates["layered"]),
               "ratio": statistics.median(pairs), "rounds": pairs,
               "same_tokens": tokens["fused"] == tokens["layered"]}
        report["results"][str(conc)] = row
        print(f"concurrency {conc}: fused {row['fused_tokens_per_s']:.1f} tokens/s, layer by "
              f"layer {row['layered_tokens_per_s']:.1f}, fused / layered {row['ratio']:.2f} "
              f"(rounds {', '.join(f'{p:.2f}' for p in pairs)}); same tokens: "
              f"{row['same_tokens']}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
