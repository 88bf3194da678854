"""benchmarks/failover.py, as docs/reliability.md runs it, on the tiny model: the
kills, of one engine, of both in turn and of a P/D decode engine, four streams each (a
step takes 0.1 s more, so that the first engine killed is back before the streams
end). The rolling restart is tests/e2e/test_reliability.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_failover_smoke(tiny_llama_dir, tmp_path):
    out = tmp_path / "failover.json"
    env = {**os.environ, "ROSESERVE_FAULT_PLUGIN": "fault_plugin:install",
           "ROSESERVE_FAULT_STEP_DELAY_S": "0.1", "PYTHONPATH": TESTS}
    proc = subprocess.run(
        [sys.executable, "benchmarks/failover.py", "--faults", "kill,kill-twice,pd",
         "--streams", "4", "--max-tokens", "64",
         "--json", str(out), "--", "--model", str(tiny_llama_dir), "--device", "cpu",
         "--kv-cache-memory-gb", "0.02", "--tokenizer-workers", "1"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every stream complete and identical" in proc.stdout
    results = {r["fault"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["kill", "kill-twice", "pd"]
    for r in results.values():
        assert r["complete"] == r["identical_greedy"] + r["identical_seeded"] == 4, r
        assert r["error_events"] == 0
    # the streams on the killed engine moved; those on the other too, when it was killed
    assert 0 < results["kill"]["failovers"] < 4 and results["pd"]["failovers"] > 0
    assert results["kill-twice"]["failovers"] > 4
    assert results["kill"]["stall_max_s"] is not None
