"""The paged-attention kernel's tilings, timed on the device at a model's shape: which
one reads the cache fastest, for decode rows and for prompt chunks.

    python benchmarks/gpu_attention.py --model-config llama-3-8b --batches 1,64,256

Decode: B sequences of --context tokens each, one query token a sequence (B from
--batches), their contexts split over programs as the engine splits them (and the
engine's tiling with twice the splits too, where it may); their blocks scattered over
the cache as a busy engine's are. Chunks: --chunk-seqs prompts of
--chunk-len tokens (no cached prefix). A tiling is BLOCK_N x warps x stages for decode
and ROWS x BLOCK_N x warps x stages for chunks (engine_worker/gpu/attention.py's
Tiling); the engine's own (tiling()) comes first, and every other's output is checked
against it. Each time is the median of --repeats replays of a CUDA graph of --iters
calls, as the engine replays its steps (launched from the host, a decode kernel at
batch 64 took the launch's time, not its own); decode as
bandwidth too (the K/V bytes read over the time, and its fraction of the
read-only bandwidth measured in the same run, engine_gpu.read_bandwidth), chunks as TFLOP/s of the
attention's two matmuls (causal: half the square).

On a CPU (TRITON_INTERPRET=1, a tiny model: CI smoke-tests it) the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.engine_gpu import graph_timed, read_bandwidth  # noqa: E402
from common.model_files import resolve_model_dir  # noqa: E402
from engine_worker.gpu import attention  # noqa: E402
from engine_worker.models.registry import load_model_config  # noqa: E402
from engine_worker.ops import FP8, to_cache_dtype, to_value_blocks  # noqa: E402

# Candidates that compile for Hopper without spills at head_dim 128
# (python -m engine_worker.gpu.compile_check prints the engine's own).
DECODE_TILINGS = "64x8x3,64x4x2,64x2x2,64x2x3,32x4x3,32x2x2,128x4x3"
CHUNK_TILINGS = "64x32x8x3,64x64x8x3,64x64x4x3,128x32x8x3,128x64x8x3,64x128x8x3"


def parse_tilings(text: str, decode: bool) -> list[attention.Tiling]:
    out = []
    for item in filter(None, text.split(",")):
        parts = [int(x) for x in item.split("x")]
        if len(parts) != (3 if decode else 4):
            raise SystemExit(f"a {'decode' if decode else 'chunk'} tiling is "
                             f"{'BLOCK_N' if decode else 'ROWS x BLOCK_N'} x warps x stages, "
                             f"got {item!r}")
        if decode:
            out.append(attention.Tiling(*parts))
        else:
            out.append(attention.Tiling(parts[1], parts[2], parts[3], rows=parts[0]))
    return out


def label(t: attention.Tiling, decode: bool) -> str:
    head = f"{t.block_n}" if decode else f"{t.rows}x{t.block_n}"
    return f"{head}x{t.num_warps}x{t.num_stages}"


def scattered_cache(num_seqs: int, context: int, page: int, hkv: int, d: int,
                    dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """K and V caches holding num_seqs contexts in blocks taken at random, and the block
    table: (k_cache, v_cache, block_tables)."""
    width = math.ceil(context / page)
    num_blocks = num_seqs * width
    k, v = (to_cache_dtype(torch.randn(num_blocks, page, hkv, d, generator=gen).to(device),
                           dtype) for _ in range(2))
    v = to_value_blocks(v)  # as the engine's cache holds them
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, width)
    return k, v, tables.to(device, torch.int32)


def against(out: torch.Tensor, ref: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    """(relative L2 of out from ref, the reference): the first tiling's output (the
    engine's own) is the reference of the others."""
    if ref is None:
        return 0.0, out.clone()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item(), ref


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-config", default="llama-3-8b",
                   help="a shipped model shape (common/model_configs) or a model directory")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=640,
                   help="tokens a decode row attends to (512 in, half of 256 out: the "
                        "engine benchmark's average)")
    p.add_argument("--chunk-seqs", type=int, default=16)
    p.add_argument("--chunk-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the cache's keys and values: the queries' dtype, or float8 e4m3")
    p.add_argument("--decode-tilings", default=DECODE_TILINGS)
    p.add_argument("--chunk-tilings", default=CHUNK_TILINGS)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter has no bf16 dot
    cfg = load_model_config(resolve_model_dir(args.model_config))
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    page, scale = args.block_size, d ** -0.5
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    bandwidth = read_bandwidth(device, 4 << 30 if cuda else 16 << 20)
    gen = torch.Generator().manual_seed(0)
    engine_tiles = attention.tilings(d, fp8=args.kv_cache_dtype == "fp8")
    decode_tilings = [engine_tiles[0]] + parse_tilings(args.decode_tilings, True)
    chunk_tilings = [engine_tiles[1]] + parse_tilings(args.chunk_tilings, False)
    cache_dtype = FP8 if args.kv_cache_dtype == "fp8" else dtype
    # (an fp8 cache's dots run in float16: tilings round the probabilities differently)
    tol = 2e-2 if cuda else 1e-3 if cache_dtype == FP8 else 1e-4
    elem = torch.empty((), dtype=cache_dtype).element_size()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"device: {name}; model: {args.model_config} ({hq} query heads, {hkv} KV heads, "
          f"head_dim {d}); KV cache {str(cache_dtype).removeprefix('torch.')}; "
          f"read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    report = {"device": name, "model": args.model_config, "bandwidth_bytes_per_s": bandwidth,
              "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
              "decode": {}, "chunk": {}}
    failed = False

    batches = [int(b) for b in args.batches.split(",") if b]
    k, v, tables = scattered_cache(max(batches), args.context, page, hkv, d, cache_dtype,
                                   device, gen)
    for batch in batches:
        q = torch.randn(batch, hq, d, generator=gen).to(device, dtype)
        out = torch.empty_like(q)
        seq_lens = torch.full((batch,), args.context, dtype=torch.int32, device=device)
        query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
        splits = attention.num_splits(batch, hkv, sms)
        buffers = attention.SplitBuffers.allocate(batch, hq, d, device)
        kv_bytes = batch * args.context * hkv * d * 2 * elem
        print(f"decode, batch {batch}, context {args.context}, {splits} split(s): "
              f"{kv_bytes / 2**20:.0f} MiB of K/V", flush=True)
        ref, rows = None, {}
        # Every tiling with the engine's splits; the engine's tiling with twice as many too.
        runs = [(t, splits, label(t, True)) for t in decode_tilings]
        if 2 * splits <= attention.MAX_SPLITS:
            runs.append((decode_tilings[0], 2 * splits,
                         f"{label(decode_tilings[0], True)}, {2 * splits} splits"))
        for t, n, name in runs:
            def call(t=t, n=n):
                attention.paged_attention(q, k, v, out, tables[:batch], seq_lens, query_start,
                                          batch, None, None, scale, n, buffers,
                                          tiles=(t, chunk_tilings[0]))
            seconds = graph_timed(call, device, args.repeats, args.iters)
            err, ref = against(out, ref)
            failed |= err > tol
            rows[name] = {"us": seconds * 1e6, "bytes_per_s": kv_bytes / seconds,
                          "fraction_of_read": kv_bytes / seconds / bandwidth,
                          "rel_l2_vs_engine": err}
            print(f"  {name:10s} {seconds * 1e6:9.1f} us  "
                  f"{kv_bytes / seconds / 1e12:6.2f} TB/s  "
                  f"{kv_bytes / seconds / bandwidth:6.1%} of read  rel L2 {err:.1e}", flush=True)
        report["decode"][str(batch)] = rows

    n, length = args.chunk_seqs, args.chunk_len
    k, v, tables = scattered_cache(n, length, page, hkv, d, cache_dtype, device, gen)
    q = torch.randn(n * length, hq, d, generator=gen).to(device, dtype)
    out = torch.empty_like(q)
    seq_lens = torch.full((n,), length, dtype=torch.int32, device=device)
    query_start = (torch.arange(n + 1, dtype=torch.int32) * length).to(device)
    flops = 4 * n * hq * d * length * (length + 1) / 2  # QK^T and PV, causal
    print(f"chunks: {n} prompts of {length} tokens", flush=True)
    ref = None
    for t in chunk_tilings:
        block_q = attention.chunk_block_q(hq // hkv, t)
        tile_seq, tile_offset = attention.chunk_tiles([length] * n, 0, block_q)
        tile_seq = torch.from_numpy(tile_seq).to(device)
        tile_offset = torch.from_numpy(tile_offset).to(device)

        def call(t=t, tile_seq=tile_seq, tile_offset=tile_offset):
            attention.paged_attention(q, k, v, out, tables, seq_lens, query_start, 0,
                                      tile_seq, tile_offset, scale,
                                      tiles=(decode_tilings[0], t))
        seconds = graph_timed(call, device, args.repeats, args.iters)
        err, ref = against(out, ref)
        failed |= err > tol
        report["chunk"][label(t, False)] = {"us": seconds * 1e6, "flops_per_s": flops / seconds,
                                            "rel_l2_vs_engine": err}
        print(f"  {label(t, False):12s} {seconds * 1e6:9.1f} us  "
              f"{flops / seconds / 1e12:6.1f} TFLOP/s  rel L2 {err:.1e}", flush=True)

    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        print(f"a tiling's output differs from the engine's by more than {tol}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
