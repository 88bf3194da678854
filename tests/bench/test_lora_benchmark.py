"""benchmarks/lora.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_lora_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, "benchmarks/lora.py", "--model", str(tiny_llama_dir),
                           "--streams", "4", "--adapters", "2", "--rank", "4",
                           "--output-len", "4", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["adapters_changed_tokens"] and result["ratio"] > 0
    assert "over 2 adapters of rank 4" in proc.stdout
