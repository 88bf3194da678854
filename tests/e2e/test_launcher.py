"""``roseserve serve``: the whole stack from one command."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

import processes

TLS = os.path.join(processes.TESTS, "tls")  # a self-signed pair for localhost, 127.0.0.1


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "roseserve", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 180) -> list[str]:
    """Its output's lines up to the first holding ``needle``. A thread reads the pipe
    (from the first call on, to the end): a silent process fails the test at the
    deadline instead of blocking it, and one that goes on writing never fills it."""
    if not hasattr(proc, "lines"):
        proc.lines = queue.Queue()

        def pump():
            for line in proc.stdout:
                proc.lines.put(line)
            proc.lines.put(None)  # it ended

        threading.Thread(target=pump, daemon=True).start()
    lines = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = proc.lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            proc.lines.put(None)
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen in {timeout_s} s:\n{''.join(lines)}")


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


def test_serve_over_https(tiny_llama_dir):
    cert, key = os.path.join(TLS, "cert.pem"), os.path.join(TLS, "key.pem")
    port = processes.free_port()
    proc = serve("--model", str(tiny_llama_dir), "--port", str(port), "--device", "cpu",
                 "--kv-cache-memory-gb", "0.02", "--tokenizer-workers", "1",
                 "--served-model-name", "tiny", "--ssl-certfile", cert, "--ssl-keyfile", key)
    try:
        lines = read_until(proc, "roseserve is ready")  # its probes went over HTTPS
        assert f"https://localhost:{port}/v1" in lines[-1]
        trusted = ssl.create_default_context(cafile=cert)
        r = httpx.post(f"https://localhost:{port}/v1/completions", timeout=60, verify=trusted,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        check = subprocess.run([sys.executable, "-m", "roseserve.healthcheck", "http",
                                f"https://127.0.0.1:{port}/metrics"], capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


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
    assert "roseserve: engine-0 exited with code 2 during start-up" in out


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "port must be in 1..65535"),
    (["--max-batch-size", "0"], "max_batch_size must be a positive integer"),
    (["--stream-interval", "0"], "stream_interval must be a positive integer"),
    (["--failover-timeout", "-1"], "failover_timeout_s must be 0 or more"),
    (["--drain-timeout", "0"], "drain_timeout_s must be positive"),
    (["--threads", "99999"], "num_threads must be in 1..1024"),   # OpenMP crashed at start
    (["--allowed-origins", "https://ui.example/app"], "an allowed origin is * or scheme://host"),
    (["--ssl-certfile", "cert.pem"], "HTTPS needs both --ssl-certfile and --ssl-keyfile"),
    (["--api-key", "a,b"], "an API key must be non-empty, without whitespace or commas"),
    (["--otlp-traces-endpoint", "collector:4318"], "must be an http:// or https:// URL"),
    (["--ssl-certfile", os.path.join(TLS, "key.pem"), "--ssl-keyfile",
      os.path.join(TLS, "key.pem")], "cannot load the TLS certificate"),
    (["--kv-store", "--kv-store-address", "tcp://127.0.0.1:5559"],
     "--kv-store runs a KV store here; --kv-store-address names"),
    (["--kv-store", "--kv-store-memory", "0"], "--kv-store-memory must be positive"),
    (["--kv-offload-memory", "0"], "a size in GiB must be positive, got 0.0"),
    (["--kv-store-timeout", "-1"], "kv_store_timeout_s must be positive"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be in 1..64"),
])
def test_bad_flags_are_refused(args, message, tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "roseserve", "serve", "--model",
                           str(tiny_llama_dir), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_serve_gives_its_drain_timeout_to_every_process_and_waits_past_it(tmp_path):
    from roseserve.cli import build_parser
    from roseserve.launcher import STOP_MARGIN_S, components

    args = build_parser().parse_args(["serve", "--engines", "2", "--drain-timeout", "7",
                                      "--stream-interval", "3", "--no-access-log",
                                      "--failover-timeout", "5",
                                      "--allowed-origins", "https://a.example", "*"])
    stack = components(args, "model", str(tmp_path))
    for c in stack:
        assert c.stop_timeout_s == 7 + STOP_MARGIN_S, c.name
        if not c.name.startswith("tokenizer"):
            assert c.cmd[c.cmd.index("--drain-timeout") + 1] == "7.0", c.name
    (front,) = [c for c in stack if c.name == "frontend"]
    assert front.cmd[front.cmd.index("--stream-interval") + 1] == "3"
    assert front.cmd[front.cmd.index("--failover-timeout") + 1] == "5.0"
    assert "--no-access-log" in front.cmd
    at = front.cmd.index("--allowed-origins")
    assert front.cmd[at + 1:at + 3] == ["https://a.example", "*"]
    # A chat template reaches both the pool (which renders chats) and the frontend.
    args = build_parser().parse_args(["serve", "--chat-template", "t.jinja",
                                      "--reasoning-parser", "qwen3",
                                      "--speculative-tokens", "4"])
    stack = components(args, "model", str(tmp_path))
    engine = [c for c in stack if c.name == "engine-0"][0]
    assert engine.cmd[engine.cmd.index("--speculative-tokens") + 1] == "4"
    for name in ("tokenizer", "frontend"):
        (c,) = [c for c in stack if c.name == name]
        assert c.cmd[c.cmd.index("--chat-template") + 1] == "t.jinja", name
    assert "--reasoning-parser" in [c for c in stack if c.name == "frontend"][0].cmd
    args = build_parser().parse_args(["serve"])
    assert "--no-access-log" not in [c for c in components(args, "m", str(tmp_path))
                                     if c.name == "frontend"][0].cmd


def test_a_cluster_sets_the_new_knobs_from_its_environment(monkeypatch):
    """What compose and swarm pass in the environment reaches each process's flags."""
    from engine_worker.__main__ import build_parser as engine_parser
    from frontend.__main__ import build_parser as frontend_parser
    from tokenizer_worker.__main__ import build_parser as pool_parser

    monkeypatch.setenv("ROSESERVE_SPECULATIVE_TOKENS", "3")
    monkeypatch.setenv("ROSESERVE_REASONING_PARSER", "qwen3")
    monkeypatch.setenv("ROSESERVE_CHAT_TEMPLATE", "/models/t.jinja")
    monkeypatch.setenv("ROSESERVE_TENSOR_PARALLEL_SIZE", "2")
    assert engine_parser().parse_args([]).speculative_tokens == 3
    assert engine_parser().parse_args([]).tensor_parallel_size == 2
    front = frontend_parser().parse_args([])
    assert (front.reasoning_parser, front.chat_template) == ("qwen3", "/models/t.jinja")
    assert pool_parser().parse_args([]).chat_template == "/models/t.jinja"
    for name in ("ROSESERVE_SPECULATIVE_TOKENS", "ROSESERVE_REASONING_PARSER",
                 "ROSESERVE_TENSOR_PARALLEL_SIZE"):
        monkeypatch.setenv(name, "")  # compose's ${VAR:-}: unset
    assert engine_parser().parse_args([]).speculative_tokens == 0
    assert engine_parser().parse_args([]).tensor_parallel_size == 1
    assert frontend_parser().parse_args([]).reasoning_parser is None


@pytest.mark.parametrize("how", ["flag", "environment", "file"])
def test_the_api_key_is_on_no_child_command_line(tiny_llama_dir, tmp_path, how):
    """Two keys, given each way; either is taken (an old and a new key while clients
    move over), and neither is on a command line."""
    port = processes.free_port()
    key, other = "k3y-0f-" + how, "0ther-k3y"
    args = ["--model", str(tiny_llama_dir), "--port", str(port), "--device", "cpu",
            "--kv-cache-memory-gb", "0.02", "--tokenizer-workers", "1",
            "--served-model-name", "tiny"]
    env = dict(os.environ)
    if how == "flag":
        args += ["--api-key", key, "--api-key", other]
    elif how == "environment":
        env["ROSESERVE_API_KEY"] = f"{key}, {other}"
    else:
        (tmp_path / "key").write_text(f"{key}\n\n{other}\n")
        args += ["--api-key-file", str(tmp_path / "key")]
    proc = subprocess.Popen([sys.executable, "-m", "roseserve", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        read_until(proc, "roseserve is ready")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children and not [c for c in children
                                 if key in " ".join(c.cmdline()) or other in " ".join(c.cmdline())]
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        for k in (key, other):
            ok = httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {k}"})
            assert ok.status_code == 200
        wrong = httpx.post(url, json=body, timeout=60, headers={"Authorization": "Bearer k3y"})
        assert wrong.status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_a_crash_looping_component_is_given_up_on_named_with_its_last_lines(tiny_llama_dir,
                                                                            tmp_path):
    trigger = tmp_path / "crash"
    serve_ = processes.Serve(tiny_llama_dir, tmp_path / "serve.log",
                             env={"ROSESERVE_FAULT_EXIT_IF_FILE": f"tokenizer_pool:{trigger}"})
    try:
        serve_.wait_ready()
        trigger.write_text("")  # from now on the pool dies as it starts
        os.kill(serve_.pids()["tokenizer"][0], signal.SIGKILL)
        assert serve_.proc.wait(120) == 1
    finally:
        serve_.stop()
    log = serve_.log()
    assert "roseserve: tokenizer exited with code -9" in log
    assert log.count("roseserve: restarting tokenizer") == 4
    assert "roseserve: tokenizer is crash-looping: it exited 5 times in a row" in log
    # Its last log lines are quoted in the give-up message.
    assert "  tokenizer | injected start failure in the tokenizer_pool" in log
    assert not psutil.pid_exists(serve_.proc.pid) or serve_.proc.poll() is not None


CHILD = """
import signal, sys, time
log = open(sys.argv[1], "a")
def term(*_):
    if sys.argv[2] == "ignore":
        return
    log.write(f"term {time.monotonic()}\\n"); log.flush()
    time.sleep(0.5)  # a drain
    log.write(f"exit {time.monotonic()}\\n"); log.flush()
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
log.write("up\\n"); log.flush()
time.sleep(60)
"""


def test_stop_all_signals_every_component_before_waiting_and_kills_at_the_deadline(tmp_path):
    from roseserve.launcher import Component, stop_all

    stack = [Component(f"c{i}", [sys.executable, "-c", CHILD, str(tmp_path / f"c{i}.log"),
                                 "ignore" if i == 3 else "drain"]) for i in range(4)]
    for c in stack:
        c.start()
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"c{i}.log").exists() and (tmp_path / f"c{i}.log").read_text()
                  for i in range(4)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stop_all(stack, timeout_s=3.0)
    assert [c.process.returncode for c in stack] == [0, 0, 0, -signal.SIGKILL]
    events = [line.split() for i in range(3)
              for line in (tmp_path / f"c{i}.log").read_text().splitlines()[1:]]
    terms = [float(t) for kind, t in events if kind == "term"]
    exits = [float(t) for kind, t in events if kind == "exit"]
    # Each was told to stop before any had finished stopping (one after another, the
    # second would hear of it only after the first had drained).
    assert len(terms) == len(exits) == 3 and max(terms) < min(exits)


@pytest.mark.parametrize("flags, message", [
    (["--engines", "0"], "--engines must be at least 1, got 0"),
    (["--frontends", "0"], "--frontends must be at least 1, got 0"),
    (["--tokenizer-workers", "0"], "--tokenizer-workers must be at least 1, got 0")])
def test_a_count_of_processes_below_one_is_refused_before_anything_starts(flags, message,
                                                                          capsys):
    from roseserve import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *flags])
    assert e.value.code == 2 and f"roseserve serve: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["roseserve", "serve"], ["roseserve", "generate"],
                                     ["frontend"]])
def test_a_model_that_is_not_there_is_one_line_not_a_traceback(command, tmp_path):
    for model, message in [(tmp_path / "nowhere", "model directory '{}' does not exist"),
                           (tmp_path / "notes.txt", "'{}' is a file, not a model directory")]:
        if model.suffix:
            model.write_text("not a model")
        proc = subprocess.run([sys.executable, "-m", *command, "--model", str(model)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert message.format(model) in proc.stderr and "Traceback" not in proc.stderr


def test_a_reasoning_parser_the_model_cannot_take_stops_the_frontend_with_one_line(
        tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "frontend", "--model", str(tiny_llama_dir),
                           "--reasoning-parser", "qwen3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert ("cannot start the frontend: reasoning parser qwen3: the model's tokenizer has no "
            "<think> token") in proc.stderr and "Traceback" not in proc.stderr


def test_a_first_start_builds_the_cpu_kernels_while_the_model_folder_is_made(
        monkeypatch, tmp_path, tiny_llama_dir):
    """Only where a folder is to be made (the default model's, a GGUF file's first use)
    and the engines run on the CPU kernels; the build's process fills the cache the
    engines then read."""
    from common import model_files
    from engine_worker.cpu.build import cached_path
    from roseserve import cli, launcher

    monkeypatch.setenv("ROSESERVE_CACHE_DIR", str(tmp_path))
    assert model_files.materialization_pending(None)   # nothing in this cache yet
    assert model_files.materialization_pending(str(model_files._find_gguf()))
    assert not model_files.materialization_pending(str(tiny_llama_dir))   # a folder as it is

    def args(*flags):
        return cli.build_parser().parse_args(["serve", *flags])

    assert launcher.prebuild_cpu_kernels(args("--model", str(tiny_llama_dir))) is None
    assert launcher.prebuild_cpu_kernels(args("--device", "cuda")) is None
    assert launcher.prebuild_cpu_kernels(args("--no-cpu-kernels")) is None
    build = launcher.prebuild_cpu_kernels(args("--device", "cpu"))
    assert build is not None and build.wait(timeout=600) == 0
    assert cached_path().is_file()


def test_a_start_that_cannot_make_the_model_folder_stops_its_kernel_build(
        monkeypatch, tmp_path):
    """The model's folder fails while the kernels' build started beside it compiles:
    the build stops with it, its compilers and its files too."""
    from common.errors import ModelLoadError
    from roseserve import cli, launcher

    monkeypatch.setenv("ROSESERVE_CACHE_DIR", str(tmp_path))
    kernels = tmp_path / "kernels"
    builds = []
    start = launcher.prebuild_cpu_kernels
    monkeypatch.setattr(launcher, "prebuild_cpu_kernels",
                        lambda args: builds.append(start(args)) or builds[-1])

    def fails_mid_build(model):
        deadline = time.monotonic() + 120
        while not (kernels.is_dir() and any(p.is_dir() for p in kernels.iterdir())):
            assert time.monotonic() < deadline and builds[0].poll() is None
            time.sleep(0.02)
        raise ModelLoadError("bad.gguf: not a model")
    monkeypatch.setattr(launcher, "resolve_model_dir", fails_mid_build)
    with pytest.raises(ModelLoadError):
        launcher.serve(cli.build_parser().parse_args(["serve", "--device", "cpu"]))
    assert len(builds) == 1 and builds[0].returncode is not None
    deadline = time.monotonic() + 2   # no compiler of its runs on (a compile: 6-10 s)
    while _commands_naming(str(kernels)):
        assert time.monotonic() < deadline, _commands_naming(str(kernels))
        time.sleep(0.05)
    # no compile folder, no half-built library: the build lock alone
    assert [p.suffix for p in kernels.iterdir()] == [".lock"]


def _commands_naming(text: str) -> list[str]:
    """The command lines of the processes running whose arguments hold ``text``."""
    return [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline"])
            if any(text in a for a in p.info["cmdline"] or ())]
