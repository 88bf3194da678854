"""``roseserve serve``: the whole local stack as separate supervised processes.

Starts N engine workers (``--engines``), the tokenizer pool and the frontend (each the
same ``python -m ...`` a cluster would run), connected over ipc:// sockets in a private
run directory. Ready when the frontend's /health answers 200 (the tokenizer pool and
at least one engine answer a round trip); then the URL is printed. ``--frontends M``
runs M frontends over the same engines, on consecutive ports from ``--port``, for a
balancer in front of them (each learns what the engines cache from the engines).

Supervision: a component that exits during start-up is a configuration error; the
command stops everything and exits 1, naming it. Once the stack has been ready, a
component that exits is restarted after a backoff (0.5 s, doubling to 8 s); the
others keep serving meanwhile (the frontend answers 503 with Retry-After while no
engine is up, and reconnects to a restarted one by itself). A component that fails
MAX_FAILURES times in a row, each run shorter than STABLE_S, is crash-looping: the
command gives up, names it and prints its last log lines, stops the rest and exits 1.
Ctrl-C (or SIGTERM) stops the frontends first (they refuse new connections and let
the requests in flight finish, up to --drain-timeout), then the tokenizer pool and the
engines together (the engines finish what is still in flight), and exits 0.

Rolling restart: SIGHUP restarts the engines one at a time (to load new weights or a
new release). Each is sent SIGTERM and drains: it tells the frontend at once, which
sends it nothing more and sends whatever it refuses to another engine; it finishes
what it runs and exits. It is started again, and the next one is drained only once
the frontend reports the new one healthy. With two or more engines no request fails;
with one, requests that arrive while it restarts get 503 with Retry-After.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from common.model_files import materialization_pending, resolve_model_dir
from roseserve.healthcheck import open_local


STARTUP_TIMEOUT_S = 900.0
# A component stopping gets its drain's timeout and this much more before it is killed.
STOP_MARGIN_S = 10.0
STARTUP_STOP_TIMEOUT_S = 3.0
# Restart policy.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0
MAX_FAILURES = 5
STABLE_S = 60.0
# Log lines of a component kept for the give-up message.
TAIL_LINES = 20


@dataclass
class Component:
    name: str
    cmd: list[str]
    env: Optional[dict] = None
    process: Optional[subprocess.Popen] = None
    started: float = 0.0
    # Exits in a row of runs shorter than STABLE_S, and when the next start is due.
    failures: int = 0
    restart_at: Optional[float] = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    # Its socket address, for an engine (the rolling restart waits for it).
    address: Optional[str] = None
    # Being restarted on purpose (a rolling restart): the supervisor leaves it alone.
    restarting: bool = False
    # From SIGTERM to SIGKILL (--drain-timeout and a margin).
    stop_timeout_s: float = 30.0 + STOP_MARGIN_S

    def start(self) -> None:
        # Own process group: Ctrl-C reaches only the launcher, which stops the
        # components in order. Output passes through the launcher, which keeps the
        # last lines for its messages.
        self.process = subprocess.Popen(self.cmd, start_new_session=True, env=self.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
        self.restart_at = None
        threading.Thread(target=self._pump, args=(self.process.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        out = sys.stderr.buffer
        for line in iter(stream.readline, b""):
            self.tail.append(line.decode("utf-8", "replace").rstrip())
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):  # our own stderr is gone: keep draining
                pass
        stream.close()

    def exit_code(self) -> Optional[int]:
        return None if self.process is None else self.process.poll()

    def last_lines(self) -> str:
        return "\n".join(f"  {self.name} | {line}" for line in self.tail)

    def stop(self) -> None:
        stop_all([self])


def stop_all(stack: list[Component], timeout_s: Optional[float] = None) -> None:
    """SIGTERM every running component at once, wait for them all until one deadline
    (``timeout_s``, else the longest of their stop timeouts), then kill what is left."""
    running = [c for c in stack if c.process is not None and c.process.poll() is None]
    for c in running:
        c.process.send_signal(signal.SIGTERM)
    if timeout_s is None:
        timeout_s = max((c.stop_timeout_s for c in running), default=0.0)
    deadline = time.monotonic() + timeout_s
    for c in running:
        try:
            c.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"roseserve: {c.name} did not stop within {timeout_s:.0f} s; killing it",
                  file=sys.stderr, flush=True)
            c.process.kill()
            c.process.wait()


def _forward(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Flags of ``args`` that are set, in command-line form."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False or (isinstance(value, list) and not value):
            continue
        if isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag] if value is True else [flag, str(value)]
    return out


ENGINE_FLAGS = ["device", "dtype", "quantization", "max_model_len", "max_batch_size",
                "prefill_max_batch_size", "max_num_batched_tokens", "block_size",
                "kv_cache_memory_gb", "kv_cache_dtype", "gpu_memory_utilization", "load_format",
                "enforce_eager", "speculative_tokens", "attention_backend", "no_prefix_cache",
                "no_cpu_kernels", "seed", "per_token_output_frames", "kv_transfer_timeout",
                "kv_transfer_window_bytes", "kv_offload_memory_gb", "kv_offload_dir",
                "kv_offload_disk_gb", "kv_store_address", "kv_store_timeout", "drain_timeout",
                "tensor_parallel_size", "lora_modules", "max_loras", "max_lora_rank",
                "pooling"]
# The API key is not among them: a command line is visible to every local user, so
# the key reaches the frontend through its environment.
FRONTEND_FLAGS = ["host", "api_key_file", "served_model_name", "max_body_bytes",
                  "max_waiting_requests", "max_waiting_tokens", "max_choices_per_request",
                  "tokenize_timeout", "request_timeout", "routing", "request_retries",
                  "failover_timeout", "dns_refresh", "disagg_min_prompt_tokens", "kv_lease",
                  "stream_interval", "drain_timeout", "no_access_log", "allowed_origins",
                  "ssl_certfile", "ssl_keyfile", "reasoning_parser", "chat_template",
                  "generation_config", "return_tokens_as_token_ids", "otlp_traces_endpoint"]


def engine_roles(args: argparse.Namespace) -> list[str]:
    """Each engine's --role: --prefill-engines then --decode-engines, else --engines
    mixed ones (1 by default)."""
    if args.prefill_engines or args.decode_engines:
        return ["prefill"] * args.prefill_engines + ["decode"] * args.decode_engines
    return ["mixed"] * (args.engines or 1)


def engine_threads(args: argparse.Namespace) -> Optional[int]:
    """--threads, else the cores shared out among the engines (None for one engine:
    torch's default; a rank of one split over tensor-parallel ranks: its share)."""
    n = len(engine_roles(args))
    if args.threads is not None or n == 1:
        return args.threads
    return max(1, (os.cpu_count() or 1) // (n * args.tensor_parallel_size))


def components(args: argparse.Namespace, model_dir: str, run_dir: str) -> list[Component]:
    """The KV store (with --kv-store), the engines, then the tokenizer pool, then the
    frontend."""
    py = [sys.executable, "-m"]
    log = ["--log-level", args.log_level] if args.log_level else []
    threads = engine_threads(args)
    store = []
    engine_flags = _forward(args, ENGINE_FLAGS)
    if args.kv_store:
        store_address = f"ipc://{run_dir}/kv-store.sock"
        store.append(Component("kv-store", py + [
            "kv_store", "--bind", store_address, "--memory", str(args.kv_store_memory),
            *(["--disk-dir", args.kv_store_dir] if args.kv_store_dir else []), *log]))
        engine_flags += ["--kv-store-address", store_address]
    engines = []
    roles = engine_roles(args)
    for i, role in enumerate(roles):
        env = None
        if len(roles) > 1 and str(args.device).startswith("cuda") and \
                "CUDA_VISIBLE_DEVICES" not in os.environ:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}  # one GPU each
        address = f"ipc://{run_dir}/engine-{i}.sock"
        engines.append(Component(f"engine-{i}", py + [
            "engine_worker", "--model", model_dir, "--bind", address, "--role", role,
            *(["--threads", str(threads)] if threads else []),
            *engine_flags, *log], env=env, address=address))
    tokenizer_addr = f"ipc://{run_dir}/tokenizer.sock"
    tokenizer = Component("tokenizer", py + [
        "tokenizer_worker", "--model", model_dir, "--bind", tokenizer_addr,
        *(["--workers", str(args.tokenizer_workers)] if args.tokenizer_workers else []),
        *_forward(args, ["chat_template"]), *log])
    frontends = []
    for i in range(args.frontends):
        frontend = Component("frontend" if args.frontends == 1 else f"frontend-{i}", py + [
            "frontend", "--model", model_dir, "--tokenizer", tokenizer_addr,
            *[a for e in engines for a in ("--engine", e.address)],
            "--port", str(args.port + i), *_forward(args, FRONTEND_FLAGS), *log])
        if args.api_key:
            frontend.env = {**os.environ, "ROSESERVE_API_KEY": ",".join(args.api_key)}
        frontends.append(frontend)
    stack = [*store, *engines, tokenizer, *frontends]
    for c in stack:
        c.stop_timeout_s = args.drain_timeout + STOP_MARGIN_S
    return stack


def frontend_urls(args: argparse.Namespace) -> list[str]:
    host = "localhost" if args.host in ("127.0.0.1", "::1") else args.host
    scheme = "https" if args.ssl_certfile else "http"
    return [f"{scheme}://{host}:{args.port + i}" for i in range(args.frontends)]


def prebuild_cpu_kernels(args: argparse.Namespace) -> Optional[subprocess.Popen]:
    """On a model's first start on a machine, the CPU kernels' build (about 11 s on 2
    cores) in a process of its own while the model's folder is made (12 s for the
    default model, single-threaded), which the engines would otherwise do one after
    the other; an engine that starts before it is done waits for it (kernels.py locks
    the build). None where nothing is to gain (a GPU, or no folder to make)."""
    on_gpu = str(args.device).startswith("cuda") or (
        args.device == "auto" and os.path.exists("/dev/nvidiactl"))
    if on_gpu or args.no_cpu_kernels or not materialization_pending(args.model):
        return None
    # SIGTERM ends it as an exception would: its compilers stopped, its files removed
    code = ("import logging, signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(1)); "
            "logging.basicConfig(level=logging.INFO, format='%(message)s'); "
            "from engine_worker.cpu.build import cpu_kernels; cpu_kernels()")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            start_new_session=True)


def stop_prebuild(prebuild: subprocess.Popen) -> None:
    """The kernels' build stopped, with its compilers (done long ago, unless start-up
    failed early)."""
    prebuild.terminate()
    try:
        prebuild.wait(timeout=STARTUP_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    try:   # its session: the compilers, had it not stopped them
        os.killpg(prebuild.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    prebuild.wait()


def serve(args: argparse.Namespace) -> int:
    prebuild = prebuild_cpu_kernels(args)
    try:   # the model's folder made once, before the children
        return _serve(args, str(resolve_model_dir(args.model)))
    finally:
        if prebuild is not None:
            stop_prebuild(prebuild)


def _serve(args: argparse.Namespace, model_dir: str) -> int:
    run_dir = tempfile.mkdtemp(prefix="roseserve-")
    stack = components(args, model_dir, run_dir)

    stop_requested: list = []
    restart_requested: list = []
    signal.signal(signal.SIGINT, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    signal.signal(signal.SIGHUP, lambda *_: restart_requested.append(True))
    urls = frontend_urls(args)
    code = 0
    ready = False
    try:
        for component in stack:
            component.start()
        failure = _wait_ready(stack, urls, stop_requested)
        if failure is None and not stop_requested:
            ready = True
            print(f"roseserve is ready: {', '.join(f'{url}/v1' for url in urls)} (model "
                  f"{os.path.basename(model_dir)}, {_describe(engine_roles(args))}); Ctrl-C stops "
                  f"it, SIGHUP restarts the engines one at a time", flush=True)
            failure = _supervise(stack, stop_requested, restart_requested,
                                 [f"{url}/metrics" for url in urls])
        if failure is not None:
            print(f"roseserve: {failure}; stopping", file=sys.stderr, flush=True)
            code = 1
    finally:
        # Before readiness nothing is in flight, and a component still starting may
        # not act on SIGTERM until it has started: do not wait long for it.
        # The frontends first, so that nothing new reaches the engines; then the
        # tokenizer pool and the engines together.
        timeout_s = None if ready else STARTUP_STOP_TIMEOUT_S
        frontends = [c for c in stack if c.name.startswith("frontend")]
        stop_all(frontends, timeout_s)
        stop_all([c for c in stack if c not in frontends], timeout_s)
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _describe(roles: list[str]) -> str:
    if set(roles) == {"mixed"}:
        return f"{len(roles)} engine(s)"
    return f"{roles.count('prefill')} prefill and {roles.count('decode')} decode engine(s)"


def _wait_ready(stack: list[Component], frontend_urls: list[str],
                stop_requested: list) -> Optional[str]:
    """Until every frontend's /health answers 200 and each reports every engine
    healthy (a frontend serves once one engine is; with prefill and decode engines,
    the first requests would not be split yet)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    engines = [c.address for c in stack if c.address is not None]
    waiting = [f"{url}/health" for url in frontend_urls]
    waiting += [f"{url}/metrics" for url in frontend_urls]
    while time.monotonic() < deadline and not stop_requested:
        for component in stack:
            code = component.exit_code()
            if code is not None:
                return f"{component.name} exited with code {code} during start-up (its log is above)"
        if waiting[0].endswith("/metrics"):
            ready = all(_engine_healthy(waiting[0], address) for address in engines)
        else:
            try:
                with open_local(waiting[0], timeout=2) as response:
                    ready = response.status == 200
            except OSError:
                ready = False
        if ready:
            waiting.pop(0)
            if not waiting:
                return None
            continue
        time.sleep(0.3)
    return None if stop_requested else f"not ready after {STARTUP_TIMEOUT_S:.0f} s"


def _supervise(stack: list[Component], stop_requested: list, restart_requested: list,
               metrics_urls: list[str]) -> Optional[str]:
    """Restart what exits, until a stop is requested or something crash-loops; on
    SIGHUP, restart the engines one at a time (in a thread: this loop goes on)."""
    rolling: Optional[threading.Thread] = None
    while not stop_requested:
        if restart_requested:
            restart_requested.clear()
            if rolling is not None and rolling.is_alive():
                print("roseserve: a rolling restart is already under way", file=sys.stderr,
                      flush=True)
            else:
                rolling = threading.Thread(target=_rolling_restart, daemon=True, args=(
                    [c for c in stack if c.address is not None], metrics_urls, stop_requested))
                rolling.start()
        now = time.monotonic()
        for c in stack:
            if c.restarting:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    print(f"roseserve: restarting {c.name}", file=sys.stderr, flush=True)
                    c.start()
                continue
            code = c.exit_code()
            if code is None:
                continue
            ran_s = now - c.started
            c.failures = c.failures + 1 if ran_s < STABLE_S else 1
            if c.failures >= MAX_FAILURES:
                return (f"{c.name} is crash-looping: it exited {c.failures} times in a row, "
                        f"each within {STABLE_S:.0f} s of starting (last exit code {code}); "
                        f"giving up. Its last log lines:\n{c.last_lines()}\n")
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (c.failures - 1))
            print(f"roseserve: {c.name} exited with code {code} after {ran_s:.1f} s; "
                  f"restarting it in {delay:g} s", file=sys.stderr, flush=True)
            c.restart_at = now + delay
        time.sleep(0.1)
    return None


def _rolling_restart(engines: list[Component], metrics_urls: list[str],
                     stop_requested: list) -> None:
    """Drain and restart each engine in turn; the next waits until every frontend has
    the restarted one healthy (each says Hello every heartbeat until the engine is
    back)."""
    began = time.monotonic()
    for c in engines:
        if stop_requested:
            return
        c.restarting = True
        try:
            print(f"roseserve: rolling restart: draining {c.name}", file=sys.stderr, flush=True)
            c.stop()
            if stop_requested:
                return
            c.start()
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not all(_engine_healthy(url, c.address) for url in metrics_urls):
                if stop_requested or c.exit_code() is not None or time.monotonic() > deadline:
                    print(f"roseserve: rolling restart stopped: {c.name} did not come back "
                          f"healthy", file=sys.stderr, flush=True)
                    return  # the supervisor takes over (it restarts an exited engine)
                time.sleep(0.2)
        finally:
            c.restarting = False
    print(f"roseserve: rolling restart of {len(engines)} engine(s) done in "
          f"{time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)


def _engine_healthy(metrics_url: str, address: Optional[str]) -> bool:
    """Whether the frontend reports the engine at ``address`` healthy (its
    roseserve_engine_healthy gauge)."""
    try:
        with open_local(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return False
    return f'roseserve_engine_healthy{{engine="{address}"}} 1.0' in text
