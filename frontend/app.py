"""The FastAPI application: its lifespan (the pipeline, the engine and tokenizer
clients), authentication and body limits (Guard), the error shapes, and the routes
(frontend/routes.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import faults
from common.config import FrontendConfig
from common.model_files import resolve_model_dir
from common.structured import GrammarCompiler
from common.tokenizer import chat_template_text, load_decoder
from engine_worker.client import EngineClient
from frontend.admission import Admission
from frontend.errors import APIError
from frontend.membership import Membership
from frontend.metrics import Metrics
from frontend.router import EngineRouter
from frontend.routes import router
from frontend.serving import Pipeline
from tokenizer_worker.client import TokenizerClient

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics", "/version")


class Guard:
    """ASGI middleware, before any routing: the API key (401) and the body size (413,
    by header or by count as it arrives). /health, /metrics and /version stay open. Also the
    last resort for an unexpected error: an OpenAI-shaped 500, never a dropped
    connection."""

    def __init__(self, app, config: FrontendConfig, metrics: Metrics) -> None:
        self.app = app
        self.api_key = None if config.api_key is None else config.api_key.encode()
        self.max_bytes = config.max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                self.metrics.rejected.labels("401").inc()
                error = APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
        too_big = APIError(413, f"the request body exceeds the limit of {self.max_bytes} bytes",
                           code="request_too_large")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            self.metrics.rejected.labels("413").inc()
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_big
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
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
            if not started:
                await error.response()(scope, receive, send)


# How long a starting frontend waits for the tokenizer pool and one engine to answer
# before it opens its port anyway (then it answers 503 until they do).
STARTUP_WAIT_S = 10.0


async def start_pipeline(config: FrontendConfig, metrics: Metrics) -> Pipeline:
    """The tokenizer, the grammar compiler and the clients. The pool and one engine
    are waited for STARTUP_WAIT_S at most: they may come later, and go and come back;
    until one engine and the pool answer, requests get 503."""
    model_dir = resolve_model_dir(config.model)
    tokenizer = load_decoder(model_dir)
    try:
        grammars = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(True), [])
    except Exception as e:  # a tokenizer llguidance cannot read
        logger.warning("structured output is unavailable: %s", e)
        grammars = None
    model_names = list(config.served_model_names) or [model_dir.resolve().name]
    tok_client = TokenizerClient(config.tokenizer_address, curve_key=config.curve_key)
    await tok_client.connect()
    engines = EngineRouter([], config.routing, config.disagg_min_prompt_tokens)
    pipe = Pipeline(engines, tok_client, tokenizer, metrics,
                    Admission(config.max_waiting_requests, config.max_waiting_tokens),
                    model_names, config, chat_template_text(model_dir), grammars)
    pipe.membership = Membership(
        config.engine_addresses, engines,
        lambda address: EngineClient(address, heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
                                     stall_timeout_s=config.engine_stall_timeout_s,
                                     curve_key=config.curve_key),
        interval_s=config.dns_refresh_s)
    await pipe.membership.refresh()
    pipe.membership.start()
    await _first_handshakes(pipe, STARTUP_WAIT_S)
    logger.info("frontend ready: %s, %d engine(s) from %s", ", ".join(model_names),
                len(engines.engines), ", ".join(config.engine_addresses))
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


def create_app(config: FrontendConfig) -> FastAPI:
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pipe = await start_pipeline(config, metrics)
        metrics.watch(pipe.model_name, pipe.snapshot)
        app.state.pipeline = pipe
        yield
        await pipe.membership.stop()
        for client in (*pipe.engines.clients, pipe.tokenizer_client):
            await client.close()

    app = FastAPI(title="roseserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config, app.state.metrics, app.state.created = config, metrics, int(time.time())
    app.add_middleware(Guard, config=config, metrics=metrics)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, error: APIError) -> Response:
        metrics.rejected.labels(str(error.status)).inc()
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, error: StarletteHTTPException) -> Response:
        return APIError(error.status_code, str(error.detail)).response()

    app.include_router(router)
    faults.install("frontend", app)
    return app
