"""benchmarks/routing.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_routing_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "routing.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/routing.py", "--num-prefixes", "4",
         "--shared-prefix-len", "32", "--input-len", "40", "--num-requests", "24",
         "--max-new-tokens", "4", "--max-concurrency", "4", "--json", str(out), "--",
         "--model", str(tiny_llama_dir), "--device", "cpu", "--kv-cache-memory-gb", "0.02",
         "--block-size", "4", "--tokenizer-workers", "1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    one, prefix, two_frontends, least = report["results"]
    assert [r["config"] for r in report["results"]] == [
        "1 engine", "2 engines, prefix-aware", "2 engines, prefix, 2 frontends",
        "2 engines, least-loaded"]
    assert len(one["engines"]) == 1 and len(prefix["engines"]) == 2
    assert sum(one["engines"].values()) == 24
    # 4 prefixes over 24 requests: one engine computes each prefix once.
    assert one["prefix_cache_hit_rate"] > 0.5
    assert prefix["hit_rate_vs_one_engine"] >= 0.9
    # Each frontend routes by what the engines report, whichever frontend sent it.
    assert sum(two_frontends["engines"].values()) == 24
    assert report["two_frontends_vs_one"] >= 0.9
    assert "two frontends' hit rate / one frontend's" in proc.stdout
    assert "=== routing:" in proc.stdout and report["cpu"]
