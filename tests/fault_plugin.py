"""Faults the tests inject into real roseserve processes, through the one hook
(common/faults.py: ROSESERVE_FAULT_PLUGIN=fault_plugin:install). Each fault is switched
on by a test-only environment variable:

  any component
    ROSESERVE_FAULT_EXIT_IF_FILE   "COMPONENT:PATH": that component exits with code 7
                                   when it starts while PATH exists (a crash loop)
  engine
    ROSESERVE_FAULT_HELLO_DELAY_S  answer each client's first Hello this many seconds
                                   late (a handshake still under way)
    ROSESERVE_FAULT_STEP_DELAY_S   sleep this long after every step (requests stay
                                   queued or running long enough to observe)
    ROSESERVE_FAULT_STALL          "N:S": step number N takes S seconds more (one
                                   stall, as a hung loop that recovers)
    ROSESERVE_FAULT_DIE_FILE       while this file exists, holding a number N, the
                                   engine kills itself (SIGKILL) in the step where a
                                   request's output reaches N tokens, before it sends
                                   that step's outputs; the file is removed first
    ROSESERVE_FAULT_FAIL_TOKEN     a request whose prompt holds this token id fails
                                   in its logits processing at its third token
    ROSESERVE_FAULT_CUDA_ERROR_TOKEN  once a request whose prompt holds this token id
                                   is added, every forward pass raises CUDA's
                                   illegal-address error (a sticky error)
    ROSESERVE_FAULT_KV             a prefill engine's answers to KV pulls spoiled:
                                   "corrupt", "drop", "delay:S" or "exit:N" (_kv_faults)
    ROSESERVE_FAULT_ADAPTER_EXIT   the engine exits (code 7) as it starts loading the
                                   LoRA adapter of this name (a crash mid-load)
  tokenizer_worker
    ROSESERVE_FAULT_CRASH_MARKER   a batch holding this text kills the worker...
    ROSESERVE_FAULT_CRASH_SLOTS    ...if its slot is listed (comma-separated)
    ROSESERVE_FAULT_SCRIPTS        JSON {"TOKEN": [ids]}: a request whose prompt holds
                                   token id TOKEN generates those ids first (its
                                   logits forced), then its own
    ROSESERVE_FAULT_SLOW_MARKER    a batch holding this text takes longer...
    ROSESERVE_FAULT_SLOW_S         ...by this many seconds (default 2)
    ROSESERVE_FAULT_HANG_MARKER    a batch holding this text never finishes...
    ROSESERVE_FAULT_HANG_SLOTS     ...in the workers listed (default: every worker)
"""

from __future__ import annotations

import json
import os
import signal
import time


def _env(name: str) -> str:
    return os.environ.get("ROSESERVE_FAULT_" + name, "")


def install(component: str, target, **context) -> None:
    exit_component, _, path = _env("EXIT_IF_FILE").partition(":")
    if exit_component == component and os.path.exists(path):
        print(f"injected start failure in the {component}", flush=True)
        os._exit(7)
    if component == "engine":
        _engine(target)
    elif component == "tokenizer_worker":
        _tokenizer_worker(target, context["slot"])


def _engine(server) -> None:
    hello_delay = float(_env("HELLO_DELAY_S") or 0)
    if hello_delay:
        hello, seen = server._hello, set()

        def slow_hello(identity, message):
            if identity not in seen:
                seen.add(identity)
                time.sleep(hello_delay)
            hello(identity, message)

        server._hello = slow_hello
    engine = server.engine
    delay = float(_env("STEP_DELAY_S") or 0)
    stall_step, _, stall_s = _env("STALL").partition(":")
    die_file = _env("DIE_FILE")
    if delay or stall_step or die_file:
        step = engine.step
        steps = []

        def slow_step():
            outputs = step()
            steps.append(1)
            if die_file:
                _die_at(die_file, engine)
            time.sleep(delay + (float(stall_s) if str(len(steps)) == stall_step else 0.0))
            return outputs

        engine.step = slow_step
    fail_token = _env("FAIL_TOKEN")
    if fail_token:
        token = int(fail_token)
        add_request = engine.add_request

        def fail_at_third_token(row, request):
            if request.num_output_tokens >= 2:
                raise RuntimeError("injected per-request failure")

        def add(request_id, prompt_token_ids, params=None, **kw):
            add_request(request_id, prompt_token_ids, params, **kw)
            if token in prompt_token_ids:
                engine.requests[request_id].logits_processors.append(fail_at_third_token)

        engine.add_request = add
    if _env("SCRIPTS"):
        _scripts(engine, {int(k): v for k, v in json.loads(_env("SCRIPTS")).items()})
    cuda_token = _env("CUDA_ERROR_TOKEN")
    if cuda_token:
        _sticky_cuda_error(engine, int(cuda_token))
    if _env("KV"):
        _kv_faults(engine, _env("KV"))
    doomed = _env("ADAPTER_EXIT")
    if doomed:
        load = engine.adapters.load

        def exit_mid_load(name, path):
            if name == doomed:
                print(f"injected exit loading LoRA adapter {name}", flush=True)
                os._exit(7)
            return load(name, path)

        engine.adapters.load = exit_mid_load


def _die_at(path: str, engine) -> None:
    """SIGKILL this engine, before it sends the step's outputs, once a request's output
    reaches the number of tokens the file ``path`` holds (removing the file: one death
    a write)."""
    try:
        with open(path) as f:
            n = int(f.read())
    except FileNotFoundError:
        return
    # (tokens sampled: not a placeholder's, nor proposals)
    if any(r.num_output_tokens - r.num_pending - r.num_draft >= n
           for r in engine.requests.values()):
        os.remove(path)
        print(f"injected SIGKILL at {n} output tokens", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _scripts(engine, scripts: dict[int, list[int]]) -> None:
    """Scripted replies: a model's output made what a test needs (a harmony reply's
    channels), whatever its random weights."""
    add_request = engine.add_request

    def add(request_id, prompt_token_ids, params=None, **kw):
        add_request(request_id, prompt_token_ids, params, **kw)
        script = next((s for token, s in scripts.items() if token in prompt_token_ids), None)
        if script is None:
            return

        def forced(row, request):
            n = request.num_output_tokens
            if n < len(script):
                row.fill_(float("-inf"))
                row[script[n]] = 0.0

        engine.requests[request_id].logits_processors.append(forced)

    engine.add_request = add


def _kv_faults(engine, fault: str) -> None:
    """A prefill engine's answers to KV pulls, spoiled: "corrupt" flips a byte of the
    first block, "drop" leaves out the first block, "delay:S" answers S seconds late,
    "exit:N" answers N pulls and dies on the next (mid-transfer)."""
    import msgspec

    from common.protocol import KvBlock

    answer = engine.kv.answer
    kind, _, arg = fault.partition(":")
    answered = []

    def spoiled(pull):
        if kind == "exit" and len(answered) >= int(arg) and pull.hashes:
            time.sleep(0.3)  # the answers already given leave (the I/O thread sends them)
            os._exit(9)
        reply = answer(pull)
        answered.append(1)
        if not reply.blocks:
            return reply
        first = reply.blocks[0]
        if kind == "corrupt":
            data = bytearray(first.data)
            data[7] ^= 0x10
            first = KvBlock(first.block_hash, first.checksum, bytes(data))
            return msgspec.structs.replace(reply, blocks=[first, *reply.blocks[1:]])
        if kind == "drop":
            return msgspec.structs.replace(reply, blocks=reply.blocks[1:])
        if kind == "delay":
            time.sleep(float(arg))
        return reply

    engine.kv.answer = spoiled


def _sticky_cuda_error(engine, token: int) -> None:
    add_request, forward = engine.add_request, engine.runner.forward
    broken = []

    def add(request_id, prompt_token_ids, params=None, **kw):
        add_request(request_id, prompt_token_ids, params, **kw)
        if token in prompt_token_ids:
            broken.append(True)

    def failing_forward(scheduled):
        if broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(scheduled)

    engine.add_request = add
    engine.runner.forward = failing_forward


def _tokenizer_worker(tokenizer, slot: int) -> None:
    crash = _env("CRASH_MARKER") if str(slot) in _env("CRASH_SLOTS").split(",") else ""
    slow, hang = _env("SLOW_MARKER"), _env("HANG_MARKER")
    if _env("HANG_SLOTS") and str(slot) not in _env("HANG_SLOTS").split(","):
        hang = ""
    if not (crash or slow or hang):
        return
    tokenize = tokenizer.tokenize

    def faulty(requests):
        texts = [r.prompt or "".join(m.content for m in r.messages or []) for r in requests]
        if crash and any(crash in t for t in texts):
            os._exit(3)  # die holding the batch
        if slow and any(slow in t for t in texts):
            time.sleep(float(_env("SLOW_S") or 2.0))
        if hang and any(hang in t for t in texts):
            time.sleep(10**6)
        return tokenize(requests)

    tokenizer.tokenize = faulty
