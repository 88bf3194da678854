"""Accuracy of the lower-precision weight formats against float32, in one run.

    python benchmarks/accuracy.py --json docs/bench/accuracy.json

For float32, bfloat16, int8 and 4-bit weights (the engine's --dtype bfloat16,
--quantization int8 and --quantization q4 on the CPU kernels), and, for the default
model, its own GGUF file served as it is (Q4_1 layers; "gguf"; --gguf names another
file of the same model), it measures, on the same model:

- greedy agreement: a fixed set of chat prompts, each generating --max-tokens tokens
  greedily; the share of prompts whose whole output equals float32's, and the mean
  share of tokens generated before the first one that differs;
- perplexity on a text that ships with Python (the language reference topics of
  pydoc_data, the first --text-tokens tokens), in windows of --window tokens, each
  scored from its own start.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.config import CacheConfig, EngineConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Write one sentence about a cat who loves rain.",
    "What does a compiler do?",
    "Name the planets of the solar system.",
    "How do I boil an egg?",
    "Summarize the plot of Cinderella.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery.",
    "Describe the color green to someone who cannot see.",
]

FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
           "q4": {"quantization": "q4"}, "iq4": {"quantization": "iq4"}, "gguf": {}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--formats", default=None,
                   help="default: float32,bfloat16,int8,q4, and gguf for the default model "
                        "or with --gguf")
    p.add_argument("--gguf", default=None,
                   help="the model's GGUF file, for the gguf format (default: the default "
                        "model's own, Q4_1)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--text-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the KV cache of every format but the float32 reference (which keeps "
                        "float32, as Hugging Face computes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def reference_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def window_nll(engine, token_ids: list[int]) -> float:
    """Summed negative log-likelihood of token_ids[1:] given what precedes each, one
    sequence in the engine's KV blocks (the engine must be idle: it borrows blocks 0..)."""
    runner = engine.runner
    n, bs = len(token_ids), runner.block_size
    positions = torch.arange(n)
    cos, sin = runner.model.rotary(positions, torch.float32)
    local = (None if runner.model.rotary_local is None
             else runner.model.rotary_local(positions, torch.float32))
    table = torch.arange(-(-n // bs)).unsqueeze(0)
    logits = runner.step.fused.forward(   # (the fused forward: cpu/fused.py)
        torch.tensor(token_ids), cos, sin, positions.clone(), torch.zeros(n, dtype=torch.int64),
        positions + 1, table, torch.arange(n - 1), n, torch.get_num_threads(), local)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return -logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).sum().item()


def measure(fmt: str, args, prompts: list[list[int]], text_ids: list[int],
            kv_dtype: str) -> dict:
    from engine_worker.cpu.fused import FusedForward
    from engine_worker.cpu.kernels import WEIGHT_FORMATS
    from engine_worker.engine import LLMEngine

    model = args.model
    if fmt == "gguf":
        from common.model_files import _find_gguf

        model = args.gguf or str(_find_gguf())
    engine = LLMEngine(EngineConfig(
        model=model, device="cpu", num_threads=args.threads, **FORMATS[fmt],
        cache=CacheConfig(kv_cache_memory_bytes=256 << 20, kv_cache_dtype=kv_dtype)))
    # a GGUF file's layers take the format their type packs as
    expected = tuple(WEIGHT_FORMATS) if fmt == "gguf" else (fmt,)
    if (not isinstance(engine.runner.step, FusedForward)
            or engine.runner.weight_format not in expected):
        raise SystemExit(f"{fmt}: needs the fused CPU forward (Llama family, C kernels)")
    start = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    engine.block_manager.reset_prefix_cache()
    nll, count = 0.0, 0
    for i in range(0, len(text_ids) - 1, args.window):
        window = text_ids[i:i + args.window]
        if len(window) > 1:
            nll += window_nll(engine, window)
            count += len(window) - 1
    return {"format": fmt, "outputs": outputs, "perplexity": math.exp(nll / count),
            "scored_tokens": count, "seconds": time.perf_counter() - start}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    same = sum(o == r for o, r in zip(outputs, reference))
    prefix = []
    for o, r in zip(outputs, reference):
        k = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        prefix.append(k / len(r))
    return {"identical_outputs": same / len(reference),
            "tokens_before_first_difference": sum(prefix) / len(prefix)}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from benchmarks.stack import cpu_model
    from common.model_files import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
               for p in PROMPTS[:args.num_prompts]]
    text_ids = tok(reference_text())["input_ids"][:args.text_tokens]
    formats = (args.formats or "float32,bfloat16,int8,q4" + (
        ",gguf" if args.model is None or args.gguf else "")).split(",")
    if formats[0] != "float32":
        formats.insert(0, "float32")
    results = [measure(fmt, args, prompts, text_ids, "float32" if i == 0 else args.kv_cache_dtype)
               for i, fmt in enumerate(formats)]
    reference = results[0]["outputs"]
    report = {"cpu": cpu_model(), "model": str(model_dir), "python": platform.python_version(),
              "prompts": len(prompts), "max_tokens": args.max_tokens,
              "prompt_token_ids": prompts, "window": args.window,
              "kv_cache_dtype": args.kv_cache_dtype,
              "text": f"pydoc_data.topics (Python {platform.python_version()}), first "
                      f"{len(text_ids)} tokens, windows of {args.window}",
              "formats": []}
    print(f"CPU: {cpu_model()}; {report['text']}; {len(prompts)} chat prompts x "
          f"{args.max_tokens} greedy tokens")
    print("weights    perplexity  (vs float32)  identical outputs  tokens before first difference")
    for r in results:
        row = {"format": r["format"], "perplexity": r["perplexity"],
               "perplexity_ratio": r["perplexity"] / results[0]["perplexity"],
               "scored_tokens": r["scored_tokens"], "outputs": r["outputs"],
               **agreement(r["outputs"], reference)}
        report["formats"].append(row)
        print(f"{row['format']:9}  {row['perplexity']:10.3f}  {row['perplexity_ratio']:12.4f}  "
              f"{100 * row['identical_outputs']:16.1f}%  "
              f"{100 * row['tokens_before_first_difference']:29.1f}%")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
