"""benchmarks/soak.py, as docs/reliability.md runs it, for a few seconds on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_soak_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--duration", "8", "--warmup", "2",
         "--concurrency", "8", "--max-tokens", "8", "--json", str(out), "--",
         "--model", str(tiny_llama_dir), "--device", "cpu", "--kv-cache-memory-gb", "0.02",
         "--tokenizer-workers", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["requests"] >= 20, report
    assert not any(report["held_after"].values()), report["held_after"]
    kinds = {key.split()[0] for key in report["outcomes"]}
    assert kinds >= {"stream", "chat", "abandon", "drop", "invalid", "responses"}, kinds
    for name in ("engine_worker", "tokenizer_worker", "frontend", "tokenizer worker"):
        assert report["resources_end"][name]["rss_mb"] > 0
        assert report["resources_start"][name]["fds"] > 0
    assert report["component_restarts"] == 0 and report["serve_exit_code"] == 0
    assert "requests lost: 0" in proc.stdout
