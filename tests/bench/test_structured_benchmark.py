"""benchmarks/structured.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_structured_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "structured.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/structured.py", "--model", str(tiny_llama_dir),
         "--batch", "3", "--steps", "8", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "JSON-schema" in proc.stdout
    report = json.loads(out.read_text())
    assert report["plain_tokens_identical"] is True
    assert report["step_ms_plain"] > 0 and report["step_ms_with_json"] > 0
    assert 0 < report["mask_ms_median"] < 100
