"""Where an engine step's time goes, for benchmarks/engine.py: the roofline of decode
steps (this machine's read bandwidth and best GEMM rate against each batch's steps,
split into linear layers, attention, the rest of the C forward, its Python, sampling
and the rest of the engine step) and one long prompt alone (--long-context)."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from common.protocol import SamplingParams


def timed_generate(engine, prompts, params) -> tuple[float, list[list[int]]]:
    """Every prompt added at once (``params``: one SamplingParams for all, or one a
    prompt) and run to the end: (seconds, each request's tokens); the prefix cache is
    emptied after, so that the next run computes as this one did."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {i: [] for i in ids}
    start = time.perf_counter()
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    elapsed = time.perf_counter() - start
    engine.block_manager.reset_prefix_cache()
    return elapsed, [out[i] for i in ids]


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
    # 4-bit, IQ4 and MXFP4 weights are multiplied as bytes (int8 x int8 dot products), as
    # int8's are
    arithmetic = "int8" if fmt in ("q4", "iq4", "mxfp4") else fmt
    torch_name = {"int8": "torch._int_mm int8"}.get(arithmetic, f"torch.matmul {fmt}")
    try:
        rates[f"{torch_name}, {n}^3"] = matmul_flops(fmt=arithmetic, n=n)
    except RuntimeError as e:  # no such kernel in this torch build
        print(f"({torch_name} is not available here: {e})")
    return rates


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache's size, as Linux reports it ("48K", "260M"; 0 where it
    reports none)."""
    sizes = [f.read_text().strip() for f in caches.glob("index*/size")]
    return max((int(t[:-1]) * _UNITS[t[-1]] if t[-1] in _UNITS else int(t)
                for t in sizes if t), default=0)


def read_bandwidth(kernels, nbytes: int = 0, repeats: int = 5) -> float:
    """Bytes/s this machine reads with all threads: the best of a few vectorized sums
    (engine_worker/cpu/csrc/gemm.c) over a buffer of ``nbytes``, read once before they are
    timed (0: from memory, a buffer far larger than any cache: 256 MiB or 4 times the
    last-level cache, which on a large Xeon is 260 MiB)."""
    nbytes = nbytes or max(2**28, 4 * last_level_cache_bytes())
    x = torch.ones(nbytes // 4)
    kernels.read_all(x.data_ptr(), x.numel())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernels.read_all(x.data_ptr(), x.numel())
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def linear_layers(model) -> list:
    from engine_worker.cpu.formats import PackedMethod
    from engine_worker.models.layers.linear import Linear

    return [m for m in model.modules()
            if isinstance(m, Linear) and isinstance(m.method, PackedMethod)]


def fused_of(runner):
    """The runner's fused CPU forward (cpu/fused.py: FusedLlama), or None."""
    from engine_worker.cpu.fused import FusedForward

    return runner.step.fused if isinstance(runner.step, FusedForward) else None


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


def decode_steps(engine, batch: int, input_len: int, seed: int, wanted: int = 32) -> dict:
    """Runs ``batch`` requests until ``wanted`` steps were pure decodes of all of them
    (however many steps their prompts take first), then aborts them: median step time
    and where it goes (seconds per step, medians), and the requests' mean context in
    those steps (the median over them)."""
    budget = engine.scheduler.token_budget
    if batch > budget:
        raise SystemExit(f"--roofline-batches {batch}: a step computes at most "
                         f"{budget} tokens (--max-num-batched-tokens), so no step can "
                         f"decode {batch} requests")
    runner = engine.runner
    rng = random.Random(seed)
    # The run stops after the steps it wants. Until every prompt is in, each step
    # computes at least one prompt token (the decoding rows leave the budget one), so
    # a request needs at most batch x input_len tokens besides them.
    params = SamplingParams(max_tokens=min(engine.max_model_len - input_len,
                                           batch * input_len + wanted),
                            temperature=0.0, ignore_eos=True)
    ids = [f"roofline-{batch}-{time.monotonic_ns()}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(input_len)]
        engine.add_request(request_id, prompt, params)
    forward, sampler = _Timed(runner.forward), _Timed(runner.sampler.launch)
    runner.forward, runner.sampler.launch = forward, sampler  # (on the CPU it samples)
    fused = fused_of(runner)
    fused.profile = profile = torch.zeros(3, dtype=torch.float64)
    rows = []
    try:
        while engine.has_unfinished_requests() and len(rows) < wanted:
            running = engine.scheduler.running
            decoding = (len(running) == batch and not engine.scheduler.waiting
                        and all(r.num_tokens - r.num_computed_tokens == 1 for r in running))
            context = sum(r.num_tokens for r in running) / batch
            marks = (forward.seconds, sampler.seconds, *profile.tolist())
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            if decoding:
                f, smp, lin, att, oth = (b - a for a, b in zip(
                    marks, (forward.seconds, sampler.seconds, *profile.tolist())))
                rows.append({"step": step, "linear": lin, "attention": att, "c_other": oth,
                             "forward_python": f - lin - att - oth, "sampling": smp,
                             "engine_rest": step - f - smp, "context": context})
    finally:
        runner.forward, fused.profile = forward.fn, None
        del runner.sampler.launch  # the class's again
        engine.abort_requests(ids)
    engine.block_manager.reset_prefix_cache()
    if not rows:
        bm = engine.block_manager
        raise RuntimeError(
            f"no step decoded all {batch} requests of {input_len} prompt tokens at once "
            f"(a KV cache of {bm.num_blocks * bm.block_size} tokens, a context of "
            f"{engine.max_model_len}); a smaller batch or --input-len may fit")
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"steps": len(rows)}


def roofline_batches(args) -> list[int]:
    return [int(b) for b in args.roofline_batches.split(",")] if args.roofline else []


def roofline(engine, args) -> dict:
    runner = engine.runner
    if fused_of(runner) is None:
        raise SystemExit("--roofline needs the fused CPU forward (a Llama-family model, "
                         "CPU kernels)")
    cfg = engine.model_config
    layers = linear_layers(runner.model)
    weight_bytes = sum(m.packed.numel() for m in layers)  # packed buffers are bytes
    params = sum(m.in_features * m.out_features for m in layers)
    kv_bytes_per_token = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                          * runner.kv_caches[0].element_size())
    kernels = runner.model.lm_head.method.kernels   # (cpu/formats.py: PackedMethod)
    rates = compute_rates(runner.model, kernels, runner.weight_format)
    rate_from, rate = max(rates.items(), key=lambda item: item[1])
    out = {"gemm_gflops": rate / 1e9,
           "gemm_from": rate_from, "gemm_rates_gflops": {k: v / 1e9 for k, v in rates.items()},
           "weights": runner.weight_format, "products": kernels.products(runner.weight_format),
           "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
           "batches": []}
    for batch in roofline_batches(args):
        # The bandwidth a VM gets moves by up to 1.7x from minute to minute (its
        # neighbours): measured right before and right after the batch's steps, the
        # better of the two is what the machine could give them.
        before = read_bandwidth(kernels)
        steps = decode_steps(engine, batch, args.input_len, args.seed)
        bandwidth = max(before, read_bandwidth(kernels))
        # Keys and values read per step: each sequence's context (the median step's)
        step_bytes = int(weight_bytes + batch * steps["context"] * kv_bytes_per_token)
        # A step's bytes read again and again: from memory, or from a last-level cache
        # that holds them (int8 and 4-bit weights in a Xeon's 260 MiB), if faster.
        again = read_bandwidth(kernels, step_bytes)
        memory_s = step_bytes / max(bandwidth, again)
        compute_s = 2 * params * batch / rate
        floor = max(memory_s, compute_s)
        out["batches"].append({
            "batch": batch, **steps, "read_bandwidth_gbs": bandwidth / 1e9,
            "step_bytes": step_bytes, "step_bytes_read_gbs": again / 1e9,
            "floor_memory_s": memory_s, "floor_compute_s": compute_s,
            "floor_s": floor, "fraction_of_floor": floor / steps["step"],
            "tokens_per_s": batch / steps["step"], "floor_tokens_per_s": batch / floor})
    out["read_bandwidth_gbs"] = max((b["read_bandwidth_gbs"] for b in out["batches"]), default=0.0)
    return out


def long_context(engine, args) -> list[dict]:
    """Per prompt length, one request alone (--repeats runs, medians): seconds to its
    first token and per later decode step, each with the fused forward's split (linear
    layers, attention, the rest)."""
    fused = fused_of(engine.runner)
    if fused is None:
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
            fused.profile = profile = torch.zeros(3, dtype=torch.float64)
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
                fused.profile = None
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
    weights = rl["weights"] + (f" ({rl['products']} products)" if rl["products"] else "")
    print(f"=== roofline, {weights} weights: GEMM {rl['gemm_gflops']:.1f} GFLOP/s ({rl['gemm_from']}, the best of: "
          + ", ".join(f"{k} {v:.1f}" for k, v in rl["gemm_rates_gflops"].items())
          + f"), {rl['weight_bytes'] / 2**20:.0f} MiB of weights per step ===")
    print("(GB/s: reading memory; again: reading a step's bytes again and again, from a cache "
          "that holds them where one does; the memory floor takes the faster)")
    print("batch  GB/s  again  step ms  floor ms (memory/compute)  of floor  tokens/s  |  linear  "
          "attention  C other  Python fwd  sampling  engine rest (ms)")
    for b in rl["batches"]:
        print(f"{b['batch']:5d}  {b['read_bandwidth_gbs']:4.1f}  {b['step_bytes_read_gbs']:5.1f}  "
              f"{ms(b['step']):>7}  "
              f"{ms(b['floor_s']):>8} "
              f"({ms(b['floor_memory_s'])}/{ms(b['floor_compute_s'])})  "
              f"{100 * b['fraction_of_floor']:7.1f}%  {b['tokens_per_s']:8.1f}  |  "
              f"{ms(b['linear']):>6}  {ms(b['attention']):>9}  {ms(b['c_other']):>7}  "
              f"{ms(b['forward_python']):>10}  {ms(b['sampling']):>8}  "
              f"{ms(b['engine_rest']):>11}")
