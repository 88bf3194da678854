"""The tokenizer pool's supervisor: one ROUTER facing frontends, one facing workers.

Jobs go to the ready worker with the fewest jobs in flight (at most
MAX_IN_FLIGHT_PER_WORKER each, so a worker always has a queue to batch from); the
rest wait here in arrival order. A worker that dies, or that holds a job longer than
job_timeout_s (hung), is killed if need be and replaced; each job it held is retried
once on another worker and, if that fails too, answered with an error that says so.
Frontends get PoolReady once the first worker has loaded its tokenizer; a worker that
cannot load it stops the pool (exit code 2), as its replacement would fail too. Frames
from clients that do not decode are counted and dropped; a client sending a frame over
max_frame_bytes loses its connection before the frame is read.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import msgspec
import zmq

from common.config import DEFAULT_MAX_FRAME_BYTES
from common.protocol import (POOL_REPLIES, POOL_REQUESTS, PROTOCOL_VERSION, WORKER_JOBS,
                             WORKER_REPLIES, Codec, Dead, Hello, Ping, PoolPong, PoolReady,
                             ProtocolError, RequestErrorKind, TokenizeError, TokenizeRequest,
                             TokenizeResult, version_mismatch)
from common.curve import CurveKey, CurveServer
from common.sockets import HANDSHAKE_FAILED, make_socket, read_refusal, waiting_messages
from tokenizer_worker.worker import CANNOT_LOAD_EXIT_CODE, worker_main

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT_PER_WORKER = 32
MAX_ATTEMPTS = 2
# A worker holding a job this long is presumed hung (a batch of 64 texts at the
# character limit takes a few seconds).
DEFAULT_JOB_TIMEOUT_S = 30.0
# A worker that keeps dying at start-up is not restarted faster than this.
RESPAWN_BACKOFF_S = 1.0


@dataclass
class Job:
    # Unique in the pool (clients' request ids need not be): workers see this one.
    job_id: str
    client: bytes
    request: TokenizeRequest
    attempts: int = 0
    # When it was last handed to a worker.
    dispatched: float = 0.0


@dataclass
class Worker:
    slot: int
    identity: bytes
    process: multiprocessing.Process
    started: float
    ready: bool = False
    jobs: dict[str, Job] = field(default_factory=dict)  # by job_id
    # Killed for holding a job past the timeout.
    hung: bool = False


class TokenizerPool:
    def __init__(self, model_dir: Path, num_workers: int, bind: str, max_chars: int,
                 log_level: str = "INFO", job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 curve_key: Optional[CurveKey] = None,
                 chat_template: Optional[str] = None) -> None:
        """``chat_template``: the workers render chats with it instead of the model's."""
        if num_workers < 1:
            raise ValueError(f"the pool needs at least one worker, got {num_workers}")
        if job_timeout_s <= 0:
            raise ValueError(f"the job timeout must be positive, got {job_timeout_s}")
        self.model_dir = model_dir
        self.num_workers = num_workers
        self.max_chars = max_chars
        self.chat_template = chat_template
        self.log_level = log_level
        self.job_timeout_s = job_timeout_s
        self.pool_id = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        # Only the front faces other hosts; the back is this host's ipc:// socket.
        self.curve = CurveServer(self.ctx, curve_key) if curve_key else None
        try:
            self.front = make_socket(self.ctx, bind, zmq.ROUTER, bind=True, linger_ms=500,
                                     max_message_bytes=max_frame_bytes,
                                     secure=self.curve.secure if self.curve else None)
        except Exception:
            if self.curve:
                self.curve.stop()
            raise
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.monitor = self.front.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.back_address = f"ipc://{tempfile.mkdtemp(prefix='rs-tok-')}/workers.sock"
        self.back = make_socket(self.ctx, self.back_address, zmq.ROUTER, bind=True)
        self.front_codec = Codec(POOL_REPLIES, POOL_REQUESTS)
        self.back_codec = Codec(WORKER_JOBS, WORKER_REPLIES)
        self.mp = multiprocessing.get_context("spawn")
        self.workers: dict[bytes, Worker] = {}
        self.queue: deque[Job] = deque()
        self.waiting_hellos: list[bytes] = []
        self.stopping = False
        self.exit_code = 0
        self.generation = 0
        self.job_ids = itertools.count()
        self.num_jobs_total = 0
        self.num_frames_dropped = 0
        self.num_disconnects = 0
        self.num_handshakes_failed = 0
        self.num_workers_replaced = 0

    # -- lifecycle -------------------------------------------------------------

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for slot in range(self.num_workers):
            self._spawn(slot)
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self.stopping:
                for sock, _ in poller.poll(timeout=200):
                    if sock is self.front:
                        self._receive_front()
                    elif sock is self.back:
                        self._receive_back()
                    elif read_refusal(self.monitor):
                        self.num_handshakes_failed += 1
                    else:
                        self.num_disconnects += 1
                self._check_workers()
                self._dispatch()
        finally:
            self._shutdown()
        return self.exit_code

    def _on_signal(self, signum, _frame) -> None:
        logger.info("signal %d: stopping the tokenizer pool", signum)
        self.stopping = True

    def _shutdown(self) -> None:
        for worker in self.workers.values():
            worker.process.terminate()
        for worker in self.workers.values():
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
        self.front.disable_monitor()
        self.monitor.close(linger=0)
        self.front.close()
        self.back.close()
        if self.curve:
            self.curve.stop()
        self.ctx.term()

    def _spawn(self, slot: int) -> None:
        self.generation += 1
        identity = f"w{slot}-{self.generation}"
        process = self.mp.Process(
            target=worker_main, name=f"tokenizer-{slot}", daemon=True,
            args=(str(self.model_dir), self.back_address, slot, identity, self.max_chars,
                  self.log_level, self.chat_template))
        process.start()
        self.workers[identity.encode()] = Worker(slot, identity.encode(), process,
                                                 time.monotonic())

    # -- messages --------------------------------------------------------------

    def _receive_front(self) -> None:
        for client, *body in waiting_messages(self.front):
            try:
                message = self.front_codec.decode(body)
            except ProtocolError as e:
                self.num_frames_dropped += 1
                logger.warning("dropped a frame from client %r: %s", client, e)
                continue
            if isinstance(message, TokenizeRequest):
                self.num_jobs_total += 1
                self.queue.append(Job(str(next(self.job_ids)), client, message))
            elif isinstance(message, Ping):
                self._reply(client, PoolPong(
                    nonce=message.nonce, num_workers=self.num_workers,
                    num_alive=sum(w.ready for w in self.workers.values()),
                    num_pending=len(self.queue) + sum(len(w.jobs) for w in self.workers.values()),
                    num_jobs_total=self.num_jobs_total,
                    num_frames_dropped=self.num_frames_dropped,
                    num_disconnects=self.num_disconnects,
                    num_workers_replaced=self.num_workers_replaced,
                    num_handshakes_failed=self.num_handshakes_failed))
            elif isinstance(message, Hello):
                refusal = version_mismatch("frontend", message.protocol_version)
                if refusal:
                    logger.warning("refused client %s: %s", message.client_id, refusal)
                    self._reply(client, Dead(reason=refusal))
                else:
                    self.waiting_hellos.append(client)
        if any(w.ready for w in self.workers.values()):
            self._answer_hellos()

    def _receive_back(self) -> None:
        for identity, *body in waiting_messages(self.back):
            worker = self.workers.get(identity)
            try:
                message = self.back_codec.decode(body)
            except ProtocolError as e:
                logger.warning("dropped a frame from worker %r: %s", identity, e)
                continue
            if worker is None:
                continue  # a replaced worker's late words
            if isinstance(message, Hello):
                worker.ready = True
                logger.info("tokenizer worker %d ready (pid %d)", worker.slot, worker.process.pid)
                self._answer_hellos()
            elif isinstance(message, (TokenizeResult, TokenizeError)):
                job = worker.jobs.pop(message.request_id, None)
                if job is not None:
                    self._reply(job.client, msgspec.structs.replace(
                        message, request_id=job.request.request_id))

    def _answer_hellos(self) -> None:
        for client in self.waiting_hellos:
            self._reply(client, PoolReady(pool_id=self.pool_id, num_workers=self.num_workers,
                                              protocol_version=PROTOCOL_VERSION))
        self.waiting_hellos.clear()

    def _reply(self, client: bytes, message: msgspec.Struct) -> None:
        try:
            self.front.send_multipart([client, *self.front_codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the client is gone: nothing to do
            logger.info("client %r unreachable: %s", client, e)

    # -- workers ---------------------------------------------------------------

    def _check_workers(self) -> None:
        now = time.monotonic()
        for identity, worker in list(self.workers.items()):
            if worker.process.exitcode is None:
                oldest = min((job.dispatched for job in worker.jobs.values()), default=now)
                if not worker.hung and now - oldest > self.job_timeout_s:
                    logger.error("tokenizer worker %d (pid %d) has held a job for %.0f s: "
                                 "killing it", worker.slot, worker.process.pid, now - oldest)
                    worker.hung = True
                    worker.process.kill()
                continue
            del self.workers[identity]
            if worker.process.exitcode == CANNOT_LOAD_EXIT_CODE:
                logger.error("tokenizer worker %d cannot load the tokenizer (its error is "
                             "above): stopping the pool", worker.slot)
                self.stopping, self.exit_code = True, 2
                return
            self.num_workers_replaced += 1
            what = "hung" if worker.hung else f"died with exit code {worker.process.exitcode}"
            logger.error("tokenizer worker %d (pid %d) %s holding %d job(s); replacing it",
                         worker.slot, worker.process.pid, what, len(worker.jobs))
            for job in reversed(list(worker.jobs.values())):
                if job.attempts >= MAX_ATTEMPTS:
                    self._reply(job.client, TokenizeError(
                        request_id=job.request.request_id, kind=RequestErrorKind.INTERNAL,
                        message=f"tokenizer workers died or hung {job.attempts} times while "
                                f"tokenizing this request"))
                else:
                    self.queue.appendleft(job)  # retried first
            delay = max(0.0, RESPAWN_BACKOFF_S - (time.monotonic() - worker.started))
            if delay:
                time.sleep(delay)
            self._spawn(worker.slot)

    def _dispatch(self) -> None:
        while self.queue:
            worker = self._least_loaded()
            if worker is None:
                return
            job = self.queue.popleft()
            job.attempts += 1
            job.dispatched = time.monotonic()
            worker.jobs[job.job_id] = job
            request = msgspec.structs.replace(job.request, request_id=job.job_id)
            self.back.send_multipart([worker.identity, *self.back_codec.encode(request)])

    def _least_loaded(self) -> Optional[Worker]:
        ready = [w for w in self.workers.values()
                 if w.ready and len(w.jobs) < MAX_IN_FLIGHT_PER_WORKER]
        return min(ready, key=lambda w: (len(w.jobs), w.slot), default=None)


def default_num_workers() -> int:
    """About half the cores (the engine needs the rest), at least one."""
    return max(1, (os.cpu_count() or 2) // 2)
