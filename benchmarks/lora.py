"""LoRA adapters' cost: streams spread over several adapters against the same streams
on the base model, in one run (the in-process engine).

    python benchmarks/lora.py                      # default model, 8 streams, 4 adapters
    python benchmarks/lora.py --rank 16 --streams 8 --adapters 4 --json docs/bench/lora.json

Makes --adapters random LoRA adapters (rank --rank, alpha 2 x rank, on q, k, v, o,
gate, up and down: PEFT's layout) for the model, loads them into one engine, and runs
--streams greedy requests of --input-len prompt and --output-len output tokens at once:
on the base model, then spread over the adapters round-robin, --repeats times taking
turns. Prints output tokens/s of each (medians) and their ratio (the median of the
pairs'), and checks that every adapter changed its requests' tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402

MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def make_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random LoRA adapter for ``cfg``'s layers, as PEFT saves one."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    d, kv = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.num_heads * d, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size),
              "v_proj": (kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.num_heads * d),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, names in MODULES.items():
            for name in names:
                out, inp = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.05
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [n for names in MODULES.values() for n in names]}))


def run(engine, prompts, names, output_len: int) -> tuple[float, list[list[int]]]:
    """Greedy, each prompt with its adapter (None: the base model)."""
    from benchmarks.engine_steps import timed_generate

    return timed_generate(engine, prompts, [SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, adapter=name)
        for name in names])


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.stack import cpu_model
    from common.model_files import resolve_model_dir
    from engine_worker.engine import LLMEngine
    from engine_worker.models.registry import load_model_config

    cfg = load_model_config(resolve_model_dir(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="rs-lora-"))
    names = [f"lora{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        make_adapter(tmp / name, cfg, args.rank, i)
    engine = LLMEngine(EngineConfig(
        model=args.model, device="cpu", num_threads=args.threads,
        lora_modules=tuple((n, str(tmp / n)) for n in names), max_loras=args.adapters,
        max_lora_rank=args.rank, cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_batch_size=args.streams)))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(args.input_len)]
               for _ in range(args.streams)]
    spread = [names[i % len(names)] for i in range(args.streams)]
    base_names = [None] * args.streams
    run(engine, prompts[:2], base_names[:2], 4)   # warm-up
    run(engine, prompts[:2], spread[:2], 4)
    pairs, changed = [], True
    n = args.streams * args.output_len
    for _ in range(args.repeats):
        t_base, base_tokens = run(engine, prompts, base_names, args.output_len)
        t_lora, lora_tokens = run(engine, prompts, spread, args.output_len)
        changed &= all(a != b for a, b in zip(base_tokens, lora_tokens))
        pairs.append((n / t_base, n / t_lora))
    ratios = [lo / b for b, lo in pairs]
    result = {"cpu": cpu_model(), "model": cfg.name, "threads": args.threads,
              "streams": args.streams, "adapters": args.adapters, "rank": args.rank,
              "input_len": args.input_len, "output_len": args.output_len,
              "base_tokens_per_s": [b for b, _ in pairs],
              "lora_tokens_per_s": [lo for _, lo in pairs], "ratios": ratios,
              "ratio": statistics.median(ratios), "adapters_changed_tokens": changed}
    print(f"CPU: {result['cpu']}; model: {cfg.name}, {args.threads} threads; "
          f"{args.streams} streams x {args.output_len} tokens")
    print(f"base model: {statistics.median(result['base_tokens_per_s']):.1f} tok/s; over "
          f"{args.adapters} adapters of rank {args.rank}: "
          f"{statistics.median(result['lora_tokens_per_s']):.1f} tok/s -> "
          f"{result['ratio']:.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"adapters changed every stream's tokens: {changed}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_path}")
    return 0 if changed else 1


if __name__ == "__main__":
    raise SystemExit(main())
