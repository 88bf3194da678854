"""What a KV cache's element type costs in accuracy: teacher-forced logits with a
bfloat16 and an fp8 cache against a float32 cache, on the same model and text.

    python benchmarks/kv_accuracy.py

The engine runs the torch reference path (--attention-backend torch: the only CPU path
that reads every cache type; a CUDA engine's Triton kernels read the same rounded
values) with float32 weights, so the cache alone differs. The text is
benchmarks/accuracy.py's (the language reference topics that ship with Python), in
--windows windows of --window tokens spread over its first 16,384 tokens, each scored
from its own start in chunks of --chunk tokens (later chunks read the earlier ones
back from the cache). For each cache type:
the logits' relative L2 distance from float32's, the share of positions whose top
token differs, and the mean KL divergence of the next-token distribution.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402

def teacher_forced(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt position's next-token logits, float32, one row per position."""
    rows = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"kv-{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        while engine.has_unfinished_requests():
            engine.step()
            rows += [logits.float().cpu() for _, _, logits in engine.runner.prompt_logits]
    return torch.cat(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtypes", default="bfloat16,fp8")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--window", type=int, default=400)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    from benchmarks.accuracy import reference_text
    from common.model_files import resolve_model_dir
    from engine_worker.engine import LLMEngine

    model_dir = resolve_model_dir(args.model)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        reference_text()).ids[:16384]
    step = (len(ids) - args.window) // max(1, args.windows)
    prompts = [ids[i * step:i * step + args.window] for i in range(args.windows)]

    def logits(kv_cache_dtype: str) -> torch.Tensor:
        engine = LLMEngine(EngineConfig(
            model=str(model_dir), device=args.device, dtype="float32",
            attention_backend="torch", num_threads=args.threads,
            cache=CacheConfig(kv_cache_memory_bytes=256 << 20, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_batch_size=4, max_num_batched_tokens=args.chunk)))
        return teacher_forced(engine, prompts)

    exact = logits("float32")
    log_p = torch.log_softmax(exact.double(), -1)
    report = {"model": str(model_dir), "positions": exact.shape[0], "dtypes": {}}
    print(f"{model_dir.name}: {exact.shape[0]} positions of pydoc_data's text, against a "
          f"float32 cache")
    print("cache       logits rel L2  top token differs  mean KL")
    for dtype in args.dtypes.split(","):
        got = logits(dtype)
        log_q = torch.log_softmax(got.double(), -1)
        row = {"rel_l2": float((got - exact).norm() / exact.norm()),
               "top1_differs": float((got.argmax(-1) != exact.argmax(-1)).float().mean()),
               "mean_kl": float((log_p.exp() * (log_p - log_q)).sum(-1).mean())}
        report["dtypes"][dtype] = row
        print(f"{dtype:10s} {row['rel_l2']:14.2e} {row['top1_differs']:17.2%} "
              f"{row['mean_kl']:9.2e}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
