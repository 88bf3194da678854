"""The FastAPI application: routes, authentication, body limits, error shapes.

A client that goes away is noticed in every phase (while its prompt is tokenized,
while it waits, mid-stream): the work for it is cancelled, which aborts its engine
requests at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import faults
from common.config import FrontendConfig
from common.errors import InvalidRequestError
from common.model_files import resolve_model_dir
from common.protocol import ChatMessage
from common.structured import GrammarCompiler
from common.tokenizer import load_tokenizer
from common.validation import check_token_ids
from common.version import __version__
from engine_worker.client import EngineClient
from frontend.errors import APIError, from_validation_error
from frontend.metrics import Metrics
from frontend.openai_protocol import (ChatCompletionRequest, ChatMessageParam, CompletionRequest,
                                      DetokenizeBody, TokenizeBody, ToolParam)
from frontend.responses import ChatFormatter, CompletionFormatter, Formatter
from frontend.admission import Admission
from frontend.router import EngineRouter
from frontend.serving import Job, Pipeline
from tokenizer_worker.client import TokenizerClient

logger = logging.getLogger(__name__)

T = TypeVar("T")
_OPEN_PATHS = ("/health", "/metrics", "/version")


class ClientDisconnected(Exception):
    pass


class JobStream(StreamingResponse):
    """An SSE response that ends its job however the response ends: a client gone
    before the first byte means the body iterator never starts, so its own cleanup
    never runs."""

    def __init__(self, pipe: Pipeline, job: Job, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.pipe, self.job = pipe, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.pipe.finish(self.job)


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


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


async def until_disconnected(request: Request, work: Awaitable[T],
                             orphan: Optional[Callable[[T], None]] = None) -> T:
    """Run ``work`` unless the client disconnects first (then it is cancelled).
    ``orphan`` receives what ``work`` returned if it finished anyway: a cancellation
    can be swallowed (asyncio.wait_for before Python 3.12 returns a result that
    arrived together with the cancellation), and what it built must then be undone."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if orphan is not None and not task.cancelled() and task.exception() is None:
        orphan(task.result())
    raise ClientDisconnected()


def create_app(config: FrontendConfig) -> FastAPI:
    metrics = Metrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        model_dir = resolve_model_dir(config.model)
        hf_tokenizer = load_tokenizer(model_dir)
        tokenizer = hf_tokenizer.backend_tokenizer
        try:
            grammars = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(True), [])
        except Exception as e:  # a tokenizer llguidance cannot read
            logger.warning("structured output is unavailable: %s", e)
            grammars = None
        model_names = list(config.served_model_names) or [model_dir.resolve().name]
        engines = [EngineClient(a, heartbeat_timeout_s=config.engine_heartbeat_timeout_s,
                                stall_timeout_s=config.engine_stall_timeout_s)
                   for a in config.engine_addresses]
        tok_client = TokenizerClient(config.tokenizer_address)
        # Nothing is waited for: engines and the pool may come later, and go and come
        # back; until one engine and the pool answer, requests get 503.
        for client in (*engines, tok_client):
            await client.connect()
        pipe = Pipeline(EngineRouter(engines, config.routing), tok_client, tokenizer, metrics,
                        Admission(config.max_waiting_requests, config.max_waiting_tokens),
                        model_names, config, hf_tokenizer.chat_template, grammars)
        metrics.watch(pipe)
        state["pipeline"] = pipe
        state["created"] = int(time.time())
        logger.info("frontend ready: %s, %d engine address(es)", ", ".join(model_names),
                    len(engines))
        yield
        for client in (*engines, tok_client):
            await client.close()

    app = FastAPI(title="roseserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(Guard, config=config, metrics=metrics)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, error: APIError) -> Response:
        metrics.rejected.labels(str(error.status)).inc()
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, error: StarletteHTTPException) -> Response:
        return APIError(error.status_code, str(error.detail)).response()

    def pipeline() -> Pipeline:
        return state["pipeline"]

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            data = msgspec.json.decode(raw)
        except UnicodeDecodeError as e:
            raise APIError(400, f"the body is not valid UTF-8: {e}", code="invalid_json")
        except RecursionError:
            raise APIError(400, "the body is nested too deeply", code="invalid_json")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e)

    async def respond(request: Request, body, job_work: Awaitable[Job],
                      formatter_cls: type[Formatter]) -> Response:
        pipe = pipeline()
        try:
            job = await until_disconnected(request, job_work, orphan=pipe.finish)
        except ClientDisconnected:
            return Response(status_code=499)
        fmt = formatter_cls(job, pipe.token_text)
        if body.stream:
            return JobStream(pipe, job, _sse(pipe, job, fmt))

        async def collect() -> None:
            async for _ in pipe.deltas(job):
                pass

        try:
            await until_disconnected(request, collect())
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            pipe.finish(job)  # also when collect() never got to start
        return json_response(fmt.full())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = time.monotonic()
        body: CompletionRequest = await parse(request, CompletionRequest)
        work = pipeline().start(body, body.prompts(), None, body.max_tokens, body.logprobs,
                                "cmpl", received)
        return await respond(request, body, work, CompletionFormatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        messages = [chat_message(m) for m in body.messages]
        work = pipeline().start(body, [], messages, body.max_new_tokens(), body.num_logprobs(),
                                "chatcmpl", received, body.add_generation_prompt,
                                tool_dicts(body.tools))
        return await respond(request, body, work, ChatFormatter)

    def model_card(name: str) -> dict:
        pipe = pipeline()
        ready = pipe.engines.ready()
        return {"id": name, "object": "model", "created": state["created"],
                "owned_by": "roseserve", "root": pipe.model_name,
                "max_model_len": None if ready is None else ready.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list",
                              "data": [model_card(m) for m in pipeline().model_names]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        pipeline().check_model(model)
        return json_response(model_card(model))

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's shape: a prompt or chat messages in; count, tokens (and their text,
        with return_token_strs) and the context length out."""
        body: TokenizeBody = await parse(request, TokenizeBody)
        pipe = pipeline()
        if body.model is not None:
            pipe.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        kw: dict[str, Any] = {}
        if body.messages is not None:
            kw["messages"] = [chat_message(m) for m in body.messages]
            kw["add_generation_prompt"] = body.add_generation_prompt
            kw["tools"] = tool_dicts(body.tools)
        else:
            kw["prompt"] = body.prompt
            kw["add_special_tokens"] = (True if body.add_special_tokens is None
                                        else body.add_special_tokens)
        try:
            result = await until_disconnected(request, pipe.tokenize(**kw))
        except ClientDisconnected:
            return Response(status_code=499)
        ids = list(result.prompt_token_ids)
        ready = pipe.engines.ready()
        return json_response({
            "count": len(ids), "max_model_len": None if ready is None else ready.max_model_len,
            "tokens": ids, "token_strs": ([pipe.token_text(t) for t in ids]
                                          if body.return_token_strs else None)})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body: DetokenizeBody = await parse(request, DetokenizeBody)
        pipe = pipeline()
        if body.model is not None:
            pipe.check_model(body.model)
        try:
            check_token_ids(body.tokens, pipe.tokenizer.get_vocab_size(True), "tokens")
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.param)
        return json_response({"prompt": pipe.tokenizer.decode(body.tokens,
                                                              skip_special_tokens=False)})

    @app.get("/health")
    async def health() -> Response:
        """200 when the tokenizer pool and at least one engine answer a round trip in
        time (requests can be served); each check is reported."""
        pipe: Optional[Pipeline] = state.get("pipeline")
        if pipe is None:
            return json_response({"status": "starting"}, 503)
        engines, pool = pipe.engines.clients, pipe.tokenizer_client
        results = await asyncio.gather(*(c.ping(config.health_timeout_s)
                                         for c in (*engines, pool)), return_exceptions=True)

        def verdict(r) -> str:
            return str(r) if isinstance(r, BaseException) else "ok"

        report = {f"engine {c.address}": verdict(r) for c, r in zip(engines, results)}
        report["tokenizer pool"] = verdict(results[-1])
        ok = (not isinstance(results[-1], BaseException)
              and any(not isinstance(r, BaseException) for r in results[:-1]))
        return json_response({"status": "ok" if ok else "unavailable", "checks": report},
                             200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    faults.install("frontend", app)
    return app


def chat_message(m: ChatMessageParam) -> ChatMessage:
    return ChatMessage(role=m.role, content=m.text(), name=m.name, tool_call_id=m.tool_call_id,
                       tool_calls=None if m.tool_calls is None else
                       [c.model_dump() for c in m.tool_calls])


def tool_dicts(tools: Optional[list[ToolParam]]) -> Optional[list[dict]]:
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


async def _sse(pipe: Pipeline, job: Job, fmt: Formatter) -> AsyncIterator[bytes]:
    encode = msgspec.json.encode
    try:
        for chunk in fmt.first_chunks():
            yield b"data: " + encode(chunk) + b"\n\n"
        remaining = len(job.choices)
        async for delta in pipe.deltas(job):
            if delta.finish_reason is not None:
                remaining -= 1
            chunk = fmt.chunk(delta, last=remaining == 0)
            if chunk is not None:
                yield b"data: " + encode(chunk) + b"\n\n"
        if job.include_usage:
            yield b"data: " + encode(fmt.usage_chunk()) + b"\n\n"
    except APIError as e:  # the stream has started: the error is its last event
        yield b"data: " + encode(e.body()) + b"\n\n"
    yield b"data: [DONE]\n\n"
