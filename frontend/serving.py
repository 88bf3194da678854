"""The frontend's pipeline: one request's path after HTTP parsing, in stages.

    Pipeline.open        a Job for the parsed request (frontend/job.py)
    InputProcessor       admission, constraints, tokenization, routing, validation:
                         the job's engine requests (frontend/input_processor.py)
    OutputProcessor      sends them; each engine step's outputs into each response's
                         events (frontend/output_processor.py)
    Job.close            everything the job held given back, metrics recorded

The routes (frontend/routes.py) drive these stages for each request; the metrics read
only the snapshot the pipeline publishes (``snapshot``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

from common.config import FrontendConfig
from common.protocol import EngineStats
from common.structured import GrammarCompiler
from frontend.admission import Admission
from frontend.errors import APIError
from frontend.grammar_cache import CheckedGrammars
from frontend.input_processor import InputProcessor
from frontend.job import Job
from frontend.membership import Membership
from frontend.metrics import Metrics
from frontend.openai_protocol import ChatCompletionRequest
from frontend.output_processor import OutputProcessor
from frontend.reasoning import ReasoningFormat
from frontend.router import EngineRouter
from frontend.tracing import Tracer
from tokenizer_worker.client import TokenizerClient


@dataclass(frozen=True)
class EngineSnapshot:
    address: str
    # mixed, prefill or decode ("" before its first Ready).
    role: str
    healthy: bool
    draining: bool
    # Requests assigned and not finished; routed since start, and for a prefix it held.
    load: int
    num_routed: int
    num_prefix_routed: int
    # Block hashes the router knows the engine's prefix cache holds (its events), and
    # how often it had to ask for a snapshot after missing some.
    num_blocks_known: int
    num_cache_resyncs: int
    # As of the engine's last heartbeat (None before the first).
    stats: Optional[EngineStats]


@dataclass(frozen=True)
class PipelineSnapshot:
    """What the pipeline publishes of its state (frontend/metrics.py reads this and
    nothing else of the pipeline)."""

    engines: list[EngineSnapshot]
    num_jobs: int
    admitted_requests: int
    admitted_tokens: int
    # Tokenize jobs waiting or running in the pool, and sent but not yet answered.
    tokenizer_queue: int
    # Requests sent to another engine (frontend/output_processor.py).
    num_retries: int
    num_failovers: int
    # Blocks the shared KV store is thought to hold (engine_worker/client.py StoreView).
    store_blocks_known: int = 0


class Pipeline:
    def __init__(self, engines: EngineRouter, tokenizer_client: TokenizerClient, tokenizer,
                 metrics: Metrics, admission: Admission, model_names: Sequence[str],
                 config: FrontendConfig, chat_template: Optional[str] = None,
                 grammars: Optional[GrammarCompiler] = None,
                 reasoning: Optional[ReasoningFormat] = None,
                 sampling: Optional[dict] = None,
                 tracer: Optional[Tracer] = None) -> None:
        """``tokenizer``: the model's Rust tokenizer; ``grammars``: for checking
        structured output before it reaches an engine (None: structured output is
        unavailable); ``reasoning``: how chat replies' thinking is told apart;
        ``sampling``: the defaults of sampling fields a request does not set;
        ``tracer``: where each request's span goes (None: nowhere)."""
        self.engines = engines
        self.tokenizer_client = tokenizer_client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission
        # The names the model is served under; the first is its id in /v1/models.
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.config = config
        self.sampling = sampling or {}
        self.tracer = tracer
        # Constraints compiled off the event loop, each distinct one once.
        self.inputs = InputProcessor(engines, tokenizer_client, tokenizer, admission, config,
                                     chat_template,
                                     None if grammars is None else CheckedGrammars(grammars),
                                     reasoning)
        self.outputs = OutputProcessor(engines, config.request_retries, config.kv_lease_s,
                                       config.stream_interval, config.failover_timeout_s)
        # Jobs opened and not closed (HTTP requests being served).
        self.num_jobs = 0
        # Keeps the router's engines equal to what the engine addresses name (set by
        # the app, which runs it).
        self.membership: Optional[Membership] = None
        # LoRA adapters loaded over HTTP (name -> folder; app.py shares it with the
        # engine clients, which give them to engines that restart)
        self.loaded_adapters: dict[str, str] = {}

    def snapshot(self) -> PipelineSnapshot:
        pool = self.tokenizer_client.last_pong
        return PipelineSnapshot(
            engines=[EngineSnapshot(
                address=e.address, healthy=e.client.healthy,
                role=e.client.ready.role if e.client.ready is not None else "", draining=e.client.draining,
                load=e.load,
                num_routed=e.num_routed, num_prefix_routed=e.num_prefix_routed,
                num_blocks_known=len(e.client.cache.held),
                num_cache_resyncs=e.client.cache.num_resyncs,
                stats=None if e.client.last_pong is None else e.client.last_pong.stats)
                for e in self.engines.engines],
            num_jobs=self.num_jobs, admitted_requests=self.admission.requests,
            admitted_tokens=self.admission.tokens,
            tokenizer_queue=(pool.num_pending if pool else 0) + self.tokenizer_client.num_pending,
            num_retries=self.outputs.num_retries, num_failovers=self.outputs.num_failovers,
            store_blocks_known=len(self.engines.store.held) if self.engines.store else 0)

    def check_model(self, model: str) -> Optional[str]:
        """The LoRA adapter ``model`` names, None for the base model (APIError 404:
        neither)."""
        if model in self.model_names:
            return None
        if model in self.engines.adapters():
            return model
        served = ", ".join(f"'{m}'" for m in [*self.model_names, *self.engines.adapters()])
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"{served}", param="model", code="model_not_found")

    def open(self, body, received: float, prefix: Optional[str] = None,
             trace: Optional[dict] = None) -> Job:
        """A Job for a parsed completion or chat request (it holds nothing yet); its id
        is ``prefix`` then hex digits, by default the endpoint's (chatcmpl-, cmpl-). A
        request that names no model gets the first name served, one that leaves a
        sampling field out the model's recommended value, if any. ``trace``: the
        caller's trace context (frontend/tracing.py)."""
        adapter = self.check_model(body.model) if body.model is not None else None
        for key, value in self.sampling.items():
            if key not in body.model_fields_set:
                setattr(body, key, value)
        prefix = prefix or ("chatcmpl-" if isinstance(body, ChatCompletionRequest) else "cmpl-")
        timeout = self.config.request_timeout_s
        self.num_jobs += 1
        return Job(request_id=prefix + uuid.uuid4().hex, created=int(time.time()),
                   model=body.model or self.model_name, received=received,
                   stream=bool(body.stream), trace=trace or {},
                   on_close=self._closed,
                   deadline=None if timeout is None else received + timeout,
                   adapter=adapter)

    def _closed(self, job: Job) -> None:
        self.num_jobs -= 1
        if job.engine is not None:
            self.engines.release(job.engine)
        self.outputs.release_prefill(job)
        if job.submitted:
            self.metrics.record(job)
            if self.tracer is not None:
                self.tracer.record(job)

    async def tokenize(self, **kw):
        """One text or chat through the pool (/tokenize), within the tokenize timeout."""
        return await self.inputs.within_tokenize_timeout(self.inputs.call_tokenizer(**kw))

    def token_text(self, token_id: int) -> str:
        return self.inputs.strings.text(token_id)
