"""The floor of a GPU benchmark run step by step, as the engine's scheduler would take
it, at several token budgets: does another budget let the run go faster?

    python benchmarks/schedule_floor.py --model-config llama-3-8b --concurrency 64,256 \\
        --bandwidth 2.95e12 --gemm-rate 798e12 --budgets 512,1024,2048,4096,8192

Arithmetic only (no GPU): the bandwidth and matmul rate are a run's own roofline figures
(benchmarks/engine.py --device cuda prints them; above, an H100's). The requests arrive
together, as in that benchmark. Each step takes decode rows first (one token each, at
most a decode batch), then prompt chunks in arrival order, up to the budget; it costs
max(bytes / bandwidth, FLOPs / rate), bytes being the weights plus the keys and values
every sequence of the step reads (of the embedding table, its tokens' rows), FLOPs 2 x
parameters per token (the lm_head's only for rows that sample). Beside it, the
benchmark's own floor (engine_gpu.run_floor: every prompt first, then the decode
steps), which ignores how the steps interleave.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_gpu import run_floor  # noqa: E402
from common.model_files import resolve_model_dir  # noqa: E402
from engine_worker.models.registry import load_model_config  # noqa: E402


def scheduled_floor(weight_bytes: Callable[[int], float], kv_bytes_per_token: float,
                    flops_per_token: float, lm_head_flops: float, concurrency: int,
                    input_len: int, output_len: int, budget: int, bandwidth: float,
                    rate: float) -> tuple[float, int]:
    """(seconds, steps) of the run step by step at this token budget; weight_bytes:
    of a step of so many tokens (engine_gpu.weight_reads); the lm_head's FLOPs only for
    the rows that sample (decode rows, prompts' last tokens)."""
    prefilled = [0] * concurrency
    generated = [0] * concurrency
    seconds, steps = 0.0, 0
    while min(generated) < output_len:
        decoding = [i for i in range(concurrency)
                    if prefilled[i] == input_len and 0 < generated[i] < output_len][:budget]
        room = budget - len(decoding)
        kv_tokens = sum(input_len + generated[i] for i in decoding)
        chunks = []
        for i in range(concurrency):
            if room == 0:
                break
            if prefilled[i] < input_len:
                n = min(input_len - prefilled[i], room)
                chunks.append((i, n))
                room -= n
                kv_tokens += prefilled[i] + n
        tokens = budget - room
        sampled = len(decoding) + sum(1 for i, n in chunks if prefilled[i] + n == input_len)
        flops = tokens * (flops_per_token - lm_head_flops) + sampled * lm_head_flops
        seconds += max((weight_bytes(tokens) + kv_tokens * kv_bytes_per_token) / bandwidth,
                       flops / rate)
        steps += 1
        for i in decoding:
            generated[i] += 1
        for i, n in chunks:
            prefilled[i] += n
            if prefilled[i] == input_len:
                generated[i] = 1  # the prompt's last chunk samples the first token
    return seconds, steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", default="llama-3-8b")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--bandwidth", type=float, required=True, help="bytes/s")
    p.add_argument("--gemm-rate", type=float, required=True, help="FLOP/s")
    p.add_argument("--budgets", default="512,1024,2048,4096,8192")
    p.add_argument("--bytes-per-value", type=int, default=2, help="weights; 2: bfloat16")
    p.add_argument("--kv-bytes-per-value", type=int, default=2,
                   help="the KV cache's; 2: bfloat16, 1: fp8")
    args = p.parse_args(argv)

    cfg = load_model_config(resolve_model_dir(args.model_config))
    # Of the embedding table a step reads its tokens' rows (the table whole where the
    # lm_head is tied to it), as engine_gpu.weight_reads counts
    row = cfg.hidden_size * args.bytes_per_value
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * row
    weight_bytes = cfg.num_params * args.bytes_per_value - table

    def reads(tokens: int) -> float:
        return weight_bytes + (0 if cfg.tie_word_embeddings else tokens * row)

    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * args.kv_bytes_per_value
    print(f"{args.model_config}: {weight_bytes / 1e9:.2f} GB of weights, {kv} bytes of K/V "
          f"a token; {args.bandwidth / 1e12:.2f} TB/s, {args.gemm_rate / 1e12:.0f} TFLOP/s; "
          f"{args.input_len} in / {args.output_len} out")
    for c in (int(x) for x in args.concurrency.split(",")):
        tokens = c * args.output_len
        for budget in (int(b) for b in args.budgets.split(",")):
            seconds, steps = scheduled_floor(reads, kv, cfg.flops_per_token, lm_head, c,
                                             args.input_len, args.output_len, budget,
                                             args.bandwidth, args.gemm_rate)
            two_phase = run_floor(cfg, reads, kv, c, args.input_len, args.output_len, budget,
                                  args.bandwidth, args.gemm_rate)
            print(f"{c:4d} streams, budget {budget:5d}: step by step {seconds:5.2f} s "
                  f"({steps} steps, {tokens / seconds:7.0f} tokens/s); the benchmark's "
                  f"floor {two_phase:5.2f} s ({tokens / two_phase:7.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
