"""benchmarks/disagg.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_disagg_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "disagg.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/disagg.py", "--num-streams", "2", "--stream-tokens", "24",
         "--num-long", "2", "--long-len", "64", "--long-tokens", "4", "--long-interval", "0.3",
         "--json", str(out), "--", "--model", str(tiny_llama_dir), "--device", "cpu",
         "--kv-cache-memory-gb", "0.02", "--block-size", "4", "--tokenizer-workers", "1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    pd, mixed = report["results"]
    assert [pd["config"], mixed["config"]] == ["1 prefill + 1 decode engine", "2 mixed engines"]
    assert pd["stream_tokens"] == mixed["stream_tokens"] == 2 * 24
    # Each long prompt's 16 blocks pulled from the prefill engine, none lost.
    assert pd["long_kv_outcome"] == ["complete", "complete"]
    assert pd["kv"]["blocks"] == 2 * 16 and pd["kv"]["fallbacks"] == 0
    assert mixed["kv"]["blocks"] == 0 and mixed["long_kv_outcome"] == [None, None]
    assert "=== disagg:" in proc.stdout and "P/D / mixed: ITL p99" in proc.stdout
