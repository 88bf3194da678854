"""Starting roseserve's real processes for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


TESTS = os.path.dirname(os.path.abspath(__file__))


def with_faults(env: dict | None) -> dict:
    """The environment for a component; ROSESERVE_FAULT_* variables in ``env`` switch
    on the test fault plugin (tests/fault_plugin.py) in it."""
    env = {**os.environ, **(env or {})}
    if any(k.startswith("ROSESERVE_FAULT_") for k in env):
        env["ROSESERVE_FAULT_PLUGIN"] = "fault_plugin:install"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    return env


class Proc:
    """One component process; its combined output is kept for failure messages."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=with_faults(env))

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        return out


def engine(model_dir, address: str, *extra: str, env: dict | None = None) -> Proc:
    p = Proc(["engine_worker", "--model", str(model_dir), "--device", "cpu", "--bind", address,
              "--kv-cache-memory-gb", "0.02", "--block-size", "4", *extra], env)
    p.address = address
    return p


def tokenizer_pool(model_dir, address: str, workers: int = 2, env: dict | None = None,
                   *extra: str) -> Proc:
    p = Proc(["tokenizer_worker", "--model", str(model_dir), "--workers", str(workers),
              "--bind", address, *extra], env)
    p.address = address
    return p


def frontend(model_dir, engine_address: str, tokenizer_address: str, *extra: str) -> Proc:
    port = free_port()
    p = Proc(["frontend", "--model", str(model_dir), "--engine", engine_address,
              "--tokenizer", tokenizer_address, "--port", str(port), *extra])
    p.url = f"http://127.0.0.1:{port}"
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: Proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited early:\n{proc.stop()}")
        try:
            if httpx.get(proc.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args[0]} not healthy after {timeout_s} s:\n{proc.stop()}")
