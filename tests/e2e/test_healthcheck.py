"""python -m roseserve.healthcheck, as the compose file's health checks run it."""

from __future__ import annotations

import subprocess
import sys
import time

import processes


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roseserve.healthcheck", *args,
                           "--timeout", "2"], capture_output=True, text=True, timeout=60)


def until_ok(*args: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check(*args).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{args} never healthy: {check(*args).stderr}")


def test_engine_and_tokenizer_pool_health_over_their_sockets(tiny_llama_dir, tmp_path):
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock")
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    try:
        until_ok("engine", engine.address)
        until_ok("tokenizer", pool.address)
        # An idle loop comes round every second: a stall limit above that passes.
        assert check("engine", engine.address, "--stall", "3").returncode == 0
    finally:
        engine.stop()
        pool.stop()
    down = check("engine", engine.address)
    assert down.returncode == 1 and "no answer from the engine" in down.stderr


def test_http_health(tmp_path):
    port = processes.free_port()
    r = check("http", f"http://127.0.0.1:{port}/metrics")
    assert r.returncode == 1 and f"127.0.0.1:{port}" in r.stderr


def test_a_stuck_engine_loop_fails_the_check(tiny_llama_dir, tmp_path):
    import zmq

    from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, PROTOCOL_VERSION, AddRequest,
                                 Codec, Hello, SamplingParams)

    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock",
                              env={"ROSESERVE_FAULT_STALL": "1:8"})  # first step: +8 s
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        until_ok("engine", engine.address)
        codec = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)
        sock.connect(engine.address)
        sock.send_multipart(codec.encode(Hello(client_id="t", protocol_version=PROTOCOL_VERSION)))
        sock.send_multipart(codec.encode(AddRequest(
            request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2))))
        time.sleep(4)  # inside the stalled step
        stuck = check("engine", engine.address, "--stall", "2")
        assert stuck.returncode == 1 and "stuck in one iteration" in stuck.stderr
        assert check("engine", engine.address).returncode == 0  # the default limit: 300 s
    finally:
        sock.close(linger=0)
        ctx.term()
        engine.stop()


def test_a_draining_engine_is_alive_but_not_ready(tiny_llama_dir, tmp_path):
    import signal

    import zmq

    from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, PROTOCOL_VERSION, AddRequest,
                                 Codec, Hello, SamplingParams)

    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.05"})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        until_ok("engine", engine.address, "--ready")
        codec = Codec(CLIENT_MESSAGES, ENGINE_MESSAGES)
        sock.connect(engine.address)
        sock.send_multipart(codec.encode(Hello(client_id="t", protocol_version=PROTOCOL_VERSION)))
        sock.send_multipart(codec.encode(AddRequest(  # 300 steps of 50 ms: still draining
            request_id="r", prompt_token_ids=[1, 2, 3],
            params=SamplingParams(max_tokens=300, ignore_eos=True))))
        time.sleep(1.0)
        engine.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert check("engine", engine.address).returncode == 0  # alive
        not_ready = check("engine", engine.address, "--ready")
        assert not_ready.returncode == 1 and "is draining" in not_ready.stderr
    finally:
        sock.close(linger=0)
        ctx.term()
        engine.stop()
