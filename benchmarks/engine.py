"""In-process engine throughput against Hugging Face transformers, in one run.

    python benchmarks/engine.py                       # SmolLM2-135M, 64 x 128 tokens
    python benchmarks/engine.py --shared-prefix 256 --json bench-engine.json
    python benchmarks/engine.py --zmq --skip-hf      # + through the engine process
    python benchmarks/engine.py --roofline --skip-hf # decode steps against their floor
    python benchmarks/engine.py --quantization int8  # (or --dtype bfloat16) weight formats
    python benchmarks/engine.py --long-context 512,2048,4096 --skip-hf  # long prompts
    python benchmarks/engine.py --device cuda --load-format dummy --model-config llama-3-8b

With --device cuda, benchmarks/engine_gpu.py runs instead (its own flags and report:
concurrency 1/64/256, HF generate in bf16, the GPU roofline, TTFT).

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
and FLOPs / GEMM rate. For batch 1, 8 and 64 it runs decode steps, prints the fraction
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402


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
    p.add_argument("--quantization", default=None, choices=["int8", "q4"])
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


def sustained_rate(fn, ops: float, seconds: float = 1.0) -> float:
    """ops per second of ``fn`` (which does ``ops``), called for ``seconds``."""
    for _ in range(3):
        fn()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    return ops * count / (time.perf_counter() - start)


def matmul_flops(seconds: float = 1.0, fmt: str = "float32", n: int = 1024) -> float:
    """Sustained n^3 matmul FLOP/s of torch on this machine for a weight format:
    float32 and bfloat16 matmuls (oneDNN's AMX or AVX-512-BF16 kernels where the CPU
    has them), int8 x int8 -> int32 (torch._int_mm) for int8."""
    if fmt == "int8":
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        return sustained_rate(lambda: torch._int_mm(a, b), 2 * n**3, seconds)
    dtype = getattr(torch, fmt)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return sustained_rate(lambda: a @ b, 2 * n**3, seconds)


def compute_rates(model, kernels, fmt: str, n: int = 1024) -> dict[str, float]:
    """The GEMM rates this machine reaches for a weight format, by what reached them:
    the engine's kernel on the model's own layers at 256 rows and on an n^3 weight, and
    torch's n^3 matmul in the format's arithmetic. A compute floor takes the best: the
    best the machine is known to do, not the code being measured."""
    w, x = torch.randn(n, n), torch.randn(n, n)
    packed = kernels.pack(w, fmt)
    rates = {"engine kernel, the model's layers at 256 rows": gemm_rate(model),
             f"engine kernel, {n}^3": sustained_rate(
                 lambda: kernels.linear(x, packed, n, None, fmt), 2 * n**3)}
    # 4-bit weights are multiplied as bytes (int8 x int8 dot products), as int8's are
    arithmetic = "int8" if fmt == "q4" else fmt
    torch_name = {"int8": "torch._int_mm int8"}.get(arithmetic, f"torch.matmul {fmt}")
    try:
        rates[f"{torch_name}, {n}^3"] = matmul_flops(fmt=arithmetic, n=n)
    except RuntimeError as e:  # no such kernel in this torch build
        print(f"({torch_name} is not available here: {e})")
    return rates


STAT_FIELDS = ("num_prompt_tokens_computed", "prefix_cache_hit_tokens", "num_preemptions")


def run_engine(engine, prompts, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
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


def read_bandwidth(kernels, gib: float = 0.25, repeats: int = 5) -> float:
    """Bytes/s this machine reads from memory with all threads: the best of a few
    vectorized sums (engine_worker/csrc/gemm.c) over a buffer far larger than any
    cache (256 MiB: 8 times this machine's L3, or more)."""
    x = torch.ones(int(gib * 2**30) // 4)
    kernels.read_all(x.data_ptr(), x.numel())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.read_all(x.data_ptr(), x.numel())
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def linear_layers(model) -> list:
    from engine_worker.models import PackedLinear

    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def gemm_rate(model, rows: int = 256, repeats: int = 3) -> float:
    """FLOP/s of the engine's linear layers on the model's own weights at ``rows`` rows
    (compute bound): the best of a few passes over every layer."""
    layers = linear_layers(model)
    flops = sum(2 * rows * m.in_features * m.out_features for m in layers)
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for m in layers:
            m(inputs[m.in_features])
        best = min(best, time.perf_counter() - start)
    return flops / best


class _Timed:
    """Wraps a callable, adding each call's seconds to ``seconds``."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def decode_steps(engine, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    """Runs ``batch`` requests and times the steps that are pure decodes of all of them:
    median step time and where it goes (seconds per step, medians)."""
    runner = engine.runner
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(input_len)]
        engine.add_request(f"roofline-{batch}-{time.monotonic_ns()}-{i}", prompt, params)
    forward, sampler = _Timed(runner.forward), _Timed(runner.sampler)
    runner.forward, runner.sampler = forward, sampler
    runner.fused.profile = profile = torch.zeros(3, dtype=torch.float64)
    rows = []
    try:
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            decoding = (len(running) == batch and not engine.scheduler.waiting
                        and all(r.num_tokens - r.num_computed_tokens == 1 for r in running))
            marks = (forward.seconds, sampler.seconds, *profile.tolist())
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            if decoding:
                f, smp, lin, att, oth = (b - a for a, b in zip(
                    marks, (forward.seconds, sampler.seconds, *profile.tolist())))
                rows.append({"step": step, "linear": lin, "attention": att, "c_other": oth,
                             "forward_python": f - lin - att - oth, "sampling": smp,
                             "engine_rest": step - f - smp})
    finally:
        runner.forward, runner.sampler, runner.fused.profile = forward.fn, sampler.fn, None
    engine.block_manager.reset_prefix_cache()
    if not rows:
        raise RuntimeError(f"no pure decode step of batch {batch} was seen")
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"steps": len(rows)}


def roofline_batches(args) -> list[int]:
    return [int(b) for b in args.roofline_batches.split(",")] if args.roofline else []


def roofline(engine, args) -> dict:
    runner = engine.runner
    if runner.fused is None:
        raise SystemExit("--roofline needs the fused CPU forward (a Llama-family model, "
                         "CPU kernels)")
    cfg = engine.model_config
    layers = linear_layers(runner.model)
    weight_bytes = sum(m.packed.numel() for m in layers)  # packed buffers are bytes
    params = sum(m.in_features * m.out_features for m in layers)
    kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                          * runner.kv_caches[0].element_size())
    kernels = runner.model.lm_head.kernels
    rates = compute_rates(runner.model, kernels, runner.weight_format)
    rate_from, rate = max(rates.items(), key=lambda item: item[1])
    output_len = 32
    out = {"gemm_gflops": rate / 1e9,
           "gemm_from": rate_from, "gemm_rates_gflops": {k: v / 1e9 for k, v in rates.items()},
           "weights": runner.weight_format, "bf16_path": kernels.bf16_path,
           "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
           "batches": []}
    for batch in roofline_batches(args):
        # The bandwidth a VM gets moves by up to 1.7x from minute to minute (its
        # neighbours): measured right before and right after the batch's steps, the
        # better of the two is what the machine could give them.
        before = read_bandwidth(kernels)
        steps = decode_steps(engine, batch, args.input_len, output_len, args.seed)
        bandwidth = max(before, read_bandwidth(kernels))
        # Keys and values read per step: each sequence's context, on average mid-run.
        context = args.input_len + output_len / 2
        memory_s = (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth
        compute_s = 2 * params * batch / rate
        floor = max(memory_s, compute_s)
        out["batches"].append({
            "batch": batch, **steps, "read_bandwidth_gbs": bandwidth / 1e9,
            "floor_memory_s": memory_s, "floor_compute_s": compute_s,
            "floor_s": floor, "fraction_of_floor": floor / steps["step"],
            "tokens_per_s": batch / steps["step"], "floor_tokens_per_s": batch / floor})
    out["read_bandwidth_gbs"] = max((b["read_bandwidth_gbs"] for b in out["batches"]), default=0.0)
    return out


def start_engine_process(args, concurrency: int, address: str):
    import subprocess

    cmd = [sys.executable, "-m", "engine_worker", "--device", "cpu", "--bind", address,
           "--threads", str(args.threads), "--max-batch-size", str(concurrency),
           "--block-size", str(args.block_size), "--kv-cache-dtype", args.kv_cache_dtype,
           "--log-level", "WARNING"]
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
    if device.parse_known_args(argv)[0].device.startswith("cuda"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import engine_gpu

        return engine_gpu.main(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine_worker.engine import LLMEngine

    if args.kernel_isa == "avx2":
        from engine_worker import kernels

        kernels.use_extra_flags(["-mno-avx512f", "-mno-avxvnni"])
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


def long_context(engine, args) -> list[dict]:
    """Per prompt length, one request alone (--repeats runs, medians): seconds to its
    first token and per later decode step, each with the fused forward's split (linear
    layers, attention, the rest)."""
    runner = engine.runner
    if runner.fused is None:
        raise SystemExit("--long-context needs the fused CPU forward (a Llama-family model, "
                         "CPU kernels)")
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len + 1, temperature=0.0, ignore_eos=True)
    rows = []
    for length in (int(n) for n in args.long_context.split(",")):
        runs = []
        for _ in range(args.repeats):
            prompt = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(length)]
            engine.add_request(f"long-{length}-{time.monotonic_ns()}", prompt, params)
            runner.fused.profile = profile = torch.zeros(3, dtype=torch.float64)
            try:
                start, chunks = time.perf_counter(), 0
                while not any(out.new_token_ids for out in engine.step()):
                    chunks += 1
                prefill = time.perf_counter() - start
                split = profile.tolist()
                profile.zero_()
                start, steps = time.perf_counter(), 0
                while engine.has_unfinished_requests():
                    engine.step()
                    steps += 1
                decode = (time.perf_counter() - start) / steps
                per_step = [x / steps for x in profile.tolist()]
            finally:
                runner.fused.profile = None
            engine.block_manager.reset_prefix_cache()
            runs.append({"prefill_s": prefill, "prefill_steps": chunks + 1,
                         "prefill_linear_s": split[0], "prefill_attention_s": split[1],
                         "decode_step_s": decode, "decode_linear_s": per_step[0],
                         "decode_attention_s": per_step[1], "decode_steps": steps})
        rows.append({"prompt_tokens": length, "runs": runs,
                     **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    return rows


def print_long_context(rows: list[dict]) -> None:
    print("=== one request alone: prefill, then decode at that context (medians) ===")
    print("prompt  prefill s (steps)  linear  attention  |  decode ms/token  linear  attention")
    for r in rows:
        print(f"{r['prompt_tokens']:6d}  {r['prefill_s']:9.3f} ({r['prefill_steps']:3.0f})  "
              f"{r['prefill_linear_s']:6.3f}  {r['prefill_attention_s']:9.3f}  |  "
              f"{1e3 * r['decode_step_s']:15.2f}  {1e3 * r['decode_linear_s']:6.2f}  "
              f"{1e3 * r['decode_attention_s']:9.2f}")


def print_roofline(rl: dict) -> None:
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    weights = rl["weights"] + (f" ({rl['bf16_path']} products)"
                               if rl["weights"] == "bfloat16" else "")
    print(f"=== roofline, {weights} weights: GEMM {rl['gemm_gflops']:.1f} GFLOP/s ({rl['gemm_from']}, the best of: "
          + ", ".join(f"{k} {v:.1f}" for k, v in rl["gemm_rates_gflops"].items())
          + f"), {rl['weight_bytes'] / 2**20:.0f} MiB of weights per step ===")
    print("batch  GB/s  step ms  floor ms (memory/compute)  of floor  tokens/s  |  linear  "
          "attention  C other  Python fwd  sampling  engine rest (ms)")
    for b in rl["batches"]:
        print(f"{b['batch']:5d}  {b['read_bandwidth_gbs']:4.1f}  {ms(b['step']):>7}  "
              f"{ms(b['floor_s']):>8} "
              f"({ms(b['floor_memory_s'])}/{ms(b['floor_compute_s'])})  "
              f"{100 * b['fraction_of_floor']:7.1f}%  {b['tokens_per_s']:8.1f}  |  "
              f"{ms(b['linear']):>6}  {ms(b['attention']):>9}  {ms(b['c_other']):>7}  "
              f"{ms(b['forward_python']):>10}  {ms(b['sampling']):>8}  "
              f"{ms(b['engine_rest']):>11}")


if __name__ == "__main__":
    raise SystemExit(main())
