"""benchmarks/multiturn.py, as docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys


def test_multiturn_benchmark_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "multiturn.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/multiturn.py", "--conversations", "8", "--turns", "3",
         "--first-len", "40", "--message-len", "8", "--max-new-tokens", "4",
         "--concurrency", "2", "--pool-gb", "0.0001", "--offload-gb", "0.01",
         "--vocab", "50257", "--json", str(out), "--",
         "--model", str(tiny_llama_dir), "--device", "cpu", "--block-size", "4",
         "--tokenizer-workers", "1"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    off, on, one, store = report["results"]
    assert [r["config"] for r in report["results"]] == [
        "pool only", "host tier", "1 engine, 2x pool", "store, 2 engines"]
    assert report["same_replies"] is True
    # 8 conversations of ~19 blocks each through a 52-block pool: without the tier the
    # later turns find little; with it, their whole earlier turns come back.
    assert off["blocks_copied_back"] == {"host": 0, "disk": 0}
    assert on["blocks_copied_back"]["host"] > 0
    assert on["prefix_cache_hit_rate"] > off["prefix_cache_hit_rate"] + 0.2
    # Round-robin sends each turn to the other engine: it finds the last in the store,
    # and so does the turn after both engines restarted with empty pools.
    assert store["store_hits"] > 0
    assert store["hit_rate_by_turn"][0] == 0 and min(store["hit_rate_by_turn"][1:]) > 0.5
    assert len(store["hit_rate_by_turn"]) == 4 and store["after_restart_hit_rate"] > 0.5
    assert "the turn after a rolling restart / the turn before" in proc.stdout
    assert report["cpu"]
