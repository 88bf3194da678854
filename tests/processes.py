"""Starting roseserve's real processes for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.stack import metric as parse_metric, scrape


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
        # A file, not a pipe: nothing reads a pipe until stop(), and a full one would
        # block the process at its next log line (the frontend logs every request).
        self._out = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdout=self._out,
                                     stderr=subprocess.STDOUT, env=with_faults(env),
                                     start_new_session=True)

    def output(self) -> str:
        """What it has written so far."""
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    def stop(self) -> str:
        """Kill it and whatever it started; its output (once)."""
        if self._out.closed:
            return ""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        out = self.output()
        self._out.close()
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


@contextlib.contextmanager
def local_stack(model_dir, run_dir, *frontend_args: str, engine_args=(), workers: int = 1,
                engine_env: dict | None = None):
    """An engine, a tokenizer pool and a frontend over ipc:// sockets in ``run_dir``;
    yields the frontend (``.url``) once healthy, and stops all three at the end."""
    engine_proc = engine(model_dir, f"ipc://{run_dir}/engine.sock", *engine_args,
                         env=engine_env)
    pool = tokenizer_pool(model_dir, f"ipc://{run_dir}/tok.sock", workers=workers)
    front = frontend(model_dir, engine_proc.address, pool.address, *frontend_args)
    try:
        wait_healthy(front)
        yield front
    finally:
        for p in (front, pool, engine_proc):
            p.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: Proc, timeout_s: float = 120.0, engines: tuple[str, ...] = ()) -> None:
    """Until the frontend's /health answers 200 (one engine is enough for that) and
    reports each of ``engines`` (addresses) healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited early:\n{proc.stop()}")
        try:
            health = httpx.get(proc.url + "/health", timeout=2)
            if health.status_code == 200 and all(
                    health.json()["checks"].get(f"engine {a}") == "ok" for a in engines):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args[0]} not healthy after {timeout_s} s:\n{proc.stop()}")


class Serve:
    """``roseserve serve`` with the tiny model, its output in a file (a pipe nobody
    reads would fill and block the stack)."""

    def __init__(self, model_dir, log_path, *extra: str, env: dict | None = None,
                 engines: int | None = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "roseserve", "serve", "--model", str(model_dir),
             "--port", str(self.port), "--device", "cpu", "--kv-cache-memory-gb", "0.02",
             "--block-size", "4", "--tokenizer-workers", "2",
             *(["--engines", str(engines)] if engines else []),
             "--served-model-name", "tiny", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=with_faults(env))

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "roseserve is ready" in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"roseserve serve exited early:\n{self.log()}")
            time.sleep(0.2)
        raise RuntimeError(f"roseserve serve not ready after {timeout_s} s:\n{self.log()}")

    def pids(self) -> dict[str, list[int]]:
        """Live component processes by kind: engine, tokenizer (the pool),
        tokenizer_worker, frontend, kv_store."""
        import psutil

        out: dict[str, list[int]] = {"engine": [], "tokenizer": [], "tokenizer_worker": [],
                                     "frontend": [], "kv_store": []}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                cmd = " ".join(child.cmdline())
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            if "-m engine_worker" in cmd:
                out["engine"].append(child.pid)
            elif "-m tokenizer_worker" in cmd:
                out["tokenizer"].append(child.pid)
            elif "-m frontend" in cmd:
                out["frontend"].append(child.pid)
            elif "-m kv_store" in cmd:
                out["kv_store"].append(child.pid)
            elif "spawn_main" in cmd:
                out["tokenizer_worker"].append(child.pid)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def serves(url: str) -> bool:
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    except httpx.HTTPError:
        return False


def metric(url: str, name: str, **labels) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    return parse_metric(scrape(url), name, **labels)
