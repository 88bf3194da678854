"""``roseserve serve``: the whole stack from one command."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

import processes


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "roseserve", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 180) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen:\n{''.join(lines)}")


def test_serve_starts_everything_answers_and_stops_cleanly(tiny_llama_dir):
    port = processes.free_port()
    proc = serve("--model", str(tiny_llama_dir), "--port", str(port), "--device", "cpu",
                 "--kv-cache-memory-gb", "0.02", "--tokenizer-workers", "1",
                 "--served-model-name", "tiny")
    try:
        lines = read_until(proc, "roseserve is ready")
        assert f"http://localhost:{port}/v1" in lines[-1]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # engine, tokenizer supervisor + worker, frontend
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_component_that_fails_to_start_is_named_and_the_command_fails(tiny_llama_dir,
                                                                        tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    proc = serve("--model", str(model), "--port", str(processes.free_port()),
                 "--device", "cpu", "--tokenizer-workers", "1")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert "unsupported architecture ['FancyNewForCausalLM']" in out
    assert "roseserve: the engine worker exited with code 2" in out


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "port must be in 1..65535"),
    (["--max-batch-size", "0"], "max_batch_size must be a positive integer"),
])
def test_bad_flags_are_refused(args, message, tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "roseserve", "serve", "--model",
                           str(tiny_llama_dir), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
