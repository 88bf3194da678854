"""benchmarks/experiments.py, every experiment docs/performance.md quotes, on the tiny
model with its workloads shrunk (--smoke): each variant's server starts, serves and
stops, and its report is written."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.experiments import EXPERIMENTS


def test_every_experiment_runs_on_the_tiny_model(tiny_llama_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/experiments.py", "--smoke", "--out", str(tmp_path),
         "--port", "8178", *EXPERIMENTS, "http-ratio", "--", "--model", str(tiny_llama_dir),
         "--kv-cache-memory-gb", "0.05", "--block-size", "4"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, variants in EXPERIMENTS.items():
        for variant, _server_flags, stream_args in variants:
            report = json.loads((tmp_path / f"{name}-{variant}.json").read_text())
            requested = int(stream_args[stream_args.index("--num-requests") + 1])
            assert report["num_requests"] == min(requested, 4), (name, variant)
            assert report["num_failed"] == 0, (name, variant, report.get("failures"))
            assert report["model"] == tiny_llama_dir.name  # the flags after -- reached it
            max_new = int(stream_args[stream_args.index("--max-new-tokens") + 1])
            assert report["completion_tokens"] == 4 * min(max_new, 4), (name, variant)
    ratio = json.loads((tmp_path / "http-ratio.json").read_text())
    assert len(ratio["pairs"]) == 1 and ratio["ratios"][0] > 0
