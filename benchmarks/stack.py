"""A ``roseserve serve`` stack for benchmarks that start their own (soak.py,
routing.py): start, wait, read /metrics and per-process resources, stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx
import psutil


class Stack:
    """``roseserve serve`` started by a benchmark, its output in a temporary file."""

    def __init__(self, serve_args: list[str], name: str = "bench") -> None:
        frontends = int(serve_args[serve_args.index("--frontends") + 1]) \
            if "--frontends" in serve_args else 1
        port = _free_ports(frontends)
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(frontends)]
        self.url = self.urls[0]
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-serve-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "roseserve", "serve", "--port", str(port),
             "--served-model-name", name, *serve_args],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"roseserve serve exited:\n{self.tail()}")
            if "roseserve is ready" in Path(self.log.name).read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise SystemExit(f"roseserve serve not ready:\n{self.tail()}")

    def tail(self) -> str:
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(True)[-30:])

    def resources(self) -> dict[str, dict]:
        """RSS (MB) and open fds of each component process (and the launcher)."""
        out = {}
        root = psutil.Process(self.proc.pid)
        counts: Counter = Counter()
        for p in [root, *root.children(recursive=True)]:
            try:
                cmd = " ".join(p.cmdline())
                name = ("launcher" if p.pid == root.pid else
                        next((k for k in ("engine_worker", "tokenizer_worker", "frontend")
                              if f"-m {k}" in cmd), None) or
                        ("tokenizer worker" if "spawn_main" in cmd else "helper"))
                counts[name] += 1
                key = name if counts[name] == 1 else f"{name} {counts[name]}"
                out[key] = {"pid": p.pid, "rss_mb": round(p.memory_info().rss / 2**20, 1),
                            "fds": p.num_fds()}
            except psutil.Error:
                continue
        return out

    def rolling_restart(self, timeout_s: float = 300.0) -> None:
        """SIGHUP: the engines restarted one at a time; back once all are."""
        done = "rolling restart of"
        before = Path(self.log.name).read_text(errors="replace").count(done)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while Path(self.log.name).read_text(errors="replace").count(done) == before:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the rolling restart did not finish:\n{self.tail()}")
            time.sleep(0.3)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first + 1, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


def metric(text: str, name: str, **labels) -> float:
    """Sum of the series of ``name`` in a /metrics text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-0-9.e+]+)$", line)
        if m and m.group(1) == name and all(
                f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def add_shape_args(p, model: str) -> None:
    """A benchmark's model arguments: a shipped shape or a folder, random weights or
    its own, cut to its first layers (shape_dir), and the CPU kernels' weight format."""
    from common.config import QUANTIZATIONS

    p.add_argument("--model-config", default=model,
                   help="a shipped model shape (common/model_configs) or a model directory")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--layers", type=int, default=None,
                   help="keep the first N layers (dummy weights only)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS)


def shape_dir(model: str, layers: Optional[int], load_format: str, tmp: Path) -> Path:
    """A model's folder (a shipped shape's name or a path); with ``layers``, a copy of
    its config in ``tmp`` cut to its first that many layers (random weights only)."""
    from common.model_files import resolve_model_dir

    path = resolve_model_dir(model)
    if layers is None:
        return path
    if load_format != "dummy":
        raise SystemExit("--layers cuts a config: it needs --load-format dummy")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):   # per-layer lists, cut to match
        config["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("mlp_only_layers"), list):
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def cpu_model() -> str:
    """The CPU as a figure should name it: its model name, family and model (a VM's
    "AMD EPYC" is a Zen 3 or a Zen 5), its widest vector ISA and the cores used."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown CPU"
    have = set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"),
                                         ("avx2", "AVX2")) if flag in have), "no AVX2")
    family = f"family {fields['cpu family']}, model {fields['model']}; " \
        if "cpu family" in fields and "model" in fields else ""
    return f"{fields.get('model name', 'unknown CPU')} ({family}{isa}; {os.cpu_count()} cores)"


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def simd_flags() -> list[str]:
    """The SIMD features this CPU reports (of those the engine's kernels could use)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in SIMD_FLAGS if f in have]
    except OSError:
        pass
    return []

