"""The FastAPI application: its lifespan (the pipeline, the engine and tokenizer
clients), authentication and body limits (Guard), the error shapes, and the routes
(frontend/routes.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple, Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from common import faults
from common.config import FrontendConfig
from common.errors import ModelLoadError
from common.heap import freeze_startup_heap
from common.model_files import resolve_model_dir
from common.sampling_params import recommended_sampling
from common.structured import GrammarCompiler
from common.tokenizer import chat_template_text, load_decoder, read_chat_template
from engine_worker.client import EngineClient, StoreView
from frontend.admission import Admission
from frontend.errors import APIError
from frontend.harmony import is_harmony
from frontend.membership import Membership
from frontend.metrics import Metrics
from frontend.reasoning import Reasoning, ReasoningFormat
from frontend.router import EngineRouter
from frontend.routes import router
from frontend.serving import Pipeline
from frontend.tracing import Tracer
from tokenizer_worker.client import TokenizerClient

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("frontend.access")

_OPEN_PATHS = ("/health", "/metrics", "/version")
# What a client's X-Request-Id may be.
_REQUEST_ID = re.compile(rb"[!-~]{1,128}")


class Guard:
    """ASGI middleware, before any routing: the API key (401), the body size (413, by
    header or by count as it arrives) and the request id. /health, /metrics and
    /version stay open. Also the last resort for an unexpected error: an
    OpenAI-shaped 500, never a dropped connection.

    Every response carries ``X-Request-Id``: the client's (1-128 visible ASCII
    characters, else a 400), or the completion's ``id``, or a new one. With the access
    log on, every request but the open paths' ends in one line naming it, its status
    and time, and for a completion its id (which the engines' own lines name), tokens,
    finish reasons and engine."""

    def __init__(self, app, config: FrontendConfig, metrics: Metrics) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in config.api_keys]
        self.max_bytes = config.max_body_bytes
        self.access_log = config.access_log
        self.metrics = metrics

    def _refusal(self, scope, headers: dict, bad_request_id: bool) -> Optional[APIError]:
        if self.api_keys and scope["path"] not in _OPEN_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            # Compared with every key, each in constant time: which key, if any, matched
            # takes no measurably different time.
            known = [hmac.compare_digest(key.strip(), k) for k in self.api_keys]
            if scheme.lower() != b"bearer" or not any(known):
                return APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return self._too_big()
        if bad_request_id:
            return APIError(400, "X-Request-Id must be 1 to 128 visible ASCII characters",
                            param="X-Request-Id", code="invalid_request_id")
        return None

    def _too_big(self) -> APIError:
        return APIError(413, f"the request body exceeds the limit of {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        since = time.monotonic()
        headers = dict(scope.get("headers", []))
        given = headers.get(b"x-request-id")
        bad_id = given is not None and not _REQUEST_ID.fullmatch(given)
        if bad_id:
            given = None  # refused below; the answer gets an id of its own
        state = scope.setdefault("state", {})
        status = 0

        async def tracked_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                job = state.get("job")
                request_id = (given if given is not None
                              else job.request_id.encode() if job is not None
                              else uuid.uuid4().hex.encode())
                state["request_id"] = request_id.decode()
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id)]}
            await send(message)

        try:
            await self._serve(scope, receive, tracked_send, headers, bad_id, lambda: status)
        finally:
            if self.access_log and scope["path"] not in _OPEN_PATHS:
                try:
                    access_logger.info("%s", access_line(scope, status, time.monotonic() - since))
                except Exception:  # a log line must not cost the response
                    logger.exception("the access log line failed")

    async def _serve(self, scope, receive, send, headers, bad_id: bool, status) -> None:
        refusal = self._refusal(scope, headers, bad_id)
        if refusal is not None:
            self.metrics.rejected.labels(str(refusal.status)).inc()
            return await refusal.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_big()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except Exception as e:
            # A bug must not cost the connection: answer 500 here (Starlette's own
            # handler would re-raise to the server, which then drops the keep-alive
            # connection under the client's next request).
            if isinstance(e, APIError):
                error = e
            else:
                logger.exception("unexpected error")
                error = APIError(500, f"internal error: {type(e).__name__}")
            self.metrics.rejected.labels(str(error.status)).inc()
            if not status():
                await error.response()(scope, receive, send)


def access_line(scope, status: int, seconds: float) -> str:
    """One request, for the access log: method, path, status, time, request id; for a
    completion also its id, tokens, finish reasons (abort: not finished), time to
    first token, engine, and the error that ended it, if one did."""
    state = scope.get("state", {})
    line = (f"{scope['method']} {scope['path']} {status or '-'} {seconds:.3f}s "
            f"request_id={state.get('request_id', '-')}")
    job = state.get("job")
    if job is None:
        return line
    finishes = ",".join(c.finish_reason or "abort" for c in job.choices) or "-"
    ttft = ("-" if job.first_token_time is None
            else f"{job.first_token_time - job.received:.3f}s")
    line += (f" id={job.request_id} prompt_tokens={sum(len(p) for p in job.prompts)} "
             f"completion_tokens={sum(len(c.token_ids) for c in job.choices)} "
             f"finish={finishes} ttft={ttft} engine={job.engine_address or '-'}")
    if job.error is not None:
        line += f" error={job.error.status}: {job.error.message}"
    return line


# How long a starting frontend waits for the tokenizer pool and one engine to answer
# before it opens its port anyway (then it answers 503 until they do).
STARTUP_WAIT_S = 10.0


class ModelParts(NamedTuple):
    """What the frontend reads from the model: its folder, its tokenizer (to decode),
    its chat template's text, the reasoning parser asked for and the sampling its makers
    recommend (requests' defaults)."""
    model_dir: Path
    tokenizer: Tokenizer
    template: Optional[str]
    reasoning: Optional[ReasoningFormat]
    sampling: dict


def load_model_parts(config: FrontendConfig) -> ModelParts:
    """Raises ModelLoadError saying what is wrong with the model or the flags about it."""
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_decoder(model_dir)
    template = (read_chat_template(config.chat_template) if config.chat_template
                else chat_template_text(model_dir))
    parser = config.reasoning_parser
    if is_harmony(template) and parser != "gpt_oss":
        if parser is not None:
            raise ModelLoadError(f"the model's chat template writes gpt-oss's harmony "
                                 f"format, which the {parser} reasoning parser does not "
                                 f"read; use --reasoning-parser gpt_oss (the default there)")
        logger.info("the chat template writes harmony (gpt-oss): chat replies are read "
                    "by the gpt_oss reasoning parser")
        parser = "gpt_oss"
    reasoning = None
    if parser is not None:
        try:
            reasoning = Reasoning.resolve(parser, tokenizer)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
    sampling = recommended_sampling(model_dir) if config.generation_config == "auto" else {}
    if sampling:
        logger.info("requests that do not set them get the sampling of the model's "
                    "generation_config.json: %s (--generation-config none: OpenAI's)",
                    ", ".join(f"{k} {v}" for k, v in sampling.items()))
    return ModelParts(model_dir, tokenizer, template, reasoning, sampling)


async def start_pipeline(config: FrontendConfig, metrics: Metrics,
                         parts: Optional[ModelParts] = None) -> Pipeline:
    """The tokenizer, the grammar compiler and the clients. The pool and one engine
    are waited for STARTUP_WAIT_S at most: they may come later, and go and come back;
    until one engine and the pool answer, requests get 503."""
    model_dir, tokenizer, template, reasoning, sampling = parts or load_model_parts(config)
    try:
        grammars = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(True), [])
    except Exception as e:  # a tokenizer llguidance cannot read
        logger.warning("structured output is unavailable: %s", e)
        grammars = None
    model_names = list(config.served_model_names) or [model_dir.resolve().name]
    tok_client = TokenizerClient(config.tokenizer_address, curve_key=config.curve_key)
    await tok_client.connect()
    store = StoreView()   # the shared KV store, as the engines that use it report it
    # LoRA adapters loaded over HTTP (name -> folder): given again to an engine that
    # (re)starts without them
    loaded_adapters: dict[str, str] = {}
    engines = EngineRouter([], config.routing, config.disagg_min_prompt_tokens, store)
    tracer = Tracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    pipe = Pipeline(engines, tok_client, tokenizer, metrics,
                    Admission(config.max_waiting_requests, config.max_waiting_tokens),
                    model_names, config, template, grammars, reasoning, sampling, tracer)
    pipe.loaded_adapters = loaded_adapters
    pipe.membership = Membership(
        config.engine_addresses, engines,
        lambda address: EngineClient(address, store=store, wanted_adapters=loaded_adapters,
                                     heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
                                     stall_timeout_s=config.engine_stall_timeout_s,
                                     curve_key=config.curve_key),
        interval_s=config.dns_refresh_s)
    await pipe.membership.refresh()
    pipe.membership.start()
    await _first_handshakes(pipe, STARTUP_WAIT_S)
    answering = sum(e.ready is not None for e in engines.clients)
    waiting = [what for what, missing in [("the tokenizer pool", tok_client.ready is None),
                                          ("an engine", not answering)] if missing]
    logger.info("frontend %s: %s, %d of %d engine(s) answering, from %s",
                f"up, waiting for {' and '.join(waiting)} (503 until then)" if waiting
                else "ready", ", ".join(model_names), answering, len(engines.engines),
                ", ".join(config.engine_addresses))
    return pipe


async def _first_handshakes(pipe: Pipeline, timeout_s: float) -> None:
    """Until the pool and one engine have said Ready, or ``timeout_s``: a frontend
    started beside running engines (a rolling update) opens its port able to serve,
    rather than answering 503 for the milliseconds its handshakes take."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not (
            pipe.tokenizer_client.ready is not None
            and any(e.ready is not None for e in pipe.engines.clients)):
        await asyncio.sleep(0.02)


def create_app(config: FrontendConfig, parts: Optional[ModelParts] = None) -> FastAPI:
    """``parts``: the model's, when the caller has loaded them (else at start-up)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pipe = await start_pipeline(config, metrics, parts)
        metrics.watch(pipe.model_name, pipe.snapshot)
        app.state.pipeline = pipe
        freeze_startup_heap()
        yield
        await pipe.membership.stop()
        for client in (*pipe.engines.clients, pipe.tokenizer_client):
            await client.close()
        if pipe.tracer is not None:
            pipe.tracer.shutdown()   # the spans still waiting, sent

    app = FastAPI(title="roseserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config, app.state.metrics, app.state.created = config, metrics, int(time.time())
    app.add_middleware(Guard, config=config, metrics=metrics)
    if config.allowed_origins:
        # Outside the Guard: a browser's preflight carries no API key.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"], max_age=600)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, error: APIError) -> Response:
        metrics.rejected.labels(str(error.status)).inc()
        return error.response()

    app.include_router(router)
    served = "; ".join(f"{', '.join(sorted(r.methods - {'HEAD'}))} {r.path}"
                       for r in router.routes if isinstance(r, APIRoute))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> Response:
        return APIError(error.status_code, _http_error_message(request, error, served),
                        headers=error.headers).response()

    faults.install("frontend", app)
    return app


def _http_error_message(request: Request, error: StarletteHTTPException, served: str) -> str:
    """A route that does not exist, or a method a route does not take, named with what
    the server does serve (the router's own words are "Not Found" and "Method Not
    Allowed")."""
    path = request.url.path
    if len(path) > 200:
        path = path[:200] + "..."
    if error.status_code == 404 and error.detail == "Not Found":
        return f"there is no route {path}; this server serves {served}"
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        return f"{path} does not take {request.method}; it takes {allowed}"
    return str(error.detail)
