"""benchmarks/moe.py, in the form docs/performance.md runs it, on a tiny mixture."""

from __future__ import annotations

import json
import subprocess
import sys


def test_moe_benchmark_smoke(tiny_qwen3_moe_dir, tiny_gpt_oss_dir, tmp_path):
    """A tiny Qwen3-MoE's checkpoint; a shipped shape's config cut to one layer of
    random weights (the docs' form; gpt-oss's, whose per-layer list is cut too, from
    the tiny one's config): both paths run, and the ratio is printed."""
    out = tmp_path / "moe.json"
    for tiny, model in (
            (True, ["--model-config", str(tiny_qwen3_moe_dir), "--load-format", "auto"]),
            (False, ["--model-config", "qwen3-30b-a3b", "--layers", "1"]),
            (False, ["--model-config", str(tiny_gpt_oss_dir), "--layers", "1"])):
        proc = subprocess.run(
            [sys.executable, "benchmarks/moe.py", *model, "--quantization", "int8",
             "--concurrency", "3", "--input-len", "5", "--output-len", "3",
             "--repeats", "1", "--json", str(out)],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["weights"] == "int8" and set(report["results"]) == {"3"}
        for row in report["results"].values():
            assert row["fused_tokens_per_s"] > 0 and row["layered_tokens_per_s"] > 0
        assert "fused / layered" in proc.stdout
        if tiny:   # a checkpoint's tokens are the same both ways
            assert all(row["same_tokens"] for row in report["results"].values())
