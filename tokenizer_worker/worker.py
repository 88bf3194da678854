"""One tokenizer worker process: jobs in from the pool's supervisor, replies out.

Each time it wakes it takes every job already queued (up to MAX_BATCH) and encodes
them in one batch. It dies with its supervisor: the kernel kills it when the
supervisor exits (PR_SET_PDEATHSIG, Linux), even mid-batch or hung, so a supervisor
killed with SIGKILL leaves no worker behind; elsewhere it exits at its next wake-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import zmq

from common import faults
from common.errors import ModelLoadError
from common.heap import freeze_startup_heap
from common.logging_setup import setup_logging
from common.protocol import WORKER_JOBS, WORKER_REPLIES, Codec, Hello, ProtocolError
from common.sockets import make_socket
from tokenizer_worker.prompt_tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

MAX_BATCH = 64
# A worker's exit code when it cannot load the tokenizer: the pool stops, as replacing
# it would fail again.
CANNOT_LOAD_EXIT_CODE = 2


def worker_main(model_dir: str, address: str, slot: int, identity: str, max_chars: int,
                log_level: str, chat_template: Optional[str] = None) -> None:
    setup_logging(f"tokenizer[{slot}]", log_level)
    # Ctrl-C reaches the whole process group; the supervisor decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # it exited before the request took effect
        return
    try:
        tokenizer = PromptTokenizer(Path(model_dir), max_chars, chat_template)
    except ModelLoadError as e:
        logger.error("%s", e)
        sys.exit(CANNOT_LOAD_EXIT_CODE)
    faults.install("tokenizer_worker", tokenizer, slot=slot)
    freeze_startup_heap()
    ctx = zmq.Context()
    sock = make_socket(ctx, address, zmq.DEALER, bind=False, identity=identity.encode())
    codec = Codec(WORKER_REPLIES, WORKER_JOBS)
    sock.send_multipart(codec.encode(Hello(client_id=identity)))
    while os.getppid() == parent:
        if not sock.poll(1000):
            continue
        jobs = []
        while len(jobs) < MAX_BATCH:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                jobs.append(codec.decode(frames))
            except ProtocolError as e:
                logger.warning("dropped a frame from the supervisor: %s", e)
        for reply in tokenizer.tokenize(jobs):
            sock.send_multipart(codec.encode(reply))
    sock.close(0)
    ctx.term()



_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
