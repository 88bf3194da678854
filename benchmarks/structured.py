"""What a structured-output request costs the requests batched with it, in process.

    python benchmarks/structured.py --json docs/bench/structured.json

Each round runs the same batch twice on the engine: --batch plain greedy requests
plus --constrained more requests that are plain too (A), or held to a JSON schema
(B), every request decoding --steps tokens. The per-step time of the decode phase is
what every request in the batch waits for, so B / A is the cost a constrained request
puts on the others. Rounds alternate A and B (the machine's speed drifts); medians
over rounds. Also printed: the time of a step's grammar masks (llguidance's
computation of every constrained row's allowed tokens, in parallel), and whether the plain
requests' tokens were identical in A and B (masks are per request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stack import cpu_model, simd_flags  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from common.structured import GrammarCompiler, json_schema_output  # noqa: E402

# Long enough to outlast --steps: an array of short strings.
SCHEMA = {"type": "array", "minItems": 200,
          "items": {"type": "object", "required": ["name", "age"],
                    "properties": {"name": {"type": "string", "maxLength": 12},
                                   "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=8, help="plain requests in the batch")
    p.add_argument("--constrained", type=int, default=1,
                   help="requests added to them: plain (A) or JSON-schema (B)")
    p.add_argument("--steps", type=int, default=64, help="tokens each request decodes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


class _TimedMasks:
    """Wraps GrammarCompiler.allowed to time every step's masks."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._allowed = GrammarCompiler.allowed

    def __enter__(self):
        timed = self

        def allowed(compiler, matchers):
            start = time.perf_counter()
            out = timed._allowed(compiler, matchers)
            timed.times.append(time.perf_counter() - start)
            return out

        GrammarCompiler.allowed = allowed
        return self

    def __exit__(self, *exc) -> None:
        GrammarCompiler.allowed = self._allowed


def run_batch(engine, args, constrained: bool) -> tuple[list[float], list[list[int]]]:
    """Decode-step times (s) and the plain requests' tokens."""
    structured = json_schema_output(SCHEMA, "guided_json") if constrained else None
    plain = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"plain-{i}", [1, 9690, 198, 1000 + i, 30], plain)
    for i in range(args.constrained):
        engine.add_request(f"extra-{i}", [1, 9690, 198, 2000 + i, 30], SamplingParams(
            max_tokens=args.steps, temperature=0, ignore_eos=True, structured=structured))
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if len(outs) == args.batch + args.constrained:  # a full decode step
            steps.append(elapsed)
    extra = [tokens[f"extra-{i}"] for i in range(args.constrained)]
    assert all(len(t) == args.steps for t in extra), "a constrained request ended early"
    return steps[1:], [tokens[f"plain-{i}"] for i in range(args.batch)]


def main(argv=None) -> int:
    args = parse_args(argv)
    from engine_worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", num_threads=args.threads))
    engine.grammars  # built before timing
    run_batch(engine, args, True)  # warm-up (kernels, the grammar's first masks)
    medians = {"plain": [], "json": []}
    identical = True
    with _TimedMasks() as masks:
        for _ in range(args.rounds):
            a, tokens_a = run_batch(engine, args, False)
            b, tokens_b = run_batch(engine, args, True)
            medians["plain"].append(statistics.median(a))
            medians["json"].append(statistics.median(b))
            identical = identical and tokens_a == tokens_b
    step_a = statistics.median(medians["plain"]) * 1e3
    step_b = statistics.median(medians["json"]) * 1e3
    mask_ms = statistics.median(masks.times) * 1e3
    result = {"cpu": cpu_model(), "simd": simd_flags(), "model": engine.model_name,
              "batch": args.batch, "constrained": args.constrained, "steps": args.steps,
              "rounds": args.rounds, "step_ms_plain": round(step_a, 3),
              "step_ms_with_json": round(step_b, 3), "ratio": round(step_b / step_a, 4),
              "mask_ms_median": round(mask_ms, 4),
              "mask_ms_p99": round(sorted(masks.times)[int(0.99 * (len(masks.times) - 1))] * 1e3,
                                   4),
              "plain_tokens_identical": identical}
    n = args.batch + args.constrained
    print(f"structured output: {result['model']} on {result['cpu']}, decode batch of {n}, "
          f"{args.steps} steps, medians of {args.rounds} alternating rounds")
    rows = [(f"step, {n} plain requests", f"{step_a:.2f} ms"),
            (f"step, {args.batch} plain + {args.constrained} JSON-schema",
             f"{step_b:.2f} ms ({step_b / step_a:.3f}x)"),
            ("a step's grammar masks, median / p99",
             f"{mask_ms:.3f} / {result['mask_ms_p99']:.3f} ms")]
    for name, value in rows:
        print(f"  {name:<34} {value}")
    print(f"  plain requests' tokens identical with and without: {identical}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
