"""Every message that crosses a process boundary, declared once.

Structs are msgspec Structs encoded as plain msgpack: any msgpack decoder can read a
frame, and msgspec validates types when decoding. This module holds wire types and
their validation only; mutable per-request state lives in the process that owns it.
The sampling parameters an AddRequest carries are declared with their bounds in
common/sampling_params.py.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import msgspec

from common.sampling_params import SamplingParams

class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or (in the frontend) a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the client or the frontend
    ERROR = "error"  # failed inside the engine; the output carries a message


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities for one generated token, from the model's raw distribution."""

    # log p(chosen token)
    logprob: float
    # The most likely token ids, best first (as many as SamplingParams.logprobs asked).
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one engine step produced for one request."""

    request_id: str
    # Tokens generated in this step (usually one).
    new_token_ids: list[int] = []
    # One entry per new token, when the request asked for logprobs.
    logprobs: Optional[list[TokenLogprobs]] = None
    # Set on the request's last output.
    finish_reason: Optional[FinishReason] = None
    # On the first output, with prompt_logprobs: one entry per prompt token after
    # the first.
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    # With finish_reason STOP: the token id that ended generation (EOS or a stop
    # token id; it is the last new token and not part of the text), or None when the
    # output's grammar was complete (every token is text).
    stop_token_id: Optional[int] = None
    # With finish_reason ERROR: what went wrong.
    error: Optional[str] = None
    # On the first output only: prompt tokens served from the prefix cache, and the
    # engine-side durations (not timestamps: clocks differ between hosts).
    num_cached_tokens: Optional[int] = None
    # From add_request to the first step that computed any of its tokens.
    queue_ms: Optional[float] = None
    # From that step to the end of the step that produced the first token.
    prefill_ms: Optional[float] = None
    # A request continued from a prefill engine (AddRequest.kv_source), on its first
    # output: how its KV transfer ended ("complete", or why it fell back to computing
    # the rest here), the blocks received and verified, and its duration.
    kv_outcome: Optional[str] = None
    kv_blocks_received: Optional[int] = None
    kv_transfer_ms: Optional[float] = None
    # An embedding request's (SamplingParams.embed) vector, L2-normalized, on its only
    # output.
    embedding: Optional[list[float]] = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the engine's load and cache."""

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int  # not referenced by any request (includes cached blocks)
    num_blocks_used: int  # referenced by at least one request
    num_blocks_cached: int  # unreferenced but holding a reusable prefix
    # The sliding-window layers' own pool (engine_worker/window_blocks.py), the same
    # counts; 0 where they have none.
    num_window_blocks_total: int = 0
    num_window_blocks_used: int = 0
    num_window_blocks_cached: int = 0
    prefix_cache_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # of those, served from it
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    # Speculation: tokens proposed, and of those kept (generated as the model would).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Frames that did not decode (malformed, truncated, unknown type): dropped.
    num_frames_dropped: int = 0
    # Client connections that ended, including peers cut off for sending a frame
    # over the size limit (ZeroMQ drops the connection before the frame is read).
    num_disconnects: int = 0
    # Connections refused at the handshake: a peer without the cluster's CURVE key
    # (common/curve.py), or speaking without CURVE to a socket that requires it.
    num_handshakes_failed: int = 0
    # Prefill/decode disaggregation (engine_worker/kv_transfer.py). Decode side: KV
    # transfers started, blocks and bytes received and verified, prompt blocks not
    # pulled because this engine held them, seconds spent in transfers, and
    # transfers that ended early by reason (the rest computed here). Prefill side:
    # blocks and bytes sent, and leases held now.
    kv_transfers: int = 0
    kv_blocks_received: int = 0
    kv_bytes_received: int = 0
    kv_blocks_skipped: int = 0
    kv_transfer_seconds: float = 0.0
    kv_fallbacks: dict[str, int] = {}
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    kv_leases: int = 0
    # The tiers below the KV pool (engine_worker/kv_offload.py), by tier ("host",
    # "disk"): blocks and bytes held now, blocks copied in as the pool evicted them
    # and copied back instead of computed; prompt blocks looked up there and not
    # found (computed); blocks refused or lost, by why.
    kv_offload_blocks: dict[str, int] = {}
    kv_offload_bytes: dict[str, int] = {}
    kv_offload_stored: dict[str, int] = {}
    kv_offload_loaded: dict[str, int] = {}
    kv_offload_missed: int = 0
    kv_offload_errors: dict[str, int] = {}
    # The shared KV store (kv_store/, engine_worker/kv_store_link.py): blocks put;
    # blocks pulled, asked for and not held; transfers that failed, by why; whether
    # the engine uses it now (not while it backs off after a failure; None: no store).
    kv_store_put_blocks: int = 0
    kv_store_hits: int = 0
    kv_store_misses: int = 0
    kv_store_errors: dict[str, int] = {}
    kv_store_up: Optional[bool] = None
    # The store's own figures, as it last answered this engine: blocks and bytes it
    # holds, by tier ("memory", "disk").
    kv_store_blocks: dict[str, int] = {}
    kv_store_bytes: dict[str, int] = {}
    # The LoRA adapters it serves, by name (as of the loop's last iteration).
    adapters: list[str] = []


# -- Engine worker <-> its clients (frontends, benchmarks, tests) ------------------
#
# Every frame pair on the engine socket is [type byte, msgpack payload]; the type byte
# says which Struct the payload holds. Clients use DEALER sockets with identities,
# the engine a ROUTER, so several clients share one engine and each client's outputs
# reach only it.


class MessageType(enum.IntEnum):
    # client -> engine
    HELLO = 1  # Hello: register; the engine answers Ready
    ADD = 2  # AddRequest
    ABORT = 3  # AbortRequests
    PING = 4  # Ping: answered by Pong (from the I/O thread), with stats
    CACHE_SYNC = 5  # CacheSync: send me a snapshot of your prefix cache
    KV_PULL = 6  # KvPull: a decode engine asks a prefill engine (or the KV store) for blocks
    KV_PUT = 7  # KvPut: an engine gives the KV store blocks to keep
    ADAPTER = 8  # AdapterCommand: load or unload a LoRA adapter; AdapterResult answers
    # engine -> client
    READY = 16  # Ready
    OUTPUTS = 17  # OutputBatch: everything one step produced for this client
    REQUEST_ERROR = 18  # RequestError: one request refused or failed
    PONG = 19  # Pong
    DEAD = 20  # Dead: the engine is going down
    CACHE_EVENTS = 21  # CacheEvents: the prefix cache's changes, or a snapshot of it
    KV_BLOCKS = 22  # KvBlocks: the answer to a KvPull
    STORE_PONG = 23  # StorePong: the KV store's answer to a Ping
    ADAPTER_RESULT = 24  # AdapterResult: the answer to an AdapterCommand


# The version of every message in this module. Bump it when a message changes: the
# two ends of a connection refuse each other when theirs differ (an older peer would
# silently drop fields a newer one sends). A peer whose messages lack the field is
# version 0.
PROTOCOL_VERSION = 11


def version_mismatch(peer: str, theirs: int) -> Optional[str]:
    """Why a peer speaking protocol version ``theirs`` is refused, or None."""
    if theirs == PROTOCOL_VERSION:
        return None
    return (f"protocol version mismatch: the {peer} speaks version {theirs}, this process "
            f"version {PROTOCOL_VERSION}; run the same roseserve release on both")


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    client_id: str
    protocol_version: int = 0
    # Reconciliation: the requests this client still follows. The engine aborts any
    # other request it holds for this client (ones the client has given up on while
    # the engine was unreachable or busy).
    request_ids: list[str] = []


class KvSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode engine pulls a request's prompt KV from: a prefill engine's
    address (as the frontend reaches it) and the request id it computed the prompt
    under (and holds its blocks for: AddRequest.kv_lease_s)."""

    address: str
    request_id: str


class AddRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = SamplingParams()
    # Tokens already generated for this request elsewhere (a prefill engine's first
    # token): the engine continues after them; they count toward max_tokens and
    # penalties, and a seeded request's draws skip them.
    output_token_ids: list[int] = []
    # Prefill side of disaggregated serving: once the request ends, keep its prompt's
    # full blocks for this long (or until a KvPull releases them) for a decode engine.
    kv_lease_s: float = 0.0
    # Decode side: pull the prompt blocks this engine lacks from there before
    # computing the rest (engine_worker/kv_transfer.py); any block not received and
    # verified is computed here.
    kv_source: Optional[KvSource] = None
    # Outputs are sent this many tokens at a time (the first output, the last and an
    # abort at once; the frontend's --stream-interval): fewer frames for the engine to
    # send and its client to wake for.
    output_interval: int = 1


class AbortRequests(msgspec.Struct, frozen=True, kw_only=True):
    request_ids: list[str]


class Ping(msgspec.Struct, frozen=True, kw_only=True):
    nonce: int


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str
    rank: int
    # its name and a fingerprint of its weights, which salt its requests' prefix
    # hashes (common/prefix_hash.py: salt_root): the router's too
    key: str


class AdapterCommand(msgspec.Struct, frozen=True, kw_only=True):
    """Load the LoRA adapter at ``path`` as ``name``, or (no path) unload ``name``;
    answered by an AdapterResult with the same nonce."""
    nonce: int
    name: str
    path: Optional[str] = None


class AdapterResult(msgspec.Struct, frozen=True, kw_only=True):
    nonce: int
    ok: bool
    # why not (ok False): the adapter's fault, in words (an HTTP 400's)
    message: str = ""
    # the adapters the engine serves now
    adapters: list[AdapterInfo] = []


class Ready(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    protocol_version: int = 0
    model_name: str
    # Longest prompt + output the engine accepts.
    max_model_len: int
    vocab_size: int
    # The model's hidden size: an embedding's dimensions.
    hidden_size: int = 0
    num_kv_blocks: int
    block_size: int
    # EOS token ids of the model (the frontend hides them from text).
    eos_token_ids: list[int]
    # Whether the engine keeps a prefix cache (and so publishes CacheEvents).
    prefix_caching: bool = True
    # "mixed" (prompts and generation), "prefill" or "decode" (disaggregated serving:
    # routers send each role its part of a request).
    role: str = "mixed"
    # It uses the shared KV store: a prompt's blocks the store holds reach it too.
    kv_store: bool = False
    # The LoRA adapters it serves (engine_worker/lora.py).
    adapters: list[AdapterInfo] = []


class OutputBatch(msgspec.Struct, frozen=True, kw_only=True):
    outputs: list[RequestOutput]


class RequestErrorKind(str, enum.Enum):
    INVALID = "invalid_request"  # the request's own fault (HTTP 400)
    OVERLOADED = "overloaded"  # refused for now, e.g. the engine is draining (HTTP 503)
    INTERNAL = "internal"  # failed inside the engine (HTTP 500)


class RequestError(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    message: str
    kind: RequestErrorKind = RequestErrorKind.INVALID
    # The offending field, for INVALID.
    param: Optional[str] = None


class Pong(msgspec.Struct, frozen=True, kw_only=True):
    """Answered by the engine's I/O thread, so a long step never delays it."""

    nonce: int
    # As of the end of the engine loop's last iteration.
    stats: EngineStats
    # How long the engine loop has been in its current iteration: a step, or handling
    # messages (about 1 s at most when idle, as an idle loop wakes every second). A
    # loop stuck anywhere shows here; clients and health checks bound it.
    busy_s: float = 0.0
    # The engine got SIGTERM: it finishes what it holds and refuses new requests
    # (routers stop sending it any). Also sent unsolicited (nonce 0) when the drain
    # starts, so that clients learn at once rather than at their next heartbeat.
    draining: bool = False


class Dead(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


class CacheSync(msgspec.Struct, frozen=True, kw_only=True):
    """A client missed some CacheEvents (a gap in ``seq``): it asks for a snapshot."""


class CacheEvents(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine's prefix cache holds, as changes: the chained hashes of the
    full blocks it started and stopped holding (common/prefix_hash.py), sent to every
    client after each step that changed it. ``seq`` numbers the engine instance's
    changes 1, 2, 3...: a client that sees a number skipped has missed some and asks
    for a snapshot (CacheSync). A snapshot (sent after every Ready, and on CacheSync)
    lists in ``stored`` every hash the cache holds as of change ``seq``; it replaces
    what the client had. Applying a change twice is harmless: ``stored`` and
    ``removed`` are disjoint, and each says where a hash stands after the change."""

    seq: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    snapshot: bool = False
    # The shared KV store (kv_store/) as this engine sees it: the hashes of blocks it
    # put there since its last CacheEvents, and whether it lost the store since (a
    # store that restarted may have come back empty). Routers count what the store
    # holds as held by every engine that uses it (frontend/router.py).
    store_put: list[bytes] = []
    store_lost: bool = False


class KvPull(msgspec.Struct, frozen=True, kw_only=True):
    """Decode engine -> prefill engine: send the KV of these full blocks (chained
    hashes, in prompt order) held for ``request_id``. ``layout`` names the KV bytes a
    block holds (model, dtype, shapes); a prefill engine with another layout refuses.
    ``release``: the last pull for this request; its lease ends."""

    request_id: str
    hashes: list[bytes]
    layout: str
    release: bool = False


class KvBlock(msgspec.Struct, frozen=True, array_like=True):
    """One full block's KV, every layer's keys then values: its chained hash, the
    CRC-32 of ``data``, and the bytes."""

    block_hash: bytes
    checksum: int
    data: bytes


class KvPut(msgspec.Struct, frozen=True, kw_only=True):
    """Engine -> KV store (kv_store/): keep these full blocks, of ``layout`` (KvPull's).
    No answer: a block the store refuses (a bad checksum, another size than its
    layout's) or has no room for is simply not kept."""

    layout: str
    blocks: list[KvBlock]


class StoreStats(msgspec.Struct, frozen=True, kw_only=True):
    """The KV store's contents and what it has done: blocks and bytes held, by tier
    ("memory", "disk"); blocks put, served, asked for and not held; blocks refused,
    by why."""

    blocks: dict[str, int] = {}
    bytes: dict[str, int] = {}
    num_put: int = 0
    num_hits: int = 0
    num_misses: int = 0
    refused: dict[str, int] = {}


class StorePong(msgspec.Struct, frozen=True, kw_only=True):
    nonce: int
    stats: StoreStats


class KvBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill engine -> decode engine: the blocks a KvPull asked for, in its order,
    stopping at the first one the engine no longer holds. ``error``: why none or not
    all were sent (the decode engine computes the rest itself)."""

    request_id: str
    blocks: list[KvBlock] = []
    error: Optional[str] = None
    # An fp8 cache's scales the blocks were written with (each layer's key scale, then
    # its value scale), for a decode engine whose own are not set yet to take
    # (engine_worker/kv_scales.py); None for another cache
    kv_scales: Optional[list[float]] = None


# -- Frontend <-> tokenizer pool ----------------------------------------------------
#
# The same framing; the pool's supervisor is a ROUTER facing frontends and another
# facing its worker processes.


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str
    name: Optional[str] = None
    # An assistant's tool calls (OpenAI's shape), and a tool message's call id.
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    # An assistant's earlier thinking, for templates that show it.
    reasoning_content: Optional[str] = None


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    # Exactly one of prompt (plain text) and messages (rendered with the chat template).
    prompt: Optional[str] = None
    # With prompt: the text after the completion; the model fills in the middle
    # (common/tokenizer.fill_in_the_middle).
    suffix: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    # Chat: end the rendered text with the assistant's turn header.
    add_generation_prompt: bool = True
    # Chat: leave the last message (an assistant's) open, for the model to go on with.
    continue_final_message: bool = False
    # Chat: the tools the request offers (OpenAI's shape), for templates that show them.
    tools: Optional[list[dict]] = None
    # Chat: the request's extra template variables (chat_template_kwargs).
    template_kwargs: dict[str, Any] = {}
    # Add the tokenizer's special tokens (e.g. BOS) around the text; None: for plain
    # text yes, for rendered messages no (their template wrote them).
    add_special_tokens: Optional[bool] = None


class TokenizeResult(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    # Time in the worker (rendering and encoding), not counting the queue.
    tokenize_ms: float


class TokenizeError(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    message: str
    kind: RequestErrorKind = RequestErrorKind.INVALID


class PoolReady(msgspec.Struct, frozen=True, kw_only=True):
    pool_id: str
    protocol_version: int = 0
    num_workers: int


class PoolPong(msgspec.Struct, frozen=True, kw_only=True):
    nonce: int
    num_workers: int
    num_alive: int
    # Jobs received and not yet answered.
    num_pending: int
    # Jobs received since the pool started.
    num_jobs_total: int = 0
    # Frames from clients that did not decode (dropped), and client connections that
    # ended (including peers cut off for a frame over the size limit).
    num_frames_dropped: int = 0
    num_disconnects: int = 0
    # Workers replaced since the pool started (died, or hung past the job timeout).
    num_workers_replaced: int = 0
    # As EngineStats.num_handshakes_failed.
    num_handshakes_failed: int = 0


class TokenizerMessageType(enum.IntEnum):
    HELLO = 1  # Hello -> PoolReady
    TOKENIZE = 2  # TokenizeRequest
    PING = 4  # Ping -> PoolPong
    READY = 16
    RESULT = 17  # TokenizeResult
    ERROR = 18  # TokenizeError
    PONG = 19
    DEAD = 20  # Dead: this client is refused (another protocol version)
    WORKER_READY = 32  # worker -> supervisor: Hello, once its tokenizer is loaded


CLIENT_MESSAGES: dict[int, type] = {
    MessageType.HELLO: Hello,
    MessageType.ADD: AddRequest,
    MessageType.ABORT: AbortRequests,
    MessageType.PING: Ping,
    MessageType.CACHE_SYNC: CacheSync,
    MessageType.KV_PULL: KvPull,
    MessageType.ADAPTER: AdapterCommand,
}
ENGINE_MESSAGES: dict[int, type] = {
    MessageType.READY: Ready,
    MessageType.OUTPUTS: OutputBatch,
    MessageType.REQUEST_ERROR: RequestError,
    MessageType.PONG: Pong,
    MessageType.DEAD: Dead,
    MessageType.CACHE_EVENTS: CacheEvents,
    MessageType.KV_BLOCKS: KvBlocks,
    MessageType.ADAPTER_RESULT: AdapterResult,
}
# An engine (or a health check) -> the KV store (kv_store/), and back.
STORE_REQUESTS: dict[int, type] = {
    MessageType.PING: Ping,
    MessageType.KV_PULL: KvPull,
    MessageType.KV_PUT: KvPut,
}
STORE_REPLIES: dict[int, type] = {
    MessageType.STORE_PONG: StorePong,
    MessageType.KV_BLOCKS: KvBlocks,
}
POOL_REQUESTS: dict[int, type] = {
    TokenizerMessageType.HELLO: Hello,
    TokenizerMessageType.TOKENIZE: TokenizeRequest,
    TokenizerMessageType.PING: Ping,
}
POOL_REPLIES: dict[int, type] = {
    TokenizerMessageType.READY: PoolReady,
    TokenizerMessageType.RESULT: TokenizeResult,
    TokenizerMessageType.ERROR: TokenizeError,
    TokenizerMessageType.PONG: PoolPong,
    TokenizerMessageType.DEAD: Dead,
}
# Between the pool's supervisor and its workers.
WORKER_JOBS: dict[int, type] = {TokenizerMessageType.TOKENIZE: TokenizeRequest}
WORKER_REPLIES: dict[int, type] = {
    TokenizerMessageType.WORKER_READY: Hello,  # sent once the worker's tokenizer is loaded
    TokenizerMessageType.RESULT: TokenizeResult,
    TokenizerMessageType.ERROR: TokenizeError,
}


class ProtocolError(ValueError):
    """A frame that is not a valid message; the receiver logs and drops it, and answers
    with an error when the frame names the request it was for (``request_id``)."""

    def __init__(self, message: str, request_id: Optional[str] = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def _request_id_of(payload: bytes) -> Optional[str]:
    """The request_id a payload that failed validation names, if it names one."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    return request_id if isinstance(request_id, str) and request_id else None


class Codec:
    """One end of a channel: encodes what it ``sends`` to [type byte, payload] and
    decodes what it ``accepts``, validating the payload against the Struct its type
    byte names."""

    def __init__(self, sends: dict[int, type], accepts: dict[int, type]) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._type_of = {cls: bytes((t,)) for t, cls in sends.items()}
        self._decoders = {t: msgspec.msgpack.Decoder(cls) for t, cls in accepts.items()}

    def encode(self, message: msgspec.Struct) -> list[bytes]:
        return [self._type_of[type(message)], self._encoder.encode(message)]

    def decode(self, frames: list[bytes]) -> msgspec.Struct:
        if len(frames) != 2 or len(frames[0]) != 1:
            raise ProtocolError(f"expected [type, payload] frames, got {len(frames)} frame(s)")
        decoder = self._decoders.get(frames[0][0])
        if decoder is None:
            raise ProtocolError(f"unknown message type {frames[0][0]}")
        try:
            return decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"bad {decoder.type.__name__} payload: {e}",
                                _request_id_of(frames[1])) from None
        except RecursionError:  # free-form fields (tools, tool_calls) nested too deeply
            raise ProtocolError(f"bad {decoder.type.__name__} payload: nested too deeply",
                                _request_id_of(frames[1])) from None
