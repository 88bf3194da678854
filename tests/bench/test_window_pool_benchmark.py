"""benchmarks/window_pool.py, in the form docs/performance.md runs it, on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def run(args: list[str], out) -> dict:
    proc = subprocess.run([sys.executable, "benchmarks/window_pool.py", *args, "--repeats",
                           "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "two pools / one pool" in proc.stdout
    return json.loads(out.read_text())


def test_window_pool_benchmark_smoke(tiny_gemma3_dir, tiny_llama_dir, tmp_path):
    """The tiny Gemma 3's checkpoint (2 sliding layers, a window of 9, and a full one)
    at a KV memory where one pool holds 136 tokens of context and preempts, and two
    pools hold 240 and do not; the same tokens both ways. A shipped shape cut to its
    first six layers (the docs' form) runs too; a model of full attention alone is
    refused."""
    out = tmp_path / "window.json"
    report = run(["--model-config", str(tiny_gemma3_dir), "--load-format", "auto",
                  "--kv-cache-memory-mb", "0.1", "--block-size", "4", "--max-batch-size", "4",
                  "--max-num-batched-tokens", "16", "--num-requests", "4", "--input-len", "40",
                  "--output-len", "8"], out)
    two, one = report["results"]["two pools"], report["results"]["one pool"]
    assert (two["context_tokens"], one["context_tokens"]) == (240, 136)
    assert two["preemptions"] == 0 < one["preemptions"]
    assert report["same_tokens"] and report["window"] == 9
    report = run(["--model-config", "gemma-3-1b", "--layers", "6", "--quantization", "int8",
                  "--kv-cache-memory-mb", "8", "--num-requests", "2", "--input-len", "8",
                  "--output-len", "2"], out)
    assert (report["layers"], report["window"], report["weights"]) == (6, 512, "int8")
    assert all(row["tokens_per_s"] > 0 for row in report["results"].values())
    proc = subprocess.run([sys.executable, "benchmarks/window_pool.py", "--model-config",
                           str(tiny_llama_dir), "--load-format", "auto", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "do not mix full attention and a sliding window" in (
        proc.stderr)
