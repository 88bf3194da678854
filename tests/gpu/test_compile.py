"""Every Triton kernel variant the engine launches for the shipped model shapes
compiles for Hopper (sm_90) without spilling registers: Triton's compiler and ptxas
run on any machine, so this holds without a GPU too."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_every_kernel_variant_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "engine_worker.gpu.compile_check",
                           "--arch", "90"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    # nine shapes, fourteen variants each (three: fp8 cache; two: a sliding window;
    # one: Gemma's GELU gate), and the mixtures' five more (their grouped GEMMs at two
    # tilings, their experts' gate), but gpt-oss's dense gates (it has no dense MLP);
    # Gemma 3's and Qwen3's RoPE with their norms; Gemma 2 2B's and Gemma 3 1B's heads
    # of 256 (the fp8 cache's chunk tiles of 64 rows there, 128 spilled), Gemma 2's
    # attention soft-capped; gpt-oss's with sinks, its experts' GEMMs with biases
    # (and Qwen3-30B-A3B's grouped GEMMs with fp8 weights, at both tilings)
    assert len(lines) == 9 * 14 + 2 * 5 - 2 + 4
    assert [line.split()[0] for line in lines if "q/k norms" in line] == (
        ["gemma-3-1b"] * 2 + ["qwen3-0.6b"] * 2 + ["qwen3-30b-a3b"] * 2)
    experts = [line for line in lines if re.search(r" experts (gate_up|down), ", line)]
    assert [line.split()[0] for line in experts] == ["gpt-oss-20b"] * 4 + ["qwen3-30b-a3b"] * 4
    assert [line.split()[0] for line in lines if re.search(r" experts (gate_up|down) fp8, ",
                                                           line)] == ["qwen3-30b-a3b"] * 4
    assert all(" 0 async copies" not in line for line in experts), proc.stdout
    assert all("0 bytes spilled" in line for line in lines), proc.stdout
    # The attention loop is pipelined: K/V tiles copied asynchronously, several in
    # flight. (Compiled without the JIT's divisibility specializations, as this check
    # once did, Triton loaded them element by element and pipelined nothing.)
    attention = [line for line in lines if "attention" in line]
    assert len(attention) == 9 * 7
    assert all(" 0 async copies" not in line for line in attention), proc.stdout
    # Shared memory read in vectors: an fp8 cache's values, laid out along the keys
    # (engine_worker.ops.value_blocks), reach the tensor cores without byte loads.
    assert all(line.endswith(" 0 byte loads from shared") for line in attention), proc.stdout
    # An fp8 cache's decode loop issues at most a quarter more instructions a key (its
    # warps' together) than a bfloat16 cache's, for half the bytes a key: it read at
    # half the bandwidth while it issued 1.6-1.9 times as many a key (a select of its
    # values past the context, since dropped, took as many as the rest of the loop:
    # 1,820 a pass of 128 keys at the 8B shape, then 963; Triton 3.9).
    def per_key(model: str, kernel: str) -> float:
        line = next(line for line in lines if line.startswith(model) and f" {kernel} " in line)
        found = re.search(r"(\d+) instructions a pass of (\d+) keys on (\d+) warps", line)
        instructions, keys, warps = map(int, found.groups())
        return instructions * warps / keys

    # At head_dim 128 the decode kernel, transposed, on 2 warps, issues 0.6 of them
    # (the heads pad to 8 columns, not 16 rows: 1.29x the row form at batch 256, H200).
    bounds = {"llama-3-8b": 0.75, "qwen2.5-7b": 0.75, "smollm2-135m": 1.25}
    for model, bound in bounds.items():
        assert (per_key(model, "attention decode, fp8 cache")
                <= bound * per_key(model, "attention decode, 1 split(s)")), proc.stdout
