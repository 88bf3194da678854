"""python -m engine_worker: run one engine worker process.

    python -m engine_worker --device cuda --model /models/Qwen2-7B --bind tcp://0.0.0.0:5557 \
        --curve-key-file cluster.key   # beyond loopback: only holders of the key are served
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Optional, Sequence

from common import faults
from common.config import (DEFAULT_ENGINE_ADDRESS, DEFAULT_MAX_FRAME_BYTES, ENGINE_ROLES,
                           KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, EngineConfig,
                           EngineServerConfig, SchedulerConfig, env_default)
from common.curve import add_curve_args, key_for_bind
from common.errors import InvalidRequestError, ModelLoadError
from common.heap import freeze_startup_heap
from common.logging_setup import setup_logging
from common.sockets import is_loopback

logger = logging.getLogger("engine_worker")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (shared with ``roseserve serve``)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=env_default("MODEL"),
                   help="Hugging Face model directory, or a GGUF file (served as it is "
                        "on the CPU kernels; default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default=env_default("DEVICE", "auto"),
                   help="cpu, cuda, cuda:N or auto (cuda when available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA; on the CPU kernels, "
                        "bfloat16 means bfloat16 weights, multiplied as bf16 products "
                        "(AMX or AVX-512-BF16, where the CPU has them) or in float32")
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="int8: 8-bit weights and layer inputs, a scale per 32 values, "
                        "integer dot products (CPU kernels; as llama.cpp's Q8_0); q4: "
                        "4-bit weights, a scale and a minimum per 32 (as Q4_1); iq4: "
                        "4-bit indices into 16 fixed levels, a scale per 32 (as IQ4_NL); fp8 (CUDA): "
                        "e4m3 weights, a scale per output channel, activations quantized "
                        "per token (W8A8). An fp8 checkpoint is served in fp8 on CUDA and "
                        "as int8 on the CPU by itself")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (a tensor-parallel rank's: default, a "
                        "thread for each of its cores)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve (PEFT folders: adapter_config.json and "
                        "adapter_model.safetensors); a request runs with one by naming it "
                        "as its model")
    g.add_argument("--pooling", choices=["last", "mean"], default="last",
                   help="/v1/embeddings: the prompt's final hidden states pooled as the "
                        "last token's (default: decoder models' embeddings) or their mean")
    g.add_argument("--max-loras", type=int, default=4,
                   help="the most LoRA adapters loaded at once (default 4)")
    g.add_argument("--max-lora-rank", type=int, default=64,
                   help="the highest LoRA rank served (default 64)")
    g.add_argument("--tensor-parallel-size", type=int,
                   default=env_default("TENSOR_PARALLEL_SIZE", "1"), metavar="N",
                   help="split the model over N ranks, a process each in one "
                        "torch.distributed group: N GPUs over NCCL, or N shares of the "
                        "CPU's cores over gloo (each rank pinned to its share: one "
                        "socket each on a server of N sockets). One engine to its clients "
                        "(ROSESERVE_TENSOR_PARALLEL_SIZE)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-batch-size", type=int, default=None,
                   help="decode batch (default: 64 on CPU, 256 on CUDA)")
    g.add_argument("--prefill-max-batch-size", type=int, default=None,
                   help="requests admitted per step (default: --max-batch-size)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 512 on CPU, 8192 on CUDA)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-gb", dest="kv_cache_memory_gb",
                   type=float, default=None, metavar="GIB",
                   help="KV pool size in GiB (default: 2 on CPU; on CUDA, what "
                        "--gpu-memory-utilization leaves after the weights, a profiled "
                        "step and the CUDA graphs)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype on CUDA; on the CPU float32 with float32 "
                        "weights, else bfloat16. bfloat16 on the CPU: half the KV bytes to "
                        "hold and read, keys and values rounded to bfloat16 (as llama.cpp's "
                        "default f16 cache). fp8 on CUDA: float8 e4m3, half the bytes of "
                        "a bfloat16 cache (twice the tokens, half the reads), values "
                        "rounded to 3 mantissa bits and held within +-448 (a power-of-two "
                        "--block-size)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the GPU's total memory the engine may use")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config.json alone "
                        "(benchmarks; --model may name a shipped config, e.g. llama-3-8b)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs for decode steps")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and queue each step before the previous step's tokens "
                        "reach the host, so the device never waits for the scheduler "
                        "(default: on with CUDA, off on the CPU)")
    g.add_argument("--speculative-tokens", type=int,
                   default=env_default("SPECULATIVE_TOKENS", "0"), metavar="K",
                   help="CPU: n-gram speculation, a request proposing up to K tokens a "
                        "step copied from its own prompt and output, checked in the step "
                        "(greedy outputs are the same, sampled ones distributed the same; "
                        "faster where replies repeat their input). Default 0: off, "
                        "but for requests that carry a prediction "
                        "(ROSESERVE_SPECULATIVE_TOKENS)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton on CUDA, C kernels or torch on the CPU; torch: the "
                        "reference path")
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--no-cpu-kernels", action="store_true",
                   help="use only torch ops (no C kernels, no packed GEMM)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-transfer-timeout", type=float, default=5.0,
                   help="decode engine: a KV transfer from a prefill engine not complete "
                        "after this many seconds ends; the rest of the prompt is computed "
                        "here")
    g.add_argument("--kv-transfer-window-bytes", type=int, default=8 << 20,
                   help="decode engine: the most KV bytes one pull from a prefill engine "
                        "asks for")
    g.add_argument("--kv-offload-memory", "--kv-offload-memory-gb", dest="kv_offload_memory_gb", type=float,
                   default=None, metavar="GIB",
                   help="a host-memory tier below the KV pool: blocks the pool evicts are "
                        "kept there (up to GIB) and copied back when a prompt needs them, "
                        "instead of computed (pinned memory and a side stream on CUDA)")
    g.add_argument("--kv-offload-dir", default=env_default("KV_OFFLOAD_DIR"), metavar="DIR",
                   help="a disk tier below those: evicted blocks in files under DIR (a "
                        "directory per model and KV layout), found again after a restart")
    g.add_argument("--kv-offload-disk", "--kv-offload-disk-gb", dest="kv_offload_disk_gb", type=float, default=8.0,
                   metavar="GIB", help="the most the disk tier keeps (default 8)")
    g.add_argument("--kv-store-address", default=env_default("KV_STORE_ADDRESS"),
                   metavar="ADDRESS",
                   help="the shared KV store (python -m kv_store) at ADDRESS: blocks this "
                        "engine evicts or its requests leave are put there, and prompt "
                        "blocks it lacks are pulled from there, checked, instead of "
                        "computed (a store that fails costs recomputation, never output)")
    g.add_argument("--kv-store-timeout", type=float, default=1.0,
                   help="a pull from the KV store not complete after this many seconds "
                        "ends; the rest is computed")
    g.add_argument("--per-token-output-frames", action="store_true",
                   help="experiment: one output frame per request per step, not one per "
                        "client per step")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    memory = _bytes(args.kv_cache_memory_gb)
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        quantization=args.quantization, num_threads=args.threads,
        max_model_len=args.max_model_len, seed=args.seed, cpu_kernels=not args.no_cpu_kernels,
        load_format=args.load_format, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        speculative_tokens=args.speculative_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        lora_modules=_lora_modules(args.lora_modules), max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, pooling=args.pooling,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=memory,
                          kv_cache_dtype=args.kv_cache_dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_cache,
                          kv_transfer_timeout_s=args.kv_transfer_timeout,
                          kv_transfer_window_bytes=args.kv_transfer_window_bytes,
                          kv_offload_memory_bytes=_bytes(args.kv_offload_memory_gb),
                          kv_offload_dir=args.kv_offload_dir,
                          kv_offload_disk_bytes=_bytes(args.kv_offload_disk_gb),
                          kv_store_address=args.kv_store_address,
                          kv_store_timeout_s=args.kv_store_timeout,
                          # (roseserve serve checks its flags here, with no role)
                          window_pool=getattr(args, "role", "mixed") == "mixed"),
        scheduler=SchedulerConfig(max_batch_size=args.max_batch_size,
                                  prefill_max_batch_size=args.prefill_max_batch_size,
                                  max_num_batched_tokens=args.max_num_batched_tokens))


def _lora_modules(specs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """--lora-modules NAME=PATH ... (ValueError naming a spec without both, or a name
    given twice)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        out[name] = path
    return tuple(out.items())


def _bytes(gib: Optional[float]) -> Optional[int]:
    """GiB given on the command line, in bytes (ValueError below one byte)."""
    if gib is None:
        return None
    if not gib * 2**30 >= 1:  # NaN fails too
        raise ValueError(f"a size in GiB must be positive, got {gib}")
    return int(gib * 2**30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--bind", default=env_default("ENGINE_ADDRESS", DEFAULT_ENGINE_ADDRESS),
                        help="address of the engine socket (tcp://host:port or ipc://path)")
    parser.add_argument("--role", default=env_default("ENGINE_ROLE", "mixed"),
                        choices=ENGINE_ROLES,
                        help="mixed: prompts and generation; prefill or decode: this "
                             "engine's part of disaggregated serving (KV moves from "
                             "prefill to decode engines over ZeroMQ)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--client-timeout", type=float, default=15.0,
                        help="abort a silent client's requests after this many seconds")
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                        help="a client sending a larger frame is disconnected")
    add_curve_args(parser, binds=True)
    parser.add_argument("--log-level", default=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from engine_worker import tensor_parallel

    rank = tensor_parallel.rank_from_environment() if args.tensor_parallel_size > 1 else None
    setup_logging(f"engine-rank{rank}" if rank else "engine", args.log_level)
    try:
        server_config = EngineServerConfig(bind=args.bind, drain_timeout_s=args.drain_timeout,
                                           client_timeout_s=args.client_timeout,
                                           per_token_frames=args.per_token_output_frames,
                                           max_frame_bytes=args.max_frame_bytes,
                                           role=args.role,
                                           curve_key=key_for_bind(args.bind, args.curve_key_file,
                                                                  args.insecure_no_curve))
        engine_config = engine_config_from_args(args)
        if engine_config.tensor_parallel_size > 1 and args.role != "mixed":
            raise ValueError("a prefill or decode engine moves its KV to others: not with "
                             "the model split over tensor-parallel ranks yet")
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback(server_config.bind):
        logger.warning("binding %s: reachable beyond this host, as asked (%s)",
                       server_config.bind, "clients must hold the cluster's CURVE key"
                       if server_config.curve_key else "WITHOUT authentication")

    # Split over ranks: this process is rank 0, which starts the others, unless a
    # launcher (torchrun) started each (tensor_parallel.py).
    size, ranks = engine_config.tensor_parallel_size, None
    try:
        if size > 1:
            if rank is None:
                ranks, rank = tensor_parallel.Ranks(sys.argv[1:] if argv is None else argv,
                                                    size), 0
                ranks.watch()   # (a rank that fails to start ends this one too)
            device, threads = tensor_parallel.join(rank, size, engine_config.device,
                                                   engine_config.num_threads)
            engine_config = dataclasses.replace(engine_config, device=device,
                                                num_threads=threads)
        return _serve(engine_config, server_config, rank or 0, ranks)
    except ValueError as e:   # (the ranks' place: a launcher's variables that do not fit)
        logger.error("cannot start the engine: %s", e)
        return 2
    finally:
        if ranks is not None:
            ranks.stop()


def _serve(engine_config: EngineConfig, server_config: EngineServerConfig, rank: int,
           ranks) -> int:
    from engine_worker import tensor_parallel
    from engine_worker.engine import LLMEngine

    try:
        engine = LLMEngine(engine_config)
    except (ModelLoadError, RuntimeError, ValueError) as e:
        logger.error("cannot start the engine%s: %s", f" (rank {rank})" if rank else "", e)
        return 2
    if rank > 0:
        return tensor_parallel.follow(engine)
    code = 1
    try:
        code = _serve_rank0(engine, server_config)
        return code
    finally:
        if engine.runner.parallel.size > 1:
            if ranks is not None:
                ranks.stopping.set()   # (their exits from here on are expected)
            if code in (0, 2):   # (drained, or never served: the ranks wait for a step)
                engine.runner.inputs.stop()   # the ranks that follow leave too
            # (failed mid-step, the ranks are out of step: they die with this process)


def _serve_rank0(engine, server_config: EngineServerConfig) -> int:
    from engine_worker.server import EngineServer

    try:
        engine.grammars  # built now, not inside the first structured request's step
    except InvalidRequestError as e:
        logger.warning("structured output is unavailable: %s", e)
    try:
        server = EngineServer(engine, server_config)
    except Exception as e:  # zmq.ZMQError: address in use, bad address
        logger.error("cannot bind %s: %s", server_config.bind, e)
        return 2
    faults.install("engine", server)
    logger.info("start-up heap frozen: %d objects left out of garbage collections",
                freeze_startup_heap())
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
