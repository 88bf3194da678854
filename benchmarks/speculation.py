"""N-gram speculation's speed (--speculative-tokens): the in-process engine with and
without it, side by side in one run, on chat replies that copy their prompt (a passage
repeated, a function edited) and on a free one.

    python benchmarks/speculation.py --json docs/bench/speculation.json
    python benchmarks/speculation.py --speculative-tokens 2,4,8 --quantization int8

Each round runs every engine on the same requests (greedy, the model's own ends, up
to --max-tokens), alternating, and checks that their outputs are the same token for
token (with --temperature, sampled requests: not checked, they differ run to run). Prints output tokens/s, the ratio to the engine without speculation (medians
of the rounds), the share of proposed tokens kept and the tokens a request gained per
step, per task and concurrency, with the CPU named.
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
from common.config import QUANTIZATIONS, EngineConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402

PASSAGE = (
    "The lighthouse stood at the end of the rocky point, its white tower streaked with "
    "salt. Every evening the keeper climbed the one hundred and twelve steps, trimmed "
    "the wick, polished the great lens and wound the clockwork that turned it. Ships "
    "passing in the night saw its beam sweep the water every ten seconds, and knew "
    "where the reef began. In winter the storms came from the north, and the keeper "
    "wrote in the log the height of the waves, the direction of the wind and the names "
    "of the ships that passed.")
CODE = '''def moving_average(values, window):
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
TASKS = {
    "copy": "Repeat the following text exactly, word for word:\n\n" + PASSAGE,
    "edit": "Rename the function below to rolling_mean and give it type hints. Change "
            "nothing else and answer with the whole function:\n\n" + CODE,
    "free": "Write a short story about a lighthouse keeper.",
}


def chat_prompt(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)


def run(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, dict]:
    before = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return outputs, elapsed, {
        "drafted": after.num_draft_tokens - before.num_draft_tokens,
        "accepted": after.num_accepted_tokens - before.num_accepted_tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--speculative-tokens", default="4", help="K values, comma-separated")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="above 0: sampled requests (no seed), whose outputs differ from "
                        "run to run; the same-output check is then skipped")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="auto", help="bfloat16: bfloat16 weights")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir
    from engine_worker.engine import LLMEngine

    torch.set_num_threads(args.threads)
    ks = [0] + [int(k) for k in args.speculative_tokens.split(",")]
    engines = {k: LLMEngine(EngineConfig(model=args.model, device="cpu", speculative_tokens=k,
                                         num_threads=args.threads,
                                         quantization=args.quantization, dtype=args.dtype))
               for k in ks}
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    prompts = {name: chat_prompt(tokenizer, text) for name, text in TASKS.items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    greedy = params.greedy
    print(f"CPU: {cpu_model()}; SIMD: {' '.join(simd_flags()) or 'none reported'}; "
          f"{args.threads} threads; {engines[0].model_config.name}, "
          f"{engines[0].runner.weight_format} weights")
    for engine in engines.values():  # warm-up: kernels, allocations
        engine.generate([prompts["free"]], SamplingParams(max_tokens=8, temperature=0.0))

    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for task, prompt in prompts.items():
            batch = [prompt] * concurrency
            rates: dict[int, list[float]] = {k: [] for k in ks}
            counts: dict[int, dict] = {k: {"drafted": 0, "accepted": 0, "tokens": 0}
                                       for k in ks}
            same = True
            for _ in range(args.repeats):
                reference = None
                for k, engine in engines.items():
                    outputs, elapsed, spec = run(engine, batch, params)
                    tokens = sum(len(o) for o in outputs)
                    rates[k].append(tokens / elapsed)
                    spec["tokens"] = tokens
                    for key in spec:
                        counts[k][key] += spec[key]
                    if reference is None:
                        reference = outputs
                    same = same and (not greedy or outputs == reference)
            base = statistics.median(rates[0])
            for k in ks[1:]:
                ratios = [r / b for r, b in zip(rates[k], rates[0])]
                drafted, accepted = counts[k]["drafted"], counts[k]["accepted"]
                total = counts[k]["tokens"]  # over the rounds
                rows.append({
                    "task": task, "concurrency": concurrency, "k": k,
                    "output_tokens": round(total / args.repeats),
                    "tokens_per_s_off": round(base, 1),
                    "tokens_per_s_on": round(statistics.median(rates[k]), 1),
                    "ratio": round(statistics.median(ratios), 3),
                    "ratios": [round(r, 3) for r in ratios],
                    "accepted_share": round(accepted / drafted, 3) if drafted else 0.0,
                    "tokens_per_step": round(total / (total - accepted) if total else 1.0, 2),
                    "same_output": same if greedy else None})
    print(f"{'task':6} {'streams':>7} {'K':>3} {'tokens':>6} {'off tok/s':>9} "
          f"{'on tok/s':>9} {'ratio':>6} {'kept':>6} {'tok/step':>8} same")
    for r in rows:
        print(f"{r['task']:6} {r['concurrency']:>7} {r['k']:>3} {r['output_tokens']:>6} "
              f"{r['tokens_per_s_off']:>9} {r['tokens_per_s_on']:>9} {r['ratio']:>6} "
              f"{r['accepted_share']:>6} {r['tokens_per_step']:>8} {r['same_output']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "cpu": cpu_model(), "threads": args.threads, "model": engines[0].model_config.name,
            "weights": engines[0].runner.weight_format, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["same_output"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
