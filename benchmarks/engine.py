"""In-process engine throughput against Hugging Face transformers, in one run.

    python benchmarks/engine.py                       # SmolLM2-135M, 64 x 128 tokens
    python benchmarks/engine.py --shared-prefix 256 --json bench-engine.json
    python benchmarks/engine.py --zmq --skip-hf      # + through the engine process
    python benchmarks/engine.py --roofline --skip-hf # decode steps against their floor
    python benchmarks/engine.py --quantization int8  # (or --dtype bfloat16) weight formats
    python benchmarks/engine.py --long-context 512,2048,4096 --skip-hf  # long prompts
    python benchmarks/engine.py --device cuda --load-format dummy --model-config llama-3-8b

With --device cuda, benchmarks/engine_gpu.py runs instead (its own flags and report:
concurrency 1/64/256, HF generate in bf16, the GPU roofline, TTFT); with
--tensor-parallel-size N, benchmarks/engine_tp.py (an engine split over N ranks against
one that is not, at batch 1, 8 and 64).

Runs the engine on a workload of random token-id prompts (all forced to their full
output length), then Hugging Face ``generate`` on the same weights and prompts at
batch 8 and at the engine's concurrency, and measures this machine's fp32 matmul
FLOP/s. Prints the CPU and its SIMD features, output tokens/s for each, the ratios,
and the engine's fraction of a square-GEMM bound: a square 1024^3 matmul's FLOP/s
divided by the model's FLOPs per token (2 x weights). That bound is not a roofline (it
ignores memory bandwidth, which decides small batches, and the model's own shapes).

--roofline measures the real one, in the same run: this machine's memory read
bandwidth (right before and right after each batch's steps, the better of the two: a
VM's moves with its neighbours' load), and the best GEMM rate it reaches for the weight format: the engine's
kernel on the model's own layers at 256 rows and on a 1024^3 weight, and torch's
1024^3 matmul in that arithmetic (float32; bfloat16, which oneDNN runs on AMX or
AVX-512-BF16 where present; int8 x int8 for int8 and 4-bit); it prints which one set the
floor. A decode step at batch B must read every weight and its sequences' keys and
values, and do 2 x weights x B FLOPs, so its floor is the larger of bytes / bandwidth
and FLOPs / GEMM rate. For batch 1, 8 and 64 (--roofline-batches) it times 32 steps
that decode the whole batch, after its prompts are in, prints the fraction
of the floor they reach and where a step's time goes (linear layers, attention and the
other C work inside the fused forward, the Python that prepares it, sampling, and the
rest of the engine step).

--long-context runs one request alone per prompt length: the time to its first token
(its prefill, in chunks of the engine's token budget) and then its decode steps at that
context, each split into linear layers, attention and the rest of the fused forward.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Optional
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.config import (CacheConfig, EngineConfig, QUANTIZATIONS,  # noqa: E402
                           SchedulerConfig)
from common.protocol import SamplingParams  # noqa: E402
from benchmarks.engine_steps import (long_context, matmul_flops, print_long_context,  # noqa: E402
                                      print_roofline, roofline, roofline_batches)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=64)
    # Short prompts, as in the seeds' streaming benchmark ("Hello" x 64 requests x 128
    # tokens): the figure is decode throughput. --input-len 32 or more adds prefill.
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="leading prompt tokens common to every request (prefix-cache workload)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="engine decode batch (default: --num-requests)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--hf-batch-sizes", default="8,same",
                   help="comma-separated HF generate batch sizes; 'same' = engine concurrency")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--repeats", type=int, default=3,
                   help="engine runs (medians are reported)")
    p.add_argument("--zmq", action="store_true",
                   help="also run the workload through an engine worker process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="engine --dtype (bfloat16: bf16 weights)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    p.add_argument("--roofline", action="store_true",
                   help="also measure decode steps at --roofline-batches against their floor")
    p.add_argument("--roofline-batches", default="1,8,64")
    p.add_argument("--long-context", default=None, metavar="LENGTHS",
                   help="comma-separated prompt lengths: per length one request's prefill "
                        "and its decode steps at that context (--output-len tokens)")
    p.add_argument("--against-float32", action="store_true",
                   help="also run a float32 engine on the same workload, its runs "
                        "alternating with this one's, and print the throughput ratio")
    p.add_argument("--kernel-isa", choices=["native", "avx2"], default="native",
                   help="avx2: build the C kernels as for an AVX2-only CPU, without "
                        "AVX-512 or AVX-VNNI (to measure that path on an AVX-512 machine)")
    p.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    return p.parse_args(argv)


def random_prompts(num: int, length: int, vocab_size: int, seed: int,
                   shared_prefix: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids, the first ``shared_prefix`` of
    them common to all."""
    rng = random.Random(seed)
    # Avoid the lowest ids, which are special tokens in most vocabularies.
    draw = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]  # noqa: E731
    prefix = draw(min(shared_prefix, length))
    return [prefix + draw(length - len(prefix)) for _ in range(num)]


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    return random_prompts(args.num_requests, args.input_len, vocab_size, args.seed,
                          args.shared_prefix)


STAT_FIELDS = ("num_prompt_tokens_computed", "prefix_cache_hit_tokens", "num_preemptions")


def run_engine(engine, prompts, output_len: int,
               params: Optional[SamplingParams] = None) -> dict:
    """Every prompt at once, greedy unless ``params`` say otherwise."""
    params = params or SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    steps, generated = 0, 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return {"seconds": elapsed, "output_tokens": generated, "steps": steps,
            "tokens_per_s": generated / elapsed,
            **{f: getattr(after, f) - getattr(before, f) for f in STAT_FIELDS}}


def start_engine_process(args, concurrency: int, address: str):
    import subprocess

    # The same engine as the in-process one: its weight format too (it was left out,
    # and --zmq --quantization int8 compared int8 in process with float32 over ZeroMQ).
    cmd = [sys.executable, "-m", "engine_worker", "--device", "cpu", "--bind", address,
           "--threads", str(args.threads), "--max-batch-size", str(concurrency),
           "--block-size", str(args.block_size), "--kv-cache-dtype", args.kv_cache_dtype,
           "--dtype", args.dtype, "--log-level", "WARNING"]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_prefix_cache:
        cmd += ["--no-prefix-cache"]
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent)


async def _run_zmq(client, prompts, output_len: int, tag: str) -> dict:
    import asyncio

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt) -> int:
        n = 0
        async for out in client.generate(f"{tag}-{i}", prompt, params):
            n += len(out.new_token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": sum(counts),
            "tokens_per_s": sum(counts) / elapsed}


def frame_cost(batch: int = 64, iterations: int = 2000) -> dict:
    """Size and encode+decode time of one step's OutputBatch for ``batch`` requests."""
    from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, Codec, OutputBatch,
                                 RequestOutput)

    engine_side = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)  # encodes what engines send
    client_side = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)  # decodes it
    batch_msg = OutputBatch(outputs=[RequestOutput(request_id=f"cmpl-{i:032x}",
                                                   new_token_ids=[12345 + i])
                                     for i in range(batch)])
    frames = engine_side.encode(batch_msg)
    assert client_side.decode(frames) == batch_msg
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iterations):
            client_side.decode(engine_side.encode(batch_msg))
        times.append((time.perf_counter() - start) / iterations)
    return {"batch": batch, "frame_bytes": sum(len(f) for f in frames),
            "encode_decode_us": statistics.median(times) * 1e6}


@torch.inference_mode()
def run_hf(model, prompts, output_len: int, batch_size: int) -> dict:
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i:i + batch_size])  # equal lengths: no padding
        out = model.generate(batch, attention_mask=torch.ones_like(batch),
                             max_new_tokens=output_len, do_sample=False, pad_token_id=0)
        generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": generated, "batch_size": batch_size,
            "tokens_per_s": generated / elapsed}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="cpu")
    device.add_argument("--tensor-parallel-size", type=int, default=1)
    known = device.parse_known_args(argv)[0]
    if known.device.startswith("cuda"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import engine_gpu

        return engine_gpu.main(argv)
    if known.tensor_parallel_size > 1:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import engine_tp

        return engine_tp.main(argv)
    args = parse_args(argv)
    if args.zmq and args.kernel_isa != "native":
        raise SystemExit("--zmq runs the engine process with its native kernels: "
                         "--kernel-isa avx2 applies to the in-process engine only")
    torch.set_num_threads(args.threads)
    from engine_worker.engine import LLMEngine

    if args.kernel_isa == "avx2":
        from engine_worker.cpu import build

        build.use_extra_flags(["-mno-avx512f", "-mno-avxvnni"])
    concurrency = args.max_batch_size or args.num_requests

    def make_engine(dtype: str, quantization) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=args.model, device="cpu", num_threads=args.threads, dtype=dtype,
            quantization=quantization,
            cache=CacheConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                              enable_prefix_caching=not args.no_prefix_cache),
            scheduler=SchedulerConfig(
                max_batch_size=max([concurrency, *roofline_batches(args)]),
                max_num_batched_tokens=args.max_num_batched_tokens)))

    engine = make_engine(args.dtype, args.quantization)
    baseline = make_engine("float32", None) if args.against_float32 else None
    cfg = engine.model_config
    prompts = make_prompts(args, cfg.vocab_size)
    from benchmarks.stack import cpu_model, simd_flags

    print(f"CPU: {cpu_model()}; SIMD: {' '.join(simd_flags()) or 'none reported'}")
    print(f"Model: {cfg.name} ({cfg.num_params / 1e6:.1f}M params, "
          f"{engine.runner.weight_format} weights, kernels: {args.kernel_isa}), "
          f"threads: {args.threads}, cores: {os.cpu_count()}")
    print(f"Workload: {args.num_requests} requests x {args.input_len} prompt + "
          f"{args.output_len} output tokens, shared prefix {args.shared_prefix}, "
          f"engine concurrency {concurrency}")

    for e in (engine, baseline):
        if e is not None:
            run_engine(e, prompts[:4], 4)  # warm-up
            e.block_manager.reset_prefix_cache()
    # This machine's speed drifts: each engine run is paired with a matmul measurement
    # taken right before it, and the roofline fraction is taken per pair; a float32
    # baseline runs right before each run of the engine under test.
    runs, baseline_runs = [], []
    for _ in range(args.repeats):
        if baseline is not None:
            baseline_runs.append(run_engine(baseline, prompts, args.output_len))
            baseline.block_manager.reset_prefix_cache()
        flops = matmul_flops()
        run = run_engine(engine, prompts, args.output_len)
        engine.block_manager.reset_prefix_cache()
        run["matmul_gflops"] = flops / 1e9
        run["roofline_fraction"] = run["tokens_per_s"] / (flops / cfg.flops_per_token)
        runs.append(run)
    eng = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    eng["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    flops = statistics.median(r["matmul_gflops"] for r in runs) * 1e9
    result = {
        "cpu": cpu_model(), "simd": simd_flags(),
        "model": cfg.name, "threads": args.threads, "num_requests": args.num_requests,
        "input_len": args.input_len, "output_len": args.output_len,
        "shared_prefix": args.shared_prefix, "concurrency": concurrency,
        "engine": eng, "matmul_gflops": flops / 1e9,
        "roofline_tokens_per_s": flops / cfg.flops_per_token,
        "roofline_fraction": statistics.median(r["roofline_fraction"] for r in runs),
        "roofline_fraction_runs": [r["roofline_fraction"] for r in runs],
        "weights": engine.runner.weight_format, "kernel_isa": args.kernel_isa,
        "hf": [],
    }
    if baseline is not None:
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline_runs)]
        result["against_float32"] = {
            "float32_tokens_per_s_runs": [b["tokens_per_s"] for b in baseline_runs],
            "ratio_runs": ratios, "ratio": statistics.median(ratios)}
        del baseline
    if args.roofline:
        result["roofline"] = roofline(engine, args)
    if args.long_context:
        result["long_context"] = long_context(engine, args)

    if args.zmq:
        result["zmq"] = compare_zmq(args, engine, prompts, concurrency)

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # forced lengths, like ignore_eos
        run_hf(hf, prompts[:2], 2, 2)  # warm-up
        for size in args.hf_batch_sizes.split(","):
            batch_size = concurrency if size == "same" else int(size)
            result["hf"].append(run_hf(hf, prompts, args.output_len, batch_size))

    print_report(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_path}")
    return 0


def compare_zmq(args, engine, prompts, concurrency: int) -> dict:
    """In-process and over-ZeroMQ runs, alternated. Each zmq run is its own client
    session, so the in-process runs execute exactly as in the plain benchmark (main
    thread, no event loop alongside)."""
    import asyncio
    import tempfile

    from engine_worker.client import EngineClient

    address = f"ipc://{tempfile.mkdtemp(prefix='rs-bench-')}/engine.sock"
    proc = start_engine_process(args, concurrency, address)

    async def remote_run(tag: str, workload, output_len: int) -> dict:
        client = EngineClient(address, process=proc)
        await client.start(timeout_s=300)
        try:
            return await _run_zmq(client, workload, output_len, tag)
        finally:
            await client.close()

    try:
        asyncio.run(remote_run("warmup", prompts[:4], 4))
        pairs = []
        for r in range(args.repeats):
            local = run_engine(engine, prompts, args.output_len)
            engine.block_manager.reset_prefix_cache()
            remote = asyncio.run(remote_run(f"run{r}", prompts, args.output_len))
            pairs.append((local["tokens_per_s"], remote["tokens_per_s"]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ratios = [remote / local for local, remote in pairs]
    return {"in_process_tokens_per_s": [p[0] for p in pairs],
            "zmq_tokens_per_s": [p[1] for p in pairs],
            "ratios": ratios, "ratio": statistics.median(ratios), "frame": frame_cost()}


def print_report(r: dict) -> None:
    eng = r["engine"]
    print("=== engine benchmark ===")
    print(f"Engine: {eng['output_tokens']} tokens in {eng['seconds']:.2f} s "
          f"({eng['steps']} steps): {eng['tokens_per_s']:.1f} tokens/s")
    if len(eng["tokens_per_s_runs"]) > 1:
        runs = ", ".join(f"{x:.1f}" for x in eng["tokens_per_s_runs"])
        print(f"Engine runs: {runs} (median {statistics.median(eng['tokens_per_s_runs']):.1f})")
    if "against_float32" in r:
        a = r["against_float32"]
        base = ", ".join(f"{x:.1f}" for x in a["float32_tokens_per_s_runs"])
        ratios = ", ".join(f"{x:.2f}x" for x in a["ratio_runs"])
        print(f"float32 weights, run before each: {base} tokens/s -> {r['weights']} / "
              f"float32 = {a['ratio']:.2f}x (median of pairs: {ratios})")
    for hf in r["hf"]:
        print(f"HF generate batch {hf['batch_size']}: {hf['tokens_per_s']:.1f} tokens/s "
              f"-> engine / HF = {eng['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    fractions = ", ".join(f"{100 * x:.1f}%" for x in r["roofline_fraction_runs"])
    print(f"Square 1024^3 GEMM: {r['matmul_gflops']:.1f} GFLOP/s (median) -> square-GEMM "
          f"bound {r['roofline_tokens_per_s']:.1f} tokens/s; engine at "
          f"{100 * r['roofline_fraction']:.1f}% of it (median of runs: {fractions}). Not a "
          f"roofline: it ignores memory bandwidth and the model's own GEMM shapes")
    if "zmq" in r:
        z = r["zmq"]
        pairs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in
                          zip(z["in_process_tokens_per_s"], z["zmq_tokens_per_s"]))
        print(f"Over ZeroMQ (engine process): in-process/zmq tokens/s per pair: {pairs}; "
              f"zmq / in-process = {z['ratio']:.3f} (median of "
              f"{', '.join(f'{x:.3f}' for x in z['ratios'])})")
        f = z["frame"]
        print(f"Output frame at batch {f['batch']}: {f['frame_bytes']} bytes, "
              f"encode+decode {f['encode_decode_us']:.1f} us")
    print(f"Engine run: {eng['num_prompt_tokens_computed']} prompt tokens computed, "
          f"{eng['prefix_cache_hit_tokens']} served from the prefix cache, "
          f"{eng['num_preemptions']} preemptions")
    if "roofline" in r:
        print_roofline(r["roofline"])
    if "long_context" in r:
        print_long_context(r["long_context"])


if __name__ == "__main__":
    raise SystemExit(main())
