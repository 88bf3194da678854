"""benchmarks/speculation.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations





def test_the_benchmark_runs(tiny_llama_dir, tmp_path):
    """benchmarks/speculation.py as docs/performance.md runs it, on the tiny model."""
    import json
    import subprocess
    import sys

    out = tmp_path / "speculation.json"
    proc = subprocess.run([sys.executable, "benchmarks/speculation.py", "--model",
                           str(tiny_llama_dir), "--max-tokens", "12", "--repeats", "1",
                           "--concurrency", "1,2", "--speculative-tokens", "2,4",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 3 * 2 and all(r["same_output"] for r in rows)
    assert all(r["output_tokens"] == 12 * r["concurrency"] for r in rows)
