"""benchmarks/accuracy.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_accuracy_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "accuracy.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/accuracy.py", "--model", str(tiny_llama_dir),
         "--max-tokens", "4", "--num-prompts", "3", "--text-tokens", "80", "--window", "32",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [f["format"] for f in report["formats"]] == ["float32", "bfloat16", "int8"]
    reference = report["formats"][0]
    assert reference["perplexity_ratio"] == 1.0 and reference["identical_outputs"] == 1.0
    for f in report["formats"]:
        assert math.isfinite(f["perplexity"]) and f["perplexity"] > 1
        assert 0.0 <= f["tokens_before_first_difference"] <= 1.0
