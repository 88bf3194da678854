"""The engine on a GPU against Hugging Face and against its roofline, in one run.

    python benchmarks/engine.py --device cuda --load-format dummy --model-config llama-3-8b
    python benchmarks/engine.py --device cuda --load-format dummy --model-config smollm2-135m \\
        --concurrency 1 --json docs/bench/gpu-smollm2.json

(benchmarks/engine.py hands ``--device cuda`` to this module.) For each concurrency
(default 1, 64, 256) it runs that many requests of --input-len random prompt tokens and
--output-len generated tokens (ignore_eos) through the in-process engine and reports
output tokens/s; then Hugging Face ``generate`` in the same dtype with SDPA attention,
on the same weights (copied from the engine's model) and the same prompts, at batch 1
and 64 (--hf-batches); TTFT at one stream (a prompt's first token, median of 5).

The roofline is measured in the same run, once: the bandwidth of a read-only pass over
4 GiB (a sum) and the best matmul rate at the model's own linear-layer shapes with
8192 rows, in the weights' format (fp8 through torch._scaled_mm). A run's floor is the
sum over its steps of max(bytes / bandwidth, FLOPs / rate): a prefill step reads the
weights once and does 2 x weights x tokens FLOPs, but the lm_head's only for the rows
that sample (a prompt's last); a decode step of B sequences reads the weights and
every sequence's keys and values, and does 2 x weights x B FLOPs. Of the embedding
table a step reads its tokens' rows, not the table (unless the lm_head is tied to it).
The fraction printed is floor / measured; beside it, the same floor from the device's
spec sheet (SPEC_SHEETS: an H200's 4.8 TB/s and 989 TFLOP/s dense bf16), where known.

Beside the equal-arrival greedy runs, at the largest concurrency up to 64 (--workloads):
staggered arrivals (Poisson, by engine steps, a mean gap that keeps that many in
flight; prompt and output lengths uniform in half to one and a half times theirs) and
top-p 0.95 sampling with a repetition penalty of 1.1, each as tokens/s and as a ratio
to the greedy run's. Hugging Face ``generate`` runs with its default dynamic cache and
(--hf-static-compile) with a static cache and torch.compile.

It runs on any device (CI smoke-tests it on a CPU with a tiny model); the figures the
docs quote come from an H100.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.engine import random_prompts, run_engine  # noqa: E402
from common.config import (KV_CACHE_DTYPES, CacheConfig, EngineConfig,  # noqa: E402
                           SchedulerConfig)
from common.protocol import SamplingParams  # noqa: E402
from engine_worker.gpu.compile_check import compiled_kernels  # noqa: E402
from engine_worker.gpu.graphs import GraphForward  # noqa: E402
from engine_worker.models.layers.moe import MoE  # noqa: E402


# Spec sheets, by a fragment of the device's name: (memory bandwidth in bytes/s, dense
# bfloat16 FLOP/s, dense fp8 FLOP/s) (SXM parts)
SPEC_SHEETS = {"H200": (4.8e12, 989e12, 1979e12), "H100": (3.35e12, 989e12, 1979e12)}


def spec_sheet(device_name: str) -> Optional[tuple[float, float, float]]:
    """The SXM parts' (not a PCIe card's, nor a Grace Hopper's)."""
    if "PCIe" in device_name or "GH200" in device_name:
        return None
    return next((v for k, v in SPEC_SHEETS.items() if k in device_name), None)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The device and model arguments of the GPU benchmarks (this and gpu_profile.py)."""
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-config", default="llama-3-8b",
                   help="a shipped model shape (common/model_configs) or a model directory")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batches", default="1,64", help="HF generate batch sizes ('' skips)")
    p.add_argument("--hf-static-compile", action="store_true",
                   help="HF generate also with a static cache and torch.compile")
    p.add_argument("--hf-compile-backend", default="inductor",
                   help="torch.compile's backend for --hf-static-compile (eager: tests)")
    p.add_argument("--workloads", action=argparse.BooleanOptionalAction, default=True,
                   help="staggered arrivals and top-p sampling beside the greedy runs")
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's run-ahead (default: on with CUDA)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 5, iters: int = 1) -> float:
    """Median seconds of a call of fn() after a warm-up, over repeats runs of iters
    calls."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def graph_timed(fn, device: torch.device, repeats: int = 5, iters: int = 1) -> float:
    """timed()'s figure for fn() replayed from a CUDA graph of iters calls, as the
    engine replays its steps: without the host's launch cost (about 30 us a Triton
    kernel, longer than a decode kernel at batch 64). Off CUDA, timed()'s."""
    if device.type != "cuda":
        return timed(fn, device, repeats, iters)
    fn()  # compiles
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return timed(graph.replay, device, repeats) / iters


def read_bandwidth(device: torch.device, size: int) -> float:
    """Bytes/s of a read-only pass over ``size`` bytes (a sum: its writes are nothing)."""
    x = torch.ones(size // 4, dtype=torch.float32, device=device)
    return x.numel() * 4 / timed(lambda: x.sum(), device)


def _mlp_shapes(mlp) -> list:
    """The weight shapes of an MLP's projections; a mixture's, one expert's."""
    if isinstance(mlp, MoE):
        if mlp.grouped is not None:
            return [mlp.grouped.gate_up.shape[1:], mlp.grouped.down.shape[1:]]
        mlp = mlp.experts[0]
    return [mlp.gate_up_proj.weight.shape, mlp.down_proj.weight.shape]


def gemm_rate(model, dtype: torch.dtype, device: torch.device, rows: int) -> float:
    """The best FLOP/s of a matmul at the model's linear-layer shapes (one layer's,
    lm_head included; a mixture's experts at one expert's) with ``rows`` rows, in the
    format of each layer's weights (fp8: torch._scaled_mm, row-wise scales)."""
    layer = model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    shapes = [(m.weight.shape, m.fmt == "fp8") for m in linears]
    shapes += [(shape, False) for shape in _mlp_shapes(layer.mlp)] if isinstance(
        layer.mlp, MoE) else [(m.weight.shape, m.fmt == "fp8")
                              for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    head = model.lm_head.weight if model.lm_head.weight is not None else model.embeddings.weight
    shapes.append((head.shape, False))
    best = 0.0
    for (n, k), fp8 in shapes:
        x = torch.randn(rows, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        if fp8:
            xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            sx = torch.ones(rows, 1, device=device)
            sw = torch.ones(1, n, device=device)
            fn = lambda: torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw,  # noqa: E731
                                          out_dtype=dtype)
        else:
            fn = lambda: x @ w.T  # noqa: E731
        best = max(best, 2 * rows * n * k / timed(fn, device))
    return best


def ttft(engine, prompt: list[int]) -> float:
    """Seconds from add_request to the step that yields the first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(6):
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", [(t + i) % engine.vocab_size for t in prompt], params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def hf_model_with_engine_weights(ours, cfg, model_dir, device, dtype):
    """A transformers model of the same config and dtype, SDPA attention, holding the
    weights of the engine's model ``ours`` (q/k/v and gate/up split back out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens.weight)
        for mine, theirs in zip(ours.layers, hf.model.layers):
            wq, wk, wv = mine.self_attn.qkv_proj.weight.split([q, kv, kv])
            theirs.self_attn.q_proj.weight.copy_(wq)
            theirs.self_attn.k_proj.weight.copy_(wk)
            theirs.self_attn.v_proj.weight.copy_(wv)
            if cfg.qkv_bias:
                bq, bk, bv = mine.self_attn.qkv_proj.bias.split([q, kv, kv])
                theirs.self_attn.q_proj.bias.copy_(bq)
                theirs.self_attn.k_proj.bias.copy_(bk)
                theirs.self_attn.v_proj.bias.copy_(bv)
            theirs.self_attn.o_proj.weight.copy_(mine.self_attn.o_proj.weight)
            gate, up = mine.mlp.gate_up_proj.weight.chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(mine.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(mine.input_layernorm.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.post_attention_layernorm.weight)
        hf.model.norm.weight.copy_(ours.norm.weight)
        if not cfg.tie_word_embeddings:
            hf.lm_head.weight.copy_(ours.lm_head.weight)
    return hf.eval()


@torch.inference_mode()
def run_hf(model, prompts, output_len: int, device: torch.device) -> dict:
    batch = torch.tensor(prompts, device=device)  # equal lengths: no padding
    sync(device)
    start = time.perf_counter()
    out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                         max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    sync(device)
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return {"seconds": elapsed, "output_tokens": generated, "tokens_per_s": generated / elapsed}


def weight_reads(model, cfg) -> Callable[[int], float]:
    """Bytes of weights a step of so many tokens reads: all, but of the embedding table
    its tokens' rows (the table whole where the lm_head is tied to it), and of a
    mixture's experts those its tokens choose, E (1 - (1 - k / E)^tokens) of E expected
    where the routing is uniform (as random weights route, near enough): a decode step
    of one token reads 8 of Qwen3-30B-A3B's 128 experts a layer, one of 64 tokens 124
    of them."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embeddings.weight
    row = table.shape[1] * table.element_size()
    if not cfg.tie_word_embeddings:
        total -= table.numel() * table.element_size()
    else:
        row = 0
    experts = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, MoE)
                  for p in (m.grouped or m.experts).parameters())
    share = cfg.experts_per_token / cfg.num_experts if experts else 0.0
    return lambda tokens: (total - experts + experts * (1 - (1 - share) ** tokens)
                           + row * tokens)


def run_floor(cfg, weight_bytes: Callable[[int], float], kv_bytes_per_token: int,
              concurrency: int, input_len: int, output_len: int, budget: int,
              bandwidth: float, rate: float) -> float:
    """Seconds the run cannot beat: prefill in steps of the token budget, then
    output_len - 1 decode steps of `concurrency` sequences. FLOPs: a mixture's, those
    of the experts a token runs; the lm_head's, those of the rows that sample (a
    prompt's last token; every decode row)."""
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    flops_per_token = cfg.flops_per_token
    prompt_tokens = concurrency * input_len
    seconds = 0.0
    for start in range(0, prompt_tokens, budget):
        tokens = min(budget, prompt_tokens - start)
        # prompts ending in this chunk: their last tokens sample
        sampled = (start + tokens) // input_len - start // input_len
        flops = (flops_per_token - lm_head) * tokens + lm_head * sampled
        seconds += max(weight_bytes(tokens) / bandwidth, flops / rate)
    for step in range(1, output_len):
        context = input_len + step
        step_bytes = weight_bytes(concurrency) + concurrency * context * kv_bytes_per_token
        seconds += max(step_bytes / bandwidth, flops_per_token * concurrency / rate)
    return seconds


def run_staggered(engine, prompts: list[list[int]], output_lens: list[int],
                  gaps: list[int], params: SamplingParams) -> dict:
    """Requests added ``gaps`` engine steps apart (steps go on without idling: where
    none is running the next arrives at once); tokens/s from the first arrival to the
    last finish."""
    start = time.perf_counter()
    pending = list(range(len(prompts)))
    wait, generated, steps = 0, 0, 0
    while pending or engine.has_unfinished_requests():
        if pending and (wait <= 0 or not engine.has_unfinished_requests()):
            i = pending.pop(0)
            engine.add_request(f"stagger-{time.monotonic_ns()}-{i}", prompts[i],
                               msgspec.structs.replace(params, max_tokens=output_lens[i]))
            wait = gaps[i]
            continue
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
        wait -= 1
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": generated, "steps": steps,
            "tokens_per_s": generated / elapsed}


def workloads(engine, cfg, concurrency: int, input_len: int, output_len: int, seed: int,
              greedy_tokens_per_s: float) -> dict:
    """The staggered and top-p runs at ``concurrency`` (the module docstring)."""
    import random

    rng = random.Random(seed)
    n = 4 * concurrency
    lens = [max(1, round(input_len * rng.uniform(0.5, 1.5))) for _ in range(n)]
    outs = [max(2, round(output_len * rng.uniform(0.5, 1.5))) for _ in range(n)]
    prompts = [random_prompts(1, length, cfg.vocab_size, seed + 1000 + i)[0]
               for i, length in enumerate(lens)]
    mean_gap = output_len / concurrency   # a request lives about output_len steps
    gaps = [round(rng.expovariate(1 / mean_gap)) for _ in range(n)]
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    staggered = run_staggered(engine, prompts, outs, gaps, greedy)
    sampled = SamplingParams(max_tokens=output_len, temperature=0.8, top_p=0.95,
                             repetition_penalty=1.1, ignore_eos=True, seed=seed)
    run_engine(engine, prompts[:2], 4, msgspec.structs.replace(sampled, max_tokens=4))  # warm-up
    top_p = run_engine(engine, random_prompts(concurrency, input_len, cfg.vocab_size, seed + 5),
                       output_len, sampled)
    return {name: {"tokens_per_s": run["tokens_per_s"],
                   "vs_greedy": run["tokens_per_s"] / greedy_tokens_per_s,
                   "concurrency": concurrency, "requests": n if name == "staggered"
                   else concurrency, "output_tokens": run["output_tokens"]}
            for name, run in (("staggered", staggered), ("top_p", top_p))}


def main(argv=None) -> int:
    args = parse_args(argv)
    from common.model_files import resolve_model_dir
    from engine_worker.engine import LLMEngine

    concurrencies = [int(c) for c in args.concurrency.split(",")]

    def save(report: dict) -> None:
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")

    engine = LLMEngine(EngineConfig(
        model=str(resolve_model_dir(args.model_config)), device=args.device, dtype=args.dtype,
        load_format=args.load_format, seed=args.seed, enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        # (the staggered workload's lengths run to 1.5 times these)
        max_model_len=(args.input_len + args.output_len) * 3 // 2 + 8,
        cache=CacheConfig(kv_cache_memory_bytes=None if args.kv_cache_memory_gb is None
                          else int(args.kv_cache_memory_gb * 2**30),
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_batch_size=max(concurrencies),
                                  max_num_batched_tokens=args.max_num_batched_tokens)))
    device, cfg, runner = engine.device, engine.model_config, engine.runner
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; model: {args.model_config} ({cfg.num_params / 1e9:.2f}B params, "
          f"{runner.weight_format} weights, computing in "
          f"{str(runner.dtype).removeprefix('torch.')}, {args.load_format} weights, "
          f"KV cache {str(runner.kv_dtype).removeprefix('torch.')}); "
          f"graphs: {isinstance(runner.step, GraphForward)}; run-ahead: {engine.async_scheduling}; "
          f"{args.input_len} in / {args.output_len} out", flush=True)

    element = torch.empty((), dtype=runner.kv_dtype).element_size()
    weight_bytes = weight_reads(runner.model, cfg)
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element
    bandwidth = read_bandwidth(device, 4 << 30 if device.type == "cuda" else 64 << 20)
    rate = gemm_rate(runner.model, runner.dtype, device,
                     8192 if device.type == "cuda" else 64)
    budget = engine.scheduler.token_budget
    spec = spec_sheet(name)
    spec_rate = spec and (spec[2] if runner.weight_format == "fp8" else spec[1])
    print(f"roofline: read bandwidth {bandwidth / 1e12:.2f} TB/s; best matmul at the model's "
          f"shapes {rate / 1e12:.1f} TFLOP/s"
          + (f" (spec sheet: {spec[0] / 1e12:.2f} TB/s, {spec_rate / 1e12:.0f} TFLOP/s)"
             if spec else ""), flush=True)

    report = {"device": name, "model": args.model_config, "dtype": str(runner.dtype),
              "weight_format": runner.weight_format, "kv_cache_dtype": str(runner.kv_dtype),
              "load_format": args.load_format, "input_len": args.input_len,
              "output_len": args.output_len, "cuda_graphs": isinstance(runner.step, GraphForward),
              "async_scheduling": engine.async_scheduling,
              "bandwidth_bytes_per_s": bandwidth, "gemm_flops_per_s": rate,
              "tokens_per_s": {}, "floor_fraction": {}, "spec_fraction": {},
              "hf_tokens_per_s": {}, "hf_static_compile_tokens_per_s": {}, "runs": {}}
    capacity = runner.num_blocks * runner.block_size
    report["kv_capacity_tokens"] = capacity
    report["max_streams_4k"] = capacity // 4096
    print(f"KV cache: {capacity} tokens ({capacity // 4096} streams of 4,096 tokens of "
          f"context)", flush=True)
    run_engine(engine, random_prompts(2, args.input_len, cfg.vocab_size, args.seed + 99), 4)
    compiled = compiled_kernels()
    for c in concurrencies:
        prompts = random_prompts(c, args.input_len, cfg.vocab_size, args.seed + c)
        result = run_engine(engine, prompts, args.output_len)
        floor = run_floor(cfg, weight_bytes, kv_bytes_per_token, c, args.input_len,
                          args.output_len, budget, bandwidth, rate)
        report["tokens_per_s"][str(c)] = result["tokens_per_s"]
        report["floor_fraction"][str(c)] = floor / result["seconds"]
        report["runs"][str(c)] = {**result, "floor_seconds": floor}
        shown = ""
        if spec:
            spec_floor = run_floor(cfg, weight_bytes, kv_bytes_per_token, c, args.input_len,
                                   args.output_len, budget, spec[0], spec_rate)
            report["spec_fraction"][str(c)] = spec_floor / result["seconds"]
            shown = f"; of the spec sheet's {spec_floor / result['seconds']:.0%}"
        print(f"engine, {c:4d} streams: {result['tokens_per_s']:10.1f} output tokens/s "
              f"({result['seconds']:.2f} s, floor {floor:.2f} s: "
              f"{floor / result['seconds']:.0%} of it{shown})", flush=True)
        save(report)   # (what it has, should a time limit stop the run)
    # Kernel compiles while serving stall every request (about a second each).
    report["kernels_compiled_while_serving"] = compiled_kernels() - compiled
    print(f"Triton kernels compiled during the runs: "
          f"{report['kernels_compiled_while_serving']}", flush=True)
    report["ttft_ms_one_stream"] = 1e3 * ttft(
        engine, random_prompts(1, args.input_len, cfg.vocab_size, args.seed + 7)[0])
    print(f"TTFT at one stream ({args.input_len}-token prompt): "
          f"{report['ttft_ms_one_stream']:.2f} ms", flush=True)
    if args.workloads:
        c = max(x for x in concurrencies if x <= 64)
        report["workloads"] = workloads(engine, cfg, c, args.input_len, args.output_len,
                                        args.seed, report["tokens_per_s"][str(c)])
        save(report)
        for kind, figures in report["workloads"].items():
            print(f"{kind}, {c} streams: {figures['tokens_per_s']:10.1f} output tokens/s "
                  f"({figures['vs_greedy']:.2f}x greedy with every request at once)",
                  flush=True)

    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    if hf_batches and cfg.moe_layers:
        print("HF generate: not run for a mixture of experts (its experts' layout "
              "differs between transformers versions)", flush=True)
        hf_batches = []
    if hf_batches and runner.weight_format == "fp8":
        print("HF generate: not run on fp8 weights (the bf16 run is its comparison)",
              flush=True)
        hf_batches = []
    if hf_batches:
        # The engine is done: all but its weights go (its KV cache, which the KV
        # transfer store also holds, and its CUDA graphs take most of the GPU, which
        # HF's weights and cache need: an H200 ran out of memory at batch 64).
        model, model_dir, dtype = runner.model, engine.model_dir, runner.dtype
        del engine, runner
        gc.collect()
        torch.cuda.empty_cache()
        hf = hf_model_with_engine_weights(model, cfg, model_dir, device, dtype)
        del model
        runs = [("hf_tokens_per_s", "HF generate")]
        if args.hf_static_compile:
            runs.append(("hf_static_compile_tokens_per_s",
                         "HF generate, static cache + torch.compile"))
        for key, label in runs:
            if key != "hf_tokens_per_s":   # the same model, its cache static and compiled
                hf.generation_config.cache_implementation = "static"
                hf.forward = torch.compile(hf.forward, backend=args.hf_compile_backend,
                                           **({"mode": "reduce-overhead"}
                                              if args.hf_compile_backend == "inductor" else {}))
            for b in hf_batches:
                prompts = random_prompts(b, args.input_len, cfg.vocab_size, args.seed + b)
                # warm-up; a static cache's at the timed length (its size, and so the
                # compiled graph, depends on it)
                run_hf(hf, prompts, args.output_len if key != "hf_tokens_per_s" else 4, device)
                result = run_hf(hf, prompts, args.output_len, device)
                report[key][str(b)] = result["tokens_per_s"]
                ours = report["tokens_per_s"].get(str(b))
                ratio = f" (engine {ours / result['tokens_per_s']:.1f}x)" if ours else ""
                print(f"{label}, batch {b:4d}: {result['tokens_per_s']:10.1f} output "
                      f"tokens/s{ratio}", flush=True)
        del hf
    save(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
