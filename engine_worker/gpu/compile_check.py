"""Compiles every Triton kernel variant the CUDA engine launches for a model, for a
GPU architecture, without a GPU: Triton's front end, LLVM and ptxas (shipped in
Triton's wheel) all run on a CPU. Prints each variant's registers and spills, and for
the attention kernels the instructions a pass of their loop takes (a tile of keys).

    python -m engine_worker.gpu.compile_check --model llama-3-8b --arch 90

Catches what Triton's interpreter cannot: code the compiler rejects (types that differ
between branches, unsupported operations) and register spills. Exits 1 if a variant
fails to compile or spills. Run it without TRITON_INTERPRET set.

It compiles what the engine's launches compile: Triton's JIT specializes each pointer
and integer argument on divisibility by 16, and at every shipped shape the pointers
and strides are (sizes multiples of 16), but for the block table's row and the slot
mapping's stride. Without that, Triton cannot prove a K/V row's 16-byte alignment: it
loads one element at a time, does not pipeline the loads (no async copies) and needs
two to three times the registers (228 against 64-120 for the decode kernel at head_dim
128), so the figures said nothing of the kernels that run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine_worker.gpu import attention, moe, ops

_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


# Every Triton kernel the CUDA engine launches.
KERNELS = (attention._decode_kernel, attention._chunk_kernel, attention._merge_splits_kernel,
           ops._add_rms_norm_kernel, ops._rope_write_kv_kernel, ops._silu_mul_kernel,
           moe._expert_gemm_kernel)


def compiled_kernels() -> int:
    """Variants of the engine's Triton kernels compiled so far in this process (0
    under Triton's interpreter, which compiles nothing)."""
    # device_caches: per device, a tuple whose first item maps keys to compiled kernels.
    return sum(len(caches[0]) for kernel in KERNELS
               for caches in getattr(kernel, "device_caches", {}).values())


def _dtype_name(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]


def variants(cfg, dtype: str = "bfloat16", block_size: int = 16) -> list[tuple]:
    """(label, kernel, argument types by name, constexprs, options) of every launch
    the engine makes for model config ``cfg`` (engine_worker.models.config.ModelConfig);
    options: num_warps and num_stages."""
    t = f"*{_dtype_name(dtype)}"
    group = cfg.num_heads // cfg.num_kv_heads
    d, d_pad = cfg.head_dim, triton.next_power_of_2(cfg.head_dim)
    common = dict(GROUP=group, PAGE=block_size, HEAD_DIM=d, D_PAD=d_pad,
                  PRECISION="ieee" if dtype == "float32" else "tf32", WINDOW=0,
                  SOFTCAP=float(cfg.attn_softcap),   # Gemma 2's scores soft-capped
                  SINKS=cfg.attn_sinks)              # gpt-oss's sink logits
    decode_args = dict(q_ptr=t, k_ptr=t, v_ptr=t, out_ptr=t, part_acc_ptr="*fp32",
                       part_ml_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i64",
                       sinks_ptr=t, scale="fp32")
    chunk_args = dict(q_ptr=t, k_ptr=t, v_ptr=t, out_ptr=t, block_tables_ptr="*i32",
                      seq_lens_ptr="*i64", query_start_ptr="*i64", tile_seq_ptr="*i64",
                      tile_offset_ptr="*i64", sinks_ptr=t, scale="fp32")
    fp8 = dict(k_ptr="*fp8e4nv", v_ptr="*fp8e4nv")  # --kv-cache-dtype fp8

    def decode_launch(label: str, cache: dict, splits: int, window: int = 0) -> tuple:
        decode = attention.tiling(d, decode=True, fp8=bool(cache))
        return (label, attention._decode_kernel, dict(decode_args, **cache),
                dict(common, HEADS=attention.decode_heads(group),
                     BLOCK_N=decode.block_n, SPLITS=splits, WINDOW=window), _options(decode))

    def chunk_launch(label: str, cache: dict, window: int = 0) -> tuple:
        chunk = attention.tiling(d, decode=False, fp8=bool(cache))
        return (label, attention._chunk_kernel, dict(chunk_args, **cache),
                dict(common, GROUP_PAD=triton.next_power_of_2(group),
                     BLOCK_Q=attention.chunk_block_q(group, chunk), BLOCK_N=chunk.block_n,
                     WINDOW=window), _options(chunk))

    out = [decode_launch(f"attention decode, {splits} split(s)", {}, splits)
           for splits in (1, attention.MAX_SPLITS)]
    out += [chunk_launch("attention chunk", {}),
            decode_launch("attention decode, fp8 cache", fp8, 1),
            chunk_launch("attention chunk, fp8 cache", fp8)]
    # a sliding window's variants (Mistral's 4,096 keys; each window compiles its own)
    out += [decode_launch("attention decode, window", {}, attention.MAX_SPLITS, 4096),
            chunk_launch("attention chunk, window", {}, 4096)]
    out.append(("merge splits", attention._merge_splits_kernel,
                dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr=t, sinks_ptr=t),
                dict(SPLITS=attention.MAX_SPLITS, HEAD_DIM=d, D_PAD=d_pad,
                     SINKS=cfg.attn_sinks), _options()))
    for label, residual in (("add_rms_norm", False), ("add_rms_norm + residual", True)):
        c = cfg.hidden_size
        out.append((label, ops._add_rms_norm_kernel,
                    dict(x_ptr=t, residual_ptr=t, weight_ptr=t, out_ptr=t, h_ptr=t, eps="fp32"),
                    dict(C=c, BLOCK=triton.next_power_of_2(c), HAS_RESIDUAL=residual),
                    _options(num_warps=ops._warps(c))))
    half = d // 2
    heads_pad = triton.next_power_of_2(cfg.num_heads + 2 * cfg.num_kv_heads)
    # Qwen3's q and k norms inside
    norms = ", q/k norms" if cfg.qk_norm else ""
    # (an fp8 cache's keys and values scaled: kv_scales.py)
    for label, cache, scale in ((f"rope_write_kv{norms}", t, t),
                                (f"rope_write_kv{norms}, fp8 cache", "*fp8e4nv", "*fp32")):
        out.append((label, ops._rope_write_kv_kernel,
                    dict(qkv_ptr=t, cos_ptr=t, sin_ptr=t, k_cache_ptr=cache, v_cache_ptr=cache,
                         slot_ptr="*i64", q_norm_ptr=t, k_norm_ptr=t, scale_ptr=scale,
                         eps="fp32"),
                    dict(NUM_HEADS=cfg.num_heads, NUM_KV_HEADS=cfg.num_kv_heads,
                         HEADS_PAD=heads_pad, HALF=half, HALF_PAD=triton.next_power_of_2(half),
                         PAGE=block_size, QK_NORM=cfg.qk_norm, SCALED=scale != t),
                    _options(num_warps=ops._rope_warps(heads_pad * half))))
    i = cfg.intermediate_size
    # gelu: Gemma's gate (none where every MLP is a mixture's: gpt-oss)
    for label, gelu in (("silu_mul", False), ("gelu_mul", True)) if i else ():
        out.append((label, ops._silu_mul_kernel, dict(x_ptr=t, out_ptr=t),
                    dict(WIDTH=i, BLOCK=min(1024, triton.next_power_of_2(i)), GELU=gelu),
                    _options()))
    if cfg.moe_layers:
        out += _expert_variants(cfg, t)
    return out


def _expert_variants(cfg, t: str) -> list[tuple]:
    """A mixture's grouped GEMMs (gate and up from the tokens; down from the rows,
    weighted) at both tilings (few rows an expert, and many), and its experts' gate;
    MXFP4 experts' (gpt-oss's checkpoints) decoded in the kernel."""
    c, i = cfg.hidden_size, cfg.expert_intermediate_size
    mxfp4 = cfg.expert_format == "mxfp4"
    w = "*u8" if mxfp4 else t
    out = []
    for tokens, size in ((1, "decode"), (cfg.num_experts + 1, "prompt")):
        tiles = moe.expert_tiling(tokens, cfg.num_experts)
        sizes = dict(TOP_K=cfg.experts_per_token, PRECISION="tf32", BLOCK_M=tiles.block_m,
                     BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
        options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        # (fp8 weights, --quantization fp8, where the checkpoint's are not MXFP4)
        for fp8 in (False, True) if not mxfp4 else (False,):
            for label, n, k, weighted in (("gate_up", 2 * i, c, False), ("down", c, i, True)):
                out.append((f"experts {label}{' fp8' if fp8 else ''}, {size} tiles",
                            moe._expert_gemm_kernel,
                            dict(a_ptr=t, w_ptr="*fp8e4nv" if fp8 else w, out_ptr=t,
                                 rows_ptr="*i32", tile_expert_ptr="*i32",
                                 route_ptr="*fp32" if weighted else t, bias_ptr=t,
                                 scale_ptr="*fp32" if fp8 else w),
                            dict(sizes, N=n, K=k, PER_TOKEN=not weighted, WEIGHTED=weighted,
                                 HAS_BIAS=cfg.expert_bias, MXFP4=mxfp4, FP8=fp8), options))
    # (gpt-oss's: clamped)
    out.append(("silu_mul, experts", ops._silu_mul_kernel, dict(x_ptr=t, out_ptr=t),
                dict(WIDTH=i, BLOCK=min(1024, triton.next_power_of_2(i)), GELU=False,
                     LIMIT=cfg.swiglu_limit, ALPHA=cfg.swiglu_alpha), _options()))
    return out


def _options(tiles: Optional[attention.Tiling] = None, num_warps: int = 4) -> dict:
    """A launch's compile options: a tiling's, else Triton's defaults but num_warps."""
    if tiles is not None:
        return {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return {"num_warps": num_warps}


# Integer arguments the JIT does not see divisible by 16 (see the module's text).
_NOT_DIVISIBLE = ("stride_bt", "stride_slot", "stride_sn")   # (MXFP4 scales: in / 32)


def compile_variant(kernel, arg_types: dict, constexprs: dict, options: dict, arch: int):
    names = [p.name for p in kernel.params]
    signature = {n: "constexpr" if n in constexprs else arg_types.get(n, "i32") for n in names}
    divisible = [n for n in names if n not in constexprs and n not in _NOT_DIVISIBLE
                 and (n.endswith("_ptr") or n.startswith("stride"))]
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _on_cubin(cubin: bytes, tool: Path, *args: str) -> str:
    """What one of the CUDA binary tools shipped beside ptxas prints for the cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        return subprocess.run([str(tool), *args, str(path)], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes per thread) of the kernel in Triton's own cubin,
    from cuobjdump (shipped beside ptxas). Triton kernels keep no arrays in local
    memory, so any local memory is spilled registers. Reading the cubin Triton built
    (rather than assembling its PTX again) checks exactly what it would load, with the
    ptxas it chose: Triton 3.9 emits PTX that only its newer bundled ptxas accepts."""
    report = _on_cubin(cubin, _CUOBJDUMP, "--dump-resource-usage")
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    if usage is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report: {report!r}")
    registers, stack, local = map(int, usage.groups())
    return registers, stack + local


def shared_byte_loads(sass: str) -> int:
    """Loads of single bytes from shared memory in the kernel's machine code (nvdisasm's,
    shipped beside ptxas). An 8-bit tensor-core operand laid out across the axis a
    product sums over is read so, a byte at a time, where a vector load takes 16 (the
    fp8 cache's values were); docs/performance.md, "An fp8 KV cache"."""
    return len(re.findall(r"\bLDS\.(?:U|S)8\b", sass))


def loop_instructions(sass: str) -> int:
    """Instructions in one pass of the kernel's longest loop (0 if it has none): from
    the label a backward branch goes to, to that branch. An attention kernel's loop
    takes a tile of keys a pass; where it reads memory at its bandwidth, the
    instructions it issues for each byte bound it (an fp8 cache's decode loop issued
    2.4 times a bfloat16 cache's for each byte and read at half the bandwidth)."""
    at, count, longest = {}, 0, 0   # label -> instructions before it; so far; longest
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            at[label.group(1)] = count
        elif re.match(r"\s+/\*[0-9a-f]+\*/\s+\S", line):
            count += 1
            target = re.search(r"\bBRA\b.*`\(\.(L_x_\d+)\)", line)
            if target and target.group(1) in at:
                longest = max(longest, count - at[target.group(1)])
    return longest


def check(model: str, arch: int, dtype: str) -> list[dict]:
    from common.model_files import resolve_model_dir
    from engine_worker.models.registry import load_model_config

    cfg = load_model_config(resolve_model_dir(model))
    rows = []
    for label, kernel, arg_types, constexprs, options in variants(cfg, dtype):
        row = {"model": model, "kernel": label, "error": None}
        try:
            compiled = compile_variant(kernel, arg_types, constexprs, options, arch)
            row["registers"], row["spill_bytes"] = resources(compiled.asm["cubin"])
            sass = _on_cubin(compiled.asm["cubin"], _CUOBJDUMP.parent / "nvdisasm")
            row["shared_byte_loads"] = shared_byte_loads(sass)
            row["loop_instructions"] = loop_instructions(sass)
            row["loop_keys"] = constexprs.get("BLOCK_N") if "attention" in label else None
            row["warps"] = options["num_warps"]
            row["shared_bytes"] = compiled.metadata.shared
            # Loads copied asynchronously into shared memory: the loop is pipelined.
            row["async_copies"] = compiled.asm["ttgir"].count("async_copy_global_to_local")
        except Exception as e:  # reported, and the run fails
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append",
                   help="model shape or directory (repeatable; default: every shipped shape)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="models compiled at once, each in a process of its own (default: "
                        "one per core; compiling is single-threaded)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    from common.model_files import model_shapes

    models = args.model or model_shapes()
    failed = False
    with concurrent.futures.ProcessPoolExecutor(
            max(1, min(args.jobs, len(models))),
            mp_context=multiprocessing.get_context("spawn")) as pool:
        results = pool.map(functools.partial(check, arch=args.arch, dtype=args.dtype), models)
        rows = [row for model_rows in results for row in model_rows]   # (in models' order)
    for row in rows:
        if row["error"] or row["spill_bytes"]:
            failed = True
        status = row["error"] or (f"{row['registers']:3d} registers, "
                                  f"{row['spill_bytes']} bytes spilled, "
                                  f"{row['shared_bytes']} bytes shared, "
                                  f"{row['async_copies']} async copies, "
                                  + (f"{row['loop_instructions']} instructions a pass "
                                     f"of {row['loop_keys']} keys on {row['warps']} warps, "
                                     if row["loop_keys"] else "")
                                  + f"{row['shared_byte_loads']} byte loads from shared")
        print(f"{row['model']:14s} {row['kernel']:32s} {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
