"""``roseserve serve``: the whole local stack as separate processes.

Starts the engine worker, the tokenizer pool and the frontend (each the same
``python -m ...`` a cluster would run), connected over ipc:// sockets in a private
run directory. Ready when the frontend's /health answers 200, which needs the engine
and the tokenizer pool to answer a round trip; then the URL is printed. A component
that exits, during start-up or later, stops the rest and the command exits nonzero
naming it. Ctrl-C (or SIGTERM) stops the frontend first, then the tokenizer pool and
the engine (which finishes what is in flight), and exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

from common.model_files import resolve_model_dir


STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 40.0
STARTUP_STOP_TIMEOUT_S = 3.0


@dataclass
class Component:
    name: str
    cmd: list[str]
    process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        # Own process group: Ctrl-C reaches only the launcher, which stops the
        # components in order.
        self.process = subprocess.Popen(self.cmd, start_new_session=True)

    def exit_code(self) -> Optional[int]:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"roseserve: {self.name} did not stop within {timeout_s:.0f} s; killing it",
                  file=sys.stderr, flush=True)
            self.process.kill()
            self.process.wait()


def _forward(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Flags of ``args`` that are set, in command-line form."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


ENGINE_FLAGS = ["device", "dtype", "threads", "max_model_len", "max_batch_size",
                "prefill_max_batch_size", "max_num_batched_tokens", "block_size",
                "kv_cache_memory_gb", "no_prefix_cache", "no_cpu_kernels", "seed",
                "per_token_output_frames"]
FRONTEND_FLAGS = ["host", "port", "api_key", "served_model_name", "max_body_bytes",
                  "max_waiting_requests", "max_waiting_tokens"]


def serve(args: argparse.Namespace) -> int:
    model_dir = str(resolve_model_dir(args.model))  # materialize once, before the children
    run_dir = tempfile.mkdtemp(prefix="roseserve-")
    engine_addr, tokenizer_addr = f"ipc://{run_dir}/engine.sock", f"ipc://{run_dir}/tokenizer.sock"
    py = [sys.executable, "-m"]
    log = ["--log-level", args.log_level] if args.log_level else []
    engine = Component("the engine worker", py + [
        "engine_worker", "--model", model_dir, "--bind", engine_addr,
        *_forward(args, ENGINE_FLAGS), *log])
    tokenizer = Component("the tokenizer pool", py + [
        "tokenizer_worker", "--model", model_dir, "--bind", tokenizer_addr,
        *(["--workers", str(args.tokenizer_workers)] if args.tokenizer_workers else []), *log])
    frontend = Component("the frontend", py + [
        "frontend", "--model", model_dir, "--engine", engine_addr, "--tokenizer", tokenizer_addr,
        *_forward(args, FRONTEND_FLAGS), *log])
    components = [engine, tokenizer, frontend]

    stop_requested = []
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    url = f"http://{'localhost' if args.host in ('127.0.0.1', '::1') else args.host}:{args.port}"
    code = 0
    ready = False
    try:
        for component in components:
            component.start()
        failure = _wait_ready(components, f"{url}/health", stop_requested)
        if failure is None and not stop_requested:
            ready = True
            print(f"roseserve is ready: {url}/v1 (model {os.path.basename(model_dir)}); "
                  f"Ctrl-C stops it", flush=True)
            failure = _supervise(components, stop_requested)
        if failure is not None:
            print(f"roseserve: {failure}; stopping", file=sys.stderr, flush=True)
            code = 1
    finally:
        # Before readiness nothing is in flight, and a component still starting may
        # not act on SIGTERM until it has started: do not wait long for it.
        for component in (frontend, tokenizer, engine):
            component.stop(STOP_TIMEOUT_S if ready else STARTUP_STOP_TIMEOUT_S)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _exited(components: list[Component]) -> Optional[str]:
    for component in components:
        code = component.exit_code()
        if code is not None:
            return f"{component.name} exited with code {code} (its log is above)"
    return None


def _wait_ready(components: list[Component], health_url: str,
                stop_requested: list) -> Optional[str]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and not stop_requested:
        failure = _exited(components)
        if failure is not None:
            return failure
        try:
            with urllib.request.urlopen(health_url, timeout=2) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    return None if stop_requested else f"not ready after {STARTUP_TIMEOUT_S:.0f} s"


def _supervise(components: list[Component], stop_requested: list) -> Optional[str]:
    while not stop_requested:
        failure = _exited(components)
        if failure is not None:
            return failure
        time.sleep(0.2)
    return None
