"""The engine worker process: the in-process engine behind a ZeroMQ ROUTER socket.

Threads:
  * the I/O thread (engine_worker/io_thread.py) owns the ROUTER socket: client frames
    in, pings answered with the stats the loop last published; the loop sends its
    replies on it through the thread's ``send``, which never waits;
  * the engine loop (the main thread, which also receives signals) drains every
    message that arrived, handles them as one batch (adds, aborts, hellos), runs one
    engine step, and sends each client one OutputBatch holding everything that step
    produced for it. With nothing to do it blocks on its inbox.

Reconciliation: a client's Hello lists the requests it still follows; the engine
aborts any other request it holds for that client. A client that lost track of the
engine (a missed heartbeat, a dropped connection) says Hello again when it is back,
so nothing keeps running with nobody reading it.

Prefix-cache events: after each loop iteration that changed what the prefix cache
holds, every client gets a CacheEvents with the changes, numbered per engine instance;
after each Ready, and when a client that missed a number asks (CacheSync), it gets a
snapshot instead. Routers route by them (frontend/router.py).

Failure handling: a request the engine refuses gets a RequestError; a request that
fails inside a step ends with finish reason "error" (engine.py isolates it; the
engine goes on); a sticky CUDA error (step_failures.FatalDeviceError) or anything else is a
broken invariant, and the process sends DEAD to every client and exits nonzero.
SIGTERM/SIGINT drain: every client is told at once (a Pong with ``draining`` set,
which later pongs repeat) so that routers send nothing more; new requests are
refused (OVERLOADED, which frontends retry elsewhere), in-flight ones finish (up to
drain_timeout_s), then DEAD is sent and the process exits 0; a second signal aborts
what is left at once. The signal handler only counts signals (a handler that took a
lock the interrupted code holds would deadlock); the loop is woken through Python's
wakeup fd, which the I/O thread watches.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import zmq

from common.config import EngineServerConfig
from common.curve import CurveServer
from common.errors import InvalidRequestError
from common.protocol import (CLIENT_MESSAGES, ENGINE_MESSAGES, PROTOCOL_VERSION,
                             AbortRequests, AdapterCommand, AdapterResult, AddRequest,
                             CacheEvents, CacheSync, Codec, Dead, FinishReason, KvBlocks,
                             KvPull, Hello, OutputBatch, Pong, Ready,
                             RequestError, RequestErrorKind, RequestOutput, STORE_REQUESTS,
                             StorePong, version_mismatch)
from common.sockets import make_socket
from engine_worker.engine import LLMEngine
from engine_worker.step_failures import FatalDeviceError
from engine_worker.io_thread import PEER_OUTBOX_ADDRESS, IOThread, Peer, Wake

logger = logging.getLogger(__name__)

@dataclass
class _Client:
    identity: bytes
    request_ids: set[str] = field(default_factory=set)
    # Answered a Hello already: a client says Hello every heartbeat until it is
    # answered, and those sent before this engine was up all arrive at once.
    greeted: bool = False


class EngineServer:
    def __init__(self, engine: LLMEngine, config: EngineServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.engine_id = uuid.uuid4().hex[:12]
        self.ctx = zmq.Context()
        self.curve = CurveServer(self.ctx, config.curve_key) if config.curve_key else None
        self.inbox: "queue.Queue" = queue.Queue()
        try:
            self.io = IOThread(self.ctx, config, self.inbox, engine.stats(), self.curve)
        except Exception:
            self._stop_curve()
            raise
        self.codec = Codec(ENGINE_MESSAGES, CLIENT_MESSAGES)
        self.peer_outbox = make_socket(self.ctx, PEER_OUTBOX_ADDRESS, zmq.PUSH, bind=False)
        self.peer_codec = Codec({**CLIENT_MESSAGES, **STORE_REQUESTS}, ENGINE_MESSAGES)
        self.clients: dict[bytes, _Client] = {}
        self._next_prune = 0.0
        self.owner: dict[str, bytes] = {}  # request_id -> client identity
        # Requests with an output interval above 1 -> it; and their outputs held back
        # until that many tokens are among them (_coalesce).
        self.intervals: dict[str, int] = {}
        self.held: dict[str, RequestOutput] = {}
        # Finished requests whose prompt blocks are held for a decode engine (their
        # client may still let go of them with an abort) -> that client's identity.
        self.lease_owner: dict[str, bytes] = {}
        # SIGTERM/SIGINT received (the handler's only effect); the loop acts on it.
        self.num_signals = 0
        self.draining_since: Optional[float] = None
        self.ready = Ready(
            engine_id=self.engine_id, protocol_version=PROTOCOL_VERSION,
            model_name=engine.model_name,
            max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
            hidden_size=engine.model_config.hidden_size,
            num_kv_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            prefix_caching=engine.block_manager.enable_prefix_caching, role=config.role,
            kv_store=engine.kv.store is not None, adapters=engine.adapters.infos())
        # The number of the last CacheEvents change sent (0: none yet).
        self.cache_seq = 0
        if self.ready.prefix_caching:
            engine.block_manager.record_changes()

    # -- lifecycle -------------------------------------------------------------

    def serve(self) -> int:
        """Run until drained or failed; the process exit code."""
        self._install_signal_handlers()
        self.io.start()
        logger.info("engine %s serving %s on %s", self.engine_id, self.engine.model_name,
                    self.config.bind)
        try:
            self._loop()
        except FatalDeviceError as e:
            logger.critical("%s; exiting so that the engine is restarted", e)
            self._broadcast(Dead(reason=str(e)))
            self._close()
            return 1
        except Exception as e:
            logger.exception("engine loop failed")
            self._broadcast(Dead(reason=f"engine failed: {e}"))
            self._close()
            return 1
        failed = self.io.failed
        self._broadcast(Dead(reason="engine I/O failed" if failed else "engine stopped"))
        try:
            self.engine.kv.shutdown()
        except Exception:  # its cache is lost to the next engine, nothing else
            logger.exception("saving the KV cache on the way out failed")
        self._close()
        return 1 if failed else 0

    def _install_signal_handlers(self) -> None:
        """The handler runs in the main thread between two bytecodes of whatever it
        interrupted (inbox.get holding the queue's lock, say), so it takes no lock:
        it counts. The C-level handler also writes to the wakeup fd, which wakes the
        I/O thread, which wakes the loop."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        self.io.wakeup_fd = read_fd

        def on_signal(_signum, _frame) -> None:
            self.num_signals += 1

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _close(self) -> None:
        self.io.close()
        self.peer_outbox.close()
        self._stop_curve()
        self.ctx.term()

    def _stop_curve(self) -> None:
        if self.curve is not None:
            self.curve.stop()

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> None:
        kv_deadline = None
        while True:
            self.io.loop_at = time.monotonic()
            idle = not self.engine.has_steps_to_run()
            messages = self._drain_inbox(block=idle, deadline=kv_deadline)
            draining = self._signalled()
            self._handle(messages)
            self._reap_unreachable_clients()
            kv_deadline = self.engine.kv.expire()
            self._send_kv_pulls()
            if draining:
                overdue = time.monotonic() - self.draining_since > self.config.drain_timeout_s
                if self.num_signals > 1 or overdue:
                    self._abort(list(self.owner), "the engine is shutting down")
                # Leases held for decode engines are served until they end too.
                holding = self.engine.has_unfinished_requests() or self.engine.kv.leases.leases
                if not holding or overdue or self.num_signals > 1:
                    return
            if self.io.failed:
                return
            if self.engine.has_steps_to_run():
                outputs = self.engine.step()
                self._publish_cache_changes()  # before the outputs they explain
                self._send_outputs(outputs)
                self._send_kv_pulls()  # (blocks the step filled or ended, to the KV store)
            self.io.stats = self.engine.stats()

    def _signalled(self) -> bool:
        """Whether a signal asked to stop (logged here, outside the handler)."""
        if self.num_signals and self.draining_since is None:
            self.draining_since = time.monotonic()
            logger.info("signal: draining %d request(s) (up to %g s)", len(self.owner),
                        self.config.drain_timeout_s)
            self.io.draining = True
            self._broadcast(Pong(nonce=0, stats=self.io.stats, draining=True))
        if self.num_signals > 1 and self.owner:
            logger.info("another signal: aborting %d request(s)", len(self.owner))
        return self.draining_since is not None

    def _drain_inbox(self, block: bool, deadline: Optional[float] = None) -> list:
        messages = []
        if block:
            # Idle: sleep until a message or a wake-up arrives. The timeout only
            # bounds how late a silent client (or a KV transfer's deadline) is noticed.
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                messages.append(self.inbox.get(timeout=max(timeout, 0.001)))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, messages: list) -> None:
        adds: list[tuple[bytes, AddRequest]] = []
        for item in messages:
            if isinstance(item, Wake):
                continue
            identity, message = item
            if isinstance(identity, Peer):
                self._from_peer(identity.address, message)
                continue
            if isinstance(message, KvPull):  # another engine, not a client
                self._send(identity, self.engine.kv.answer(message))
                continue
            if identity not in self.clients:
                self.clients[identity] = _Client(identity)
            if isinstance(message, AddRequest):
                adds.append((identity, message))
                continue
            # The adds before this message first: an abort (or a Hello no longer
            # listing a request) in the same batch as its add must find it.
            for pending in adds:
                self._add(*pending)
            adds.clear()
            if isinstance(message, AbortRequests):
                self._abort(message.request_ids, None, identity)
            elif isinstance(message, Hello):
                self._hello(identity, message)
            elif isinstance(message, CacheSync):
                self._send_cache_snapshot(identity)
            elif isinstance(message, AdapterCommand):
                self._send(identity, self._adapter(message))
        for identity, add in adds:  # batched: all of a loop's adds before one step
            self._add(identity, add)
        self._expire_silent_clients(time.monotonic())

    def _adapter(self, command: AdapterCommand) -> AdapterResult:
        """Load or unload a LoRA adapter (engine_worker/lora.py), as a client asks."""
        engine = self.engine
        try:
            if command.path is not None:
                engine.adapters.load(command.name, command.path)
            elif not engine.adapters.unload(command.name):
                raise InvalidRequestError(f"no LoRA adapter named {command.name!r} is "
                                          f"loaded", "lora_name")
            else:
                logger.info("LoRA adapter %s unloaded (once its requests end)", command.name)
        except InvalidRequestError as e:
            return AdapterResult(nonce=command.nonce, ok=False, message=str(e),
                                 adapters=engine.adapters.infos())
        return AdapterResult(nonce=command.nonce, ok=True, adapters=engine.adapters.infos())

    def _from_peer(self, address: str, message) -> None:
        if isinstance(message, KvBlocks):
            self.engine.kv.receive(address, message)
        elif isinstance(message, StorePong):
            if self.engine.kv.store is not None:
                self.engine.kv.store.pong(message)
        elif isinstance(message, Dead):
            self.engine.kv.source_failed(address, "source_dead")
        else:  # PeerLost
            self.engine.kv.source_failed(address, "disconnected")

    def _send_kv_pulls(self) -> None:
        for address, pull in self.engine.kv.pulls():
            self.peer_outbox.send_multipart([address.encode(), *self.peer_codec.encode(pull)])

    def _hello(self, identity: bytes, hello: Hello) -> None:
        refusal = version_mismatch("client", hello.protocol_version)
        if refusal:
            logger.warning("refused client %s: %s", hello.client_id, refusal)
            self._send(identity, Dead(reason=refusal))
            if not self.clients[identity].request_ids:
                del self.clients[identity]
            return
        stale = self.clients[identity].request_ids - set(hello.request_ids)
        if stale:
            logger.warning("client %s no longer follows %d request(s): aborting them",
                           hello.client_id, len(stale))
            self._abort(list(stale), "the client no longer follows this request")
        client = self.clients[identity]
        logger.log(logging.DEBUG if client.greeted else logging.INFO,
                   "client %s connected", hello.client_id)
        client.greeted = True
        self._send(identity, msgspec.structs.replace(   # (the adapters it serves now)
            self.ready, adapters=self.engine.adapters.infos()))
        self._send_cache_snapshot(identity)

    def _add(self, identity: bytes, add: AddRequest) -> None:
        if self.draining_since is not None:
            self._send(identity, RequestError(
                request_id=add.request_id, message="the engine is shutting down",
                kind=RequestErrorKind.OVERLOADED))
            return
        try:
            self.engine.add_request(add.request_id, add.prompt_token_ids, add.params,
                                    output_token_ids=add.output_token_ids,
                                    kv_lease_s=add.kv_lease_s, kv_source=add.kv_source)
        except InvalidRequestError as e:
            self._send(identity, RequestError(request_id=add.request_id, message=e.message,
                                              param=e.param))
            return
        self.owner[add.request_id] = identity
        self.clients[identity].request_ids.add(add.request_id)
        if add.output_interval > 1:
            self.intervals[add.request_id] = add.output_interval

    def _abort(self, request_ids: list[str], reason: Optional[str],
               requester: Optional[bytes] = None) -> None:
        """Abort requests. A client may abort only its own; when the engine aborts on
        its own (``reason`` set), each owner is told with an ABORT output."""
        if requester is not None:
            leases = self.engine.kv.leases
            for r in request_ids:  # a finished prefill's blocks, not wanted after all
                if self.lease_owner.get(r) == requester:
                    leases.release(r)
            self.lease_owner = {r: i for r, i in self.lease_owner.items() if r in leases.leases}
            request_ids = [r for r in request_ids if self.owner.get(r) == requester]
        by_client: dict[bytes, list[RequestOutput]] = {}
        for request_id in self.engine.abort_requests(request_ids):
            identity = self.owner.pop(request_id)
            self.clients[identity].request_ids.discard(request_id)
            self.intervals.pop(request_id, None)
            held = self.held.pop(request_id, None)
            if reason is not None:  # with the tokens held back, if any
                out = RequestOutput(request_id=request_id, finish_reason=FinishReason.ABORT,
                                    error=reason)
                by_client.setdefault(identity, []).append(
                    out if held is None else _merged(held, out))
        for identity, outputs in by_client.items():
            self._send(identity, OutputBatch(outputs=outputs))

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        by_client: dict[bytes, list[RequestOutput]] = {}
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None or (out := self._coalesce(out)) is None:
                continue
            by_client.setdefault(identity, []).append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
                self.clients[identity].request_ids.discard(out.request_id)
                if out.request_id in self.engine.kv.leases.leases:
                    self.lease_owner[out.request_id] = identity
        for identity, batch in by_client.items():
            if self.config.per_token_frames:
                for out in batch:
                    self._send(identity, OutputBatch(outputs=[out]))
            else:
                self._send(identity, OutputBatch(outputs=batch))

    def _coalesce(self, out: RequestOutput) -> Optional[RequestOutput]:
        """``out`` with the outputs held back before it, or None to hold it too: a
        request with an output interval sends its first output (the one with the
        prompt's figures), its last, and otherwise outputs of that many tokens."""
        interval = self.intervals.get(out.request_id)
        if interval is None:
            return out
        held = self.held.pop(out.request_id, None)
        if held is not None:
            out = _merged(held, out)
        if out.finish_reason is not None:
            del self.intervals[out.request_id]
        elif out.num_cached_tokens is None and len(out.new_token_ids) < interval:
            self.held[out.request_id] = out
            return None
        return out

    def _publish_cache_changes(self) -> None:
        if not self.ready.prefix_caching:
            return
        stored, removed = self.engine.block_manager.take_changes()
        put, lost = self.engine.kv.store.news() if self.engine.kv.store else ([], False)
        if stored or removed or put or lost:
            self.cache_seq += 1
            self._broadcast(CacheEvents(seq=self.cache_seq, stored=stored, removed=removed,
                                        store_put=put, store_lost=lost))

    def _send_cache_snapshot(self, identity: bytes) -> None:
        if not self.ready.prefix_caching:
            return
        self._publish_cache_changes()  # so that the snapshot is exactly as of cache_seq
        self._send(identity, CacheEvents(
            seq=self.cache_seq, stored=self.engine.block_manager.cached_hashes(),
            snapshot=True))

    def _expire_silent_clients(self, now: float) -> None:
        for client in list(self.clients.values()):
            silent = now - self.io.last_seen.get(client.identity, now)
            if silent > self.config.client_timeout_s:
                if client.request_ids:
                    logger.warning("client %r silent for %.0f s: aborting its %d request(s)",
                                   client.identity, silent, len(client.request_ids))
                    # Told, in case it comes back: a frontend that stalled and recovered
                    # ends those streams instead of waiting on them forever.
                    self._abort(list(client.request_ids),
                                f"aborted by the engine: it heard nothing from this client "
                                f"for {silent:.0f} s")
                del self.clients[client.identity]
                self.io.last_seen.pop(client.identity, None)
        if now >= self._next_prune:
            # Peers that never became clients (health checks that only ping, senders
            # of garbage) are forgotten too, once a second at most.
            self._next_prune = now + 1.0
            for identity, seen in list(self.io.last_seen.items()):
                if identity not in self.clients and now - seen > self.config.client_timeout_s:
                    self.io.last_seen.pop(identity, None)

    def _reap_unreachable_clients(self) -> None:
        while True:
            try:
                identity = self.io.unreachable.get_nowait()
            except queue.Empty:
                return
            client = self.clients.get(identity)
            if client is not None:
                if client.request_ids:
                    logger.warning("client %r unreachable: aborting its %d request(s)",
                                   identity, len(client.request_ids))
                    self._abort(list(client.request_ids),
                                "aborted by the engine: it could not reach this client")
                del self.clients[identity]
                self.io.last_seen.pop(identity, None)

    def _send(self, identity: bytes, message: msgspec.Struct) -> None:
        self.io.send([identity, *self.codec.encode(message)])

    def _broadcast(self, message: msgspec.Struct) -> None:
        for identity in list(self.clients):
            self._send(identity, message)


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request (the first not its last)."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return msgspec.structs.replace(
        first, new_token_ids=first.new_token_ids + then.new_token_ids, logprobs=logprobs,
        finish_reason=then.finish_reason, stop_token_id=then.stop_token_id, error=then.error)
