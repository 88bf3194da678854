"""Where the engine's steps spend their time, on the device it runs on.

    python benchmarks/gpu_profile.py --model-config llama-3-8b --batches 1,64,256
    python benchmarks/gpu_profile.py --model-config smollm2-135m --batches 1,64

For each batch size: that many --input-len-token prompts prefilled (wall time), then
decode steps in steady state: the step's wall time, the host time of the forward call
(which returns once the work is queued), of queueing the sampling and of reading the
tokens back (which waits for the device), the decode graph's own device time when a
CUDA graph runs the step (without run-ahead, the wall time less this is host time the
device sat idle), the kernels of a graph replay by device time (torch.profiler), and
the host functions of the step by their own time (cProfile).
Then the anatomy of the time to first token (one prompt's prefill: wall, host time of
the forward, device time of the forward) and the host cost of one kernel launch (a
Triton kernel of the engine's, a cuBLAS matmul, a torch elementwise op).

It runs on any device (CI smoke-tests it on a CPU with a tiny model, where the graph
and kernel sections are skipped); docs/performance.md quotes its figures from a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.engine import random_prompts  # noqa: E402
from benchmarks.engine_gpu import add_model_args  # noqa: E402
from common.config import (KV_CACHE_DTYPES, CacheConfig, EngineConfig,  # noqa: E402
                           SchedulerConfig)
from common.model_files import resolve_model_dir  # noqa: E402
from common.protocol import SamplingParams  # noqa: E402
from engine_worker.gpu.graphs import GraphForward  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    return p.parse_args(argv)


class Clock:
    """Device time of queued work: CUDA events on a GPU, else the host's clock after
    the (synchronous) work."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn, repeats: int = 1) -> float:
        """Milliseconds of device time per call of fn."""
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            return (time.perf_counter() - start) * 1e3 / repeats
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / repeats


def kernel_table(fn, rows: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return ("(3 replays)\n" + prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def host_profile(fn, rows: int = 12) -> str:
    """cProfile's table of fn's host functions, after a line of what Python's cyclic
    collector took meanwhile: a collection runs inside whichever function is executing
    when it is due (a 152 ms one, presumably, made request.append_token the costliest
    function of an H200's batch of 256 once)."""
    collections: list[tuple[int, float]] = []   # (generation, seconds)
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))
    profiler = cProfile.Profile()
    gc.callbacks.append(timed)
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
        gc.callbacks.remove(timed)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    counts = [sum(1 for g, _ in collections if g == gen) for gen in range(3)]
    longest = max((t for _, t in collections), default=0.0)
    collector = (f"the collector: {len(collections)} collections (generations 0/1/2: "
                 f"{'/'.join(map(str, counts))}), {sum(t for _, t in collections) * 1e3:.1f} ms, "
                 f"the longest {longest * 1e3:.1f} ms")
    return "\n".join([collector] + [line for line in out.getvalue().splitlines()
                                    if line.strip()])


def timed_calls(obj, name: str, totals: dict):
    """Wraps obj.name to add its host seconds to totals[name]; returns the original."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
    setattr(obj, name, wrapper)
    return original


def profile_batch(engine, clock: Clock, batch: int, args) -> None:
    runner = engine.runner
    prompts = random_prompts(batch, args.input_len, engine.vocab_size, batch)
    params = SamplingParams(max_tokens=args.decode_steps * 2 + 20, temperature=0.0,
                            ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{batch}-{i}", prompt, params)
    clock.sync()
    start, steps = time.perf_counter(), 0
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
        steps += 1
    clock.sync()
    print(f"\n=== batch {batch}: prefill {time.perf_counter() - start:.3f} s in {steps} steps")
    for _ in range(3):
        engine.step()
    totals: dict = {}
    wrapped = [(obj, name, timed_calls(obj, name, totals)) for obj, name in
               ((runner, "forward"), (engine, "_sample"), (engine, "_read_samples"))]
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.decode_steps * 1e3
    for obj, name, original in wrapped:
        setattr(obj, name, original)
    per_step = {k: v / args.decode_steps * 1e3 for k, v in totals.items()}
    print(f"decode step: {wall:.3f} ms wall (run-ahead: {engine.async_scheduling}); host: "
          f"forward call {per_step['forward']:.3f} ms, sampling queued "
          f"{per_step['_sample']:.3f} ms, tokens read (waits for the device) "
          f"{per_step['_read_samples']:.3f} ms")
    graphs = runner.step if isinstance(runner.step, GraphForward) else None
    bucket = graphs.bucket(batch) if graphs is not None else None
    if bucket is not None:
        replay = graphs.graphs[bucket]
        print(f"decode graph (bucket {bucket}): {clock.ms(replay, 20):.3f} ms of device time")
        print(kernel_table(replay))
    print(host_profile(lambda: [engine.step() for _ in range(10)]))
    engine.abort_requests(list(engine.requests))


def profile_ttft(engine, clock: Clock, args) -> None:
    runner = engine.runner
    prompt = random_prompts(1, args.input_len, engine.vocab_size, 77)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    walls, hosts, devices = [], [], []
    forward = runner.forward
    for i in range(8):
        engine.add_request(f"ttft-{i}", [(t + i) % engine.vocab_size for t in prompt], params)
        clock.sync()
        start = time.perf_counter()

        def timed_forward(*args):
            host = time.perf_counter()
            out = forward(*args)
            hosts.append(time.perf_counter() - host)
            return out
        runner.forward = timed_forward
        devices.append(clock.ms(lambda: run_to_end(engine)))  # with run-ahead: two step()s
        walls.append(time.perf_counter() - start)
        runner.forward = forward
    median = statistics.median  # of the last six: the first two warm up
    print(f"\n=== time to first token ({args.input_len}-token prompt): step "
          f"{median(walls[2:]) * 1e3:.2f} ms wall; forward {median(hosts[2:]) * 1e3:.2f} ms "
          f"of host time; the step {median(devices[2:]):.2f} ms of device time")


def run_to_end(engine) -> None:
    while engine.has_steps_to_run():
        engine.step()


def profile_launches(engine, device: torch.device) -> None:
    if device.type != "cuda":
        return
    from engine_worker.gpu.ops import TritonOps

    c = engine.model_config.hidden_size
    x = torch.randn(512, c, device=device, dtype=torch.bfloat16)
    w = torch.ones(c, device=device, dtype=torch.bfloat16)
    m = torch.randn(c, c, device=device, dtype=torch.bfloat16)
    ops = TritonOps()
    for name, fn in [("Triton add_rms_norm", lambda: ops.add_rms_norm(x, x, w, 1e-5)),
                     ("torch linear (cuBLAS)", lambda: torch.nn.functional.linear(x, m)),
                     ("torch add", lambda: x + x)]:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        host = (time.perf_counter() - start) / 2000 * 1e6
        torch.cuda.synchronize()
        print(f"launch, {name}: {host:.1f} us of host time per call")


def main(argv=None) -> int:
    args = parse_args(argv)
    from engine_worker.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=str(resolve_model_dir(args.model_config)), device=args.device,
        load_format=args.load_format, max_model_len=args.input_len + 2 * args.decode_steps + 64,
        cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_batch_size=max(batches))))
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; model: {args.model_config}; KV cache "
          f"{str(engine.runner.kv_dtype).removeprefix('torch.')}; engine built in "
          f"{time.perf_counter() - start:.1f} s; graphs: "
          f"{isinstance(engine.runner.step, GraphForward)}")
    clock = Clock(device)
    for batch in batches:
        profile_batch(engine, clock, batch, args)
    profile_ttft(engine, clock, args)
    profile_launches(engine, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
