"""benchmarks/frontend.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_frontend_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "frontend.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/frontend.py", "--model", str(tiny_llama_dir),
         "--concurrency", "1,3", "--repeats", "2", "--input-len", "8", "--output-len", "6",
         "--serve-flag=--kv-cache-memory-gb=0.05", "--serve-flag=--block-size=4",
         "--serve-flag=--stream-interval=2",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["formats"]) == {"float32", "int8"}
    for rows in report["formats"].values():
        assert set(rows) == {"1", "3"}
        for row in rows.values():
            assert len(row["ratios"]) == len(row["cpu_ms_per_token"]) == 2
            assert row["http_over_in_process"] > 0 and row["frontend_cpu_ms_per_token"] >= 0
            assert row["in_process_tokens_per_s"] > 0 and row["http_tokens_per_s"] > 0
