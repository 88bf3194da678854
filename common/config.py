"""Configuration: one small frozen dataclass per component, validated on construction.

Environment variables are read here and nowhere else (``env_default``); CLI flags take
their defaults from them, so ``ROSESERVE_MODEL=... python -m engine_worker`` and
``--model ...`` mean the same.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from common.curve import CurveKey

_ENV_PREFIX = "ROSESERVE_"


def env_default(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of ROSESERVE_<NAME>, or ``default`` (also when it is set but empty, as
    a compose file's ``${VAR:-}`` leaves it)."""
    return os.environ.get(_ENV_PREFIX + name.upper()) or default


def cache_dir() -> str:
    """Where materialized models live (ROSESERVE_CACHE_DIR, else ~/.cache/roseserve)."""
    base = env_default("CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "roseserve")
    return base


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


ENGINE_ROLES = ("mixed", "prefill", "decode")
# The most CPU threads an engine may be given (--threads): several times any CPU's.
MAX_THREADS = 1024


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8")
# How a frontend spreads requests over engines (frontend/router.py).
ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block. 16 balances prefix-cache granularity (a hit reuses whole
    # blocks) against per-block bookkeeping; it is what vLLM and SGLang default to.
    block_size: int = 16
    # Memory for the KV pool. None: 2 GiB on CPU (about 45k tokens of SmolLM2-135M);
    # on CUDA, what gpu_memory_utilization leaves after the weights, a profiled
    # forward pass and the CUDA graphs (engine_worker/gpu/memory.py).
    kv_cache_memory_bytes: Optional[int] = None
    # CUDA: the share of the device's total memory the engine may use.
    gpu_memory_utilization: float = 0.9
    # Exact number of blocks, overriding the memory budget (tests use small pools).
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = True
    # The KV cache's element type: "auto" (the dtype the engine computes in), or on the
    # CPU "bfloat16" (half the bytes to read per step and to hold; keys and values
    # rounded to bfloat16 as they are written) or "float32"; on CUDA "fp8" (float8
    # e4m3: half a bfloat16 cache's bytes, values rounded to 3 mantissa bits and held
    # within +-448).
    kv_cache_dtype: str = "auto"
    # Prefill/decode disaggregation, decode side (engine_worker/kv_transfer.py): a KV
    # transfer not complete by then ends, and the engine computes the rest itself; a
    # pull asks for at most window bytes of blocks; the bytes asked for and not yet
    # received, over all transfers, stay within max_inflight.
    kv_transfer_timeout_s: float = 5.0
    kv_transfer_window_bytes: int = 8 << 20
    kv_transfer_max_inflight_bytes: int = 64 << 20
    # Sliding-window layers' blocks let go of as the window passes, in a pool of their
    # own where full-attention layers mix in (engine_worker/window_blocks.py). Off,
    # every layer holds the whole context, as a disaggregated engine's must (a KV
    # transfer moves whole block tables).
    window_pool: bool = True
    # Tiers below the pool (engine_worker/kv_offload.py): blocks it evicts kept in host
    # memory (this many bytes; None: no host tier) and in files under a directory
    # (None: no disk tier; at most kv_offload_disk_bytes there), and copied back
    # instead of computed.
    kv_offload_memory_bytes: Optional[int] = None
    kv_offload_dir: Optional[str] = None
    kv_offload_disk_bytes: int = 8 << 30
    # The shared KV store (kv_store/) below those: None, none. Its transfers end after
    # kv_store_timeout_s (the rest computed), and a store that timed out or dropped the
    # connection is left alone for a while (engine_worker/kv_offload.py).
    kv_store_address: Optional[str] = None
    kv_store_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.kv_store_address is not None:
            _check_address("kv_store_address", self.kv_store_address)
        if not self.kv_store_timeout_s > 0:
            raise ValueError(f"kv_store_timeout_s must be positive, got "
                             f"{self.kv_store_timeout_s}")
        _positive("kv_offload_memory_bytes", self.kv_offload_memory_bytes)
        _positive("kv_offload_disk_bytes", self.kv_offload_disk_bytes)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be positive, got "
                             f"{self.kv_transfer_timeout_s}")
        _positive("kv_transfer_window_bytes", self.kv_transfer_window_bytes)
        _positive("kv_transfer_max_inflight_bytes", self.kv_transfer_max_inflight_bytes)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("num_blocks", self.num_blocks)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests decoding together (the decode batch). None: 64 on CPU (a step of
    # SmolLM2-135M at 64 rows is compute-bound on 2 cores), 256 on CUDA (an 8B model's
    # decode is still bound by reading its weights there).
    max_batch_size: Optional[int] = None
    # Most waiting requests admitted (starting their prefill) in one step; None:
    # equal to max_batch_size. Decoupled from the decode batch (seed 004): set above
    # it, a burst is admitted and prefilled at once, then decodes max_batch_size
    # requests per step in turns; at most max(both) requests run.
    prefill_max_batch_size: Optional[int] = None
    # Most tokens computed in one step (prefill chunks plus one per decode). A long
    # prompt is split into chunks under it, so decode steps never stall behind a
    # whole prompt. None: 512 on CPU (~0.7 s of SmolLM2-135M prefill on 2 cores),
    # 8192 on CUDA.
    max_num_batched_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        _positive("max_batch_size", self.max_batch_size)
        _positive("prefill_max_batch_size", self.prefill_max_batch_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)

    @property
    def prefill_batch_size(self) -> int:
        return self.prefill_max_batch_size or self.decode_batch_size

    @property
    def decode_batch_size(self) -> int:
        assert self.max_batch_size is not None, "resolve the config with for_device()"
        return self.max_batch_size

    def for_device(self, device: str) -> "SchedulerConfig":
        """This config with the device's defaults filled in."""
        cuda = device.startswith("cuda")
        return replace(self, max_batch_size=self.max_batch_size or (256 if cuda else 64),
                       max_num_batched_tokens=self.max_num_batched_tokens or (
                           8192 if cuda else 512))

    @property
    def token_budget(self) -> int:
        assert self.max_num_batched_tokens is not None, "resolve the config with for_device()"
        return self.max_num_batched_tokens


_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "dummy")
# --quantization: weight formats of the CPU kernels (int8, q4, iq4) and of CUDA (fp8)
QUANTIZATIONS = ("int8", "q4", "iq4", "fp8")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    # A Hugging Face model directory or a GGUF file; None: the default model
    # (materialized on first use).
    model: Optional[str] = None
    # "cpu", "cuda", "cuda:N", or "auto" (cuda when available).
    device: str = "auto"
    # "auto": float32 on CPU, bfloat16 on CUDA (float16 where bf16 is unsupported). On
    # the CPU kernels, bfloat16 stores the weights in bfloat16; a layer's input is rounded
    # to bfloat16 for AMX or AVX-512-BF16 products where the CPU has them, and the rest
    # (norms, attention, the KV cache) stays float32.
    dtype: str = "auto"
    # "int8": weights and layer inputs in 8 bits, a scale per 32 values (CPU kernels
    # only; llama.cpp's Q8_0). "q4": 4-bit weights with a scale and a minimum per 32
    # (llama.cpp's Q4_1), inputs as int8's. None: dtype.
    quantization: Optional[str] = None
    # Intra-op threads for CPU matmuls; None: torch's default (all cores).
    num_threads: Optional[int] = None
    # Cap on prompt + output tokens; None: the model's context length.
    max_model_len: Optional[int] = None
    # Seeds the sampler of requests that carry no seed of their own.
    seed: int = 0
    # CPU attention kernels compiled from C on first use (falls back to torch when
    # no compiler is found). Off: always the torch path.
    cpu_kernels: bool = True
    # "auto": the checkpoint's safetensors; "dummy": random weights from config.json
    # alone, made on the device (benchmarks of models whose weights are not here).
    load_format: str = "auto"
    # "auto": Triton on CUDA, the C kernels or torch on the CPU; "torch": the
    # reference path on any device; "triton": the GPU path (on a CPU, through
    # Triton's interpreter: tests only).
    attention_backend: str = "auto"
    # CUDA: no CUDA graphs (every step runs kernel by kernel).
    enforce_eager: bool = False
    # Schedule and queue the next step before this step's tokens reach the host
    # (engine.py's run-ahead), so the device does not wait for the host between
    # steps. None: on with CUDA, off on the CPU (whose forward pass is the host's work).
    async_scheduling: Optional[bool] = None
    # N-gram speculation (engine_worker/speculation.py): a decoding request proposes
    # up to this many tokens from its own text a step, checked in the step; 0: off.
    # The CPU engine, without run-ahead.
    speculative_tokens: int = 0
    # Ranks the model is split over (tensor parallelism: engine_worker/models/layers/
    # parallel.py), each in a process of torch.distributed's default group, which
    # must be set up before the engine is made; 1: not split.
    tensor_parallel_size: int = 1
    # LoRA adapters (engine_worker/lora.py): (name, PEFT folder) loaded at start; at
    # most max_loras loaded at once (more can be loaded as others are unloaded), of
    # ranks up to max_lora_rank.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Embeddings (SamplingParams.embed): the prompt's final hidden states pooled as
    # "last" (the last token's: decoder models' embeddings) or "mean".
    pooling: str = "last"
    max_loras: int = 4
    max_lora_rank: int = 64
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be {', '.join(QUANTIZATIONS)} or unset, got "
                             f"{self.quantization!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(_LOAD_FORMATS)}, got "
                             f"{self.load_format!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of "
                             f"{', '.join(_ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.num_threads is not None and not 1 <= self.num_threads <= MAX_THREADS:
            # (OpenMP crashes the process at start somewhere past 4,096)
            raise ValueError(f"num_threads must be in 1..{MAX_THREADS}, got {self.num_threads}")
        _positive("max_model_len", self.max_model_len)
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens must be in 0..16, got "
                             f"{self.speculative_tokens}")
        if self.speculative_tokens and self.device.startswith("cuda"):
            raise ValueError("speculative tokens run on the CPU engine; a GPU's decode "
                             "steps are CUDA graphs of one token a request")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be last or mean, got {self.pooling!r}")
        if not 0 <= self.max_loras <= 256 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_loras must be in 0..256 and max_lora_rank in 1..512, got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} LoRA modules given, more than "
                             f"max_loras {self.max_loras}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in 1..64, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async scheduling does not run with the model split over "
                             "tensor-parallel ranks yet")
        if self.tensor_parallel_size > 1 and self.lora_modules:
            raise ValueError("LoRA adapters are not served with the model split over "
                             "tensor-parallel ranks yet")
        if self.speculative_tokens and self.async_scheduling:
            raise ValueError("speculative tokens need the step's tokens before the next "
                             "step is scheduled: not with async scheduling")


DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:5557"
DEFAULT_TOKENIZER_ADDRESS = "tcp://127.0.0.1:5558"
DEFAULT_KV_STORE_ADDRESS = "tcp://127.0.0.1:5559"
DEFAULT_MAX_FRAME_BYTES = 16 << 20


def _check_tls(certfile: Optional[str], keyfile: Optional[str]) -> None:
    """Both files or neither, and they load as a certificate and its key (at start,
    not at the first client's handshake)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    if certfile is not None:
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile,
                                                                                keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load the TLS certificate {certfile} with the key "
                             f"{keyfile}: {e}") from None


def _check_address(name: str, address: str) -> None:
    if not address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name} must be a tcp://, ipc:// or inproc:// address, got {address!r}")


@dataclass(frozen=True)
class EngineServerConfig:
    # Where the engine's ROUTER socket binds. Loopback unless asked otherwise.
    bind: str = DEFAULT_ENGINE_ADDRESS
    # On SIGTERM, in-flight requests get this long to finish before they are aborted.
    drain_timeout_s: float = 30.0
    # A client with requests in flight that sends nothing (not even its heartbeat
    # ping) for this long is presumed gone: its requests are aborted.
    client_timeout_s: float = 15.0
    # For measuring what per-step batching buys: send one frame per request per step
    # (one message per token) instead of one frame per client per step.
    per_token_frames: bool = False
    # A client that sends a larger frame is disconnected (the frame is never read).
    # 16 MiB holds a prompt of about three million token ids.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # The cluster's CURVE key: clients must present it (common/curve.py); None: any
    # client that reaches the socket is served.
    curve_key: Optional["CurveKey"] = None
    # "mixed": prompts and generation; "prefill" or "decode": this engine's part of
    # disaggregated serving, announced in Ready for routers (docs/architecture.md).
    role: str = "mixed"

    def __post_init__(self) -> None:
        _check_address("bind", self.bind)
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {self.role!r}")
        if self.drain_timeout_s < 0 or self.client_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be >= 0 and client_timeout_s > 0")
        _positive("max_frame_bytes", self.max_frame_bytes)


@dataclass(frozen=True)
class KvStoreConfig:
    """The shared KV store (kv_store/)."""

    # Where its ROUTER socket binds. Loopback unless asked otherwise.
    bind: str = DEFAULT_KV_STORE_ADDRESS
    # Blocks kept in memory, least recently used first out (to disk_dir, if any).
    memory_bytes: int = 4 << 30
    disk_dir: Optional[str] = None
    disk_bytes: int = 32 << 30
    # An answer to a pull holds at most this many bytes of blocks.
    window_bytes: int = 8 << 20
    # A peer that sends a larger frame is disconnected (a put of a window of blocks
    # and its framing fit).
    max_frame_bytes: int = 4 * DEFAULT_MAX_FRAME_BYTES
    curve_key: Optional["CurveKey"] = None

    def __post_init__(self) -> None:
        _check_address("bind", self.bind)
        _positive("memory_bytes", self.memory_bytes)
        _positive("disk_bytes", self.disk_bytes)
        _positive("window_bytes", self.window_bytes)
        _positive("max_frame_bytes", self.max_frame_bytes)


@dataclass(frozen=True)
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Engine workers to route requests to (one or more); they may come and go. A
    # tcp:// address with a DNS name stands for every address the name resolves to
    # (Swarm's tasks.<service>, a Kubernetes headless Service), re-resolved every
    # dns_refresh_s (frontend/membership.py).
    engine_addresses: tuple[str, ...] = (DEFAULT_ENGINE_ADDRESS,)
    dns_refresh_s: float = 5.0
    tokenizer_address: str = DEFAULT_TOKENIZER_ADDRESS
    # The model directory, for its tokenizer (output decoding); None: the default model.
    model: Optional[str] = None
    # The names clients may send as "model" (aliases of one model, the first listed
    # first); empty: the model directory's name.
    served_model_names: tuple[str, ...] = ()
    # Bearer keys, any of which a request must carry on every path but /health,
    # /metrics and /version (several: one per client, or an old and a new one while
    # clients move over); empty: no authentication.
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    # Admission: engine requests (n x prompts) admitted and not yet producing tokens,
    # and their prompt tokens (text estimated at 4 characters per token before it is
    # tokenized). Past either, new requests get 429 before any work is done for them.
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 2_000_000
    # Most engine requests (n x prompts) one HTTP request may ask for.
    max_choices_per_request: int = 256
    # Tokenization slower than this ends the request with 504 (a hung pool).
    tokenize_timeout_s: float = 60.0
    # A request not finished this long after it arrived ends with 504 and is aborted
    # in the engine; None: no limit (a long generation on a CPU takes minutes).
    request_timeout_s: Optional[float] = None
    # "prefix": route to the engine most likely to hold the prompt's prefix, within
    # a load bound; "least-loaded": ignore prefixes (frontend/router.py).
    routing: str = "prefix"
    # Prefill/decode disaggregation (engines of roles prefill and decode): a prompt
    # whose blocks the decode engine lacks come to fewer tokens than this is computed
    # by the decode engine itself; a prefill engine keeps a prompt's KV blocks this
    # long for the decode engine to pull (it lets go of them at once once pulled).
    disagg_min_prompt_tokens: int = 256
    kv_lease_s: float = 30.0
    # A request whose engine refused it (draining) or died is sent to another engine,
    # at most this many times: whole before any of its output was read, else as a
    # continuation (failover, frontend/output_processor.py), which waits this long at
    # most for an engine to take it (the only engine's restart).
    request_retries: int = 2
    failover_timeout_s: float = 30.0
    # A stream's tokens are sent this many at a time, by the engine (merged outputs)
    # and to the client (its first token, a choice's last and an error at once): fewer
    # messages and wake-ups per token, as vLLM's and SGLang's --stream-interval, for
    # chunkier streams.
    stream_interval: int = 1
    # On SIGTERM: new connections are refused at once; requests in flight (streams
    # included) get this long to finish before they are cut.
    drain_timeout_s: float = 30.0
    # One log line per request (frontend.access): status, time, ids, tokens.
    access_log: bool = True
    # A chat template file to use instead of the model's (the tokenizer pool's
    # --chat-template too): the frontend reads from it how the model writes tool calls.
    chat_template: Optional[str] = None
    # A reasoning model's thinking split from its answer in chat replies
    # (frontend/reasoning.py: "deepseek_r1" or "qwen3"); None: the reply is all content.
    reasoning_parser: Optional[str] = None
    # "auto": the sampling settings of the model's generation_config.json (temperature,
    # top_p, top_k, min_p, repetition_penalty) are the defaults of requests that do not
    # set them, as vLLM's are; "none": OpenAI's defaults.
    generation_config: str = "auto"
    # Logprobs name tokens "token_id:N" rather than by their text, unless a request
    # says otherwise (vLLM's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool = False
    # Each request's span goes to this OTLP/HTTP endpoint (frontend/tracing.py);
    # None: no tracing.
    otlp_traces_endpoint: Optional[str] = None
    # Web pages from these origins may call the API from a browser (CORS; "*": any);
    # empty: none, as a page from anywhere could otherwise reach a local server.
    allowed_origins: tuple[str, ...] = ()
    # HTTPS: the certificate (chain) and its private key, PEM files; None: plain HTTP.
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    # /health waits this long for the engine and tokenizer round trips.
    health_timeout_s: float = 5.0
    # Pongs come from the engine's I/O thread, so silence this long means the process
    # or the network is gone, whatever the engine is computing.
    engine_heartbeat_timeout_s: float = 10.0
    # An engine reporting one step running longer than this is treated as hung.
    engine_stall_timeout_s: float = 300.0
    # The cluster's CURVE key, presented to the engines and the tokenizer pool
    # (common/curve.py); None: plain sockets.
    curve_key: Optional["CurveKey"] = None

    def __post_init__(self) -> None:
        if not self.engine_addresses:
            raise ValueError("at least one engine address is needed")
        for address in self.engine_addresses:
            _check_address("engine address", address)
        _check_address("tokenizer address", self.tokenizer_address)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_body_bytes", "max_waiting_requests", "max_waiting_tokens",
                     "max_choices_per_request", "stream_interval"):
            _positive(name, getattr(self, name))
        for name in ("tokenize_timeout_s", "request_timeout_s", "health_timeout_s",
                     "engine_heartbeat_timeout_s", "engine_stall_timeout_s", "dns_refresh_s",
                     "drain_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        _check_tls(self.ssl_certfile, self.ssl_keyfile)
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"an allowed origin is * or scheme://host[:port], without a "
                                 f"path (as a browser sends it), got {origin!r}")
        if self.disagg_min_prompt_tokens < 0:
            raise ValueError(f"disagg_min_prompt_tokens must be 0 or more, got "
                             f"{self.disagg_min_prompt_tokens}")
        if not 0 < self.kv_lease_s <= 600:
            raise ValueError(f"kv_lease_s must be in (0, 600], got {self.kv_lease_s}")
        if self.request_retries < 0:
            raise ValueError(f"request_retries must be 0 or more, got {self.request_retries}")
        if not self.failover_timeout_s >= 0:   # (NaN too)
            raise ValueError(f"failover_timeout_s must be 0 or more, got "
                             f"{self.failover_timeout_s}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got "
                             f"{self.routing!r}")
        for key in self.api_keys:
            if not key or any(c.isspace() or c == "," for c in key):
                raise ValueError("an API key must be non-empty, without whitespace or commas "
                                 "(a Bearer token)")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be auto or none, got "
                             f"{self.generation_config!r}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(
                ("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL "
                             f"(OTLP/HTTP), got {self.otlp_traces_endpoint!r}")
