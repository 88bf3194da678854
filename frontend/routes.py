"""The HTTP routes: plain module-level handlers. Each parses its body and hands the
work to the pipeline (frontend/serving.py). A completion becomes a Job run by its
JobResponse: the input processor, the output processor, then the stream or the full
body. What the routes share lives on ``app.state``, set by create_app
(frontend/app.py): the pipeline (once the lifespan has started it), the metrics, the
config and the start time.

A client that goes away is noticed in every phase (while its prompt is tokenized,
while it waits, mid-stream): the work for it is cancelled and its job closed, which
aborts its engine requests at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar, Union

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from common.errors import InvalidRequestError
from common.tokenizer import TokenStrings
from common.validation import check_token_ids
from common.version import __version__
from frontend.embeddings import EmbeddingRequest, embed
from frontend.errors import APIError, from_validation_error
from frontend.formatters import Formatter
from frontend.input_processor import chat_message, template_options, tool_dicts
from frontend.job import Job
from frontend.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeBody,
                                      TokenizeBody)
from frontend.output_processor import events
from frontend.responses_api import ResponsesFormatter, ResponsesRequest
from frontend.serving import Pipeline
from frontend.tracing import trace_context

T = TypeVar("T")
router = APIRouter()


class ClientDisconnected(Exception):
    pass


class JobResponse(Response):
    """The ASGI response of a completion request, and the one owner of its Job: it
    runs the job's stages (prepare, submit, then stream or collect) while watching
    for the client leaving, and closes the job however it ends. Errors before the
    response starts propagate to the app's handlers as their HTTP status; a streamed
    response's later errors are its last event (the output processor's)."""

    def __init__(self, pipe: Pipeline, job: Job, body,
                 formatter: Optional[Callable[[Job, TokenStrings], Formatter]] = None
                 ) -> None:
        """``formatter``: the job's, when not its endpoint's own (/v1/responses)."""
        super().__init__()
        self.pipe, self.job, self.body = pipe, job, body
        self.formatter = formatter
        self.watcher: Optional[asyncio.Future] = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            try:
                response = await self._run(receive)
            except ClientDisconnected:
                response = Response(status_code=499)  # for the access log: no one reads it
            await response(scope, receive, send)
        finally:
            if self.watcher is not None:
                self.watcher.cancel()
            self.job.close()

    async def _run(self, receive) -> Union[Response, EventStream]:
        job = self.job
        await until_disconnected(receive, self.pipe.inputs.prepare(job, self.body,
                                                                   self.formatter))
        self.pipe.outputs.submit(job)
        if job.stream:
            # A stream ends when its client leaves, even while nothing is being sent
            # (a long prefill, a KV transfer): the ASGI server reports it only to
            # whoever reads ``receive``.
            self.watcher = asyncio.ensure_future(_end_on_disconnect(receive, job))
            return EventStream(job)
        await until_disconnected(receive, _drain(events(job)))  # no events: until it ends
        if job.error is not None:
            raise job.error
        assert job.formatter is not None
        return json_response(job.formatter.full())


_SSE_START = {"type": "http.response.start", "status": 200, "headers": [
    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no")]}


class EventStream:
    """A streamed job's response: what its output processor queued since the last
    write, as one write each time the job wakes, until its last event. (Starlette's
    StreamingResponse also runs a task group per response and listens for the
    client leaving, which the JobResponse's watcher already does.)"""

    def __init__(self, job: Job) -> None:
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        await send(_SSE_START)
        async for data in events(self.job):
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _end_on_disconnect(receive: Callable[[], Awaitable[dict]], job: Job) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    job.ended = True  # its events end; JobResponse then closes it
    job.wakeup.set()


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


async def until_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first (then it is cancelled, and
    ClientDisconnected raised)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
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
    raise ClientDisconnected()


def pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


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


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await completion_response(request, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await completion_response(request, ChatCompletionRequest)


async def completion_response(request: Request, model: type[BaseModel]) -> Response:
    received = time.monotonic()
    body = await parse(request, model)
    pipe = pipeline(request)
    job = request.state.job = pipe.open(  # the access log's
        body, received, trace=trace_context(request.headers))
    return JobResponse(pipe, job, body)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """OpenAI's Responses API: a chat job written as a response (frontend/responses_api.py)."""
    received = time.monotonic()
    body = await parse(request, ResponsesRequest)
    try:
        chat = body.to_chat()
    except ValidationError as e:
        raise from_validation_error(e)
    pipe = pipeline(request)
    job = request.state.job = pipe.open(chat, received, prefix="resp_",
                                        trace=trace_context(request.headers))
    body.temperature, body.top_p = chat.temperature, chat.top_p   # as sampled: the response says
    return JobResponse(pipe, job, chat,
                       lambda job, strings: ResponsesFormatter(job, strings, body))


def model_card(request: Request, name: str, adapter_path: Optional[str] = None) -> dict:
    """A model's card; a LoRA adapter's has its folder as root and the base model as
    parent (vLLM's shape)."""
    pipe = pipeline(request)
    ready = pipe.engines.ready()
    card = {"id": name, "object": "model", "created": request.app.state.created,
            "owned_by": "roseserve", "root": pipe.model_name if adapter_path is None
            else adapter_path, "parent": None if adapter_path is None else pipe.model_name,
            "max_model_len": None if ready is None else ready.max_model_len}
    return card


@router.get("/v1/models")
async def models(request: Request) -> Response:
    pipe = pipeline(request)
    adapters = pipe.engines.adapters()
    return json_response({"object": "list", "data": [
        *(model_card(request, m) for m in pipe.model_names),
        *(model_card(request, name, path) for name, path in sorted(adapters.items()))]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    pipe = pipeline(request)
    adapter = pipe.check_model(model)
    return json_response(model_card(request, model, None if adapter is None
                                    else pipe.engines.adapters()[adapter]))


class LoadAdapterBody(BaseModel):
    lora_name: str
    lora_path: str


class UnloadAdapterBody(BaseModel):
    lora_name: str


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's: load a LoRA adapter (a PEFT folder the engines can read) on every engine;
    400 naming why where any refuses it (those that took it let go of it again)."""
    body: LoadAdapterBody = await parse(request, LoadAdapterBody)
    pipe = pipeline(request)
    if body.lora_name in pipe.model_names or body.lora_name in pipe.engines.adapters():
        raise APIError(400, f"the model '{body.lora_name}' exists already", param="lora_name")
    engines = pipe.engines.live()
    if not engines:
        raise APIError(503, "no engine is available", code="engine_unavailable")
    # (wanted from now on: an engine that becomes ready meanwhile is given it too)
    pipe.loaded_adapters[body.lora_name] = body.lora_path
    results = await asyncio.gather(*(e.adapter(body.lora_name, body.lora_path)
                                     for e in engines), return_exceptions=True)
    failed = [(e, r) for e, r in zip(engines, results)
              if isinstance(r, BaseException) or not r.ok]
    if failed:
        pipe.loaded_adapters.pop(body.lora_name, None)
        await asyncio.gather(*(e.adapter(body.lora_name) for e, r in zip(engines, results)
                               if not isinstance(r, BaseException) and r.ok),
                             return_exceptions=True)
        engine, why = failed[0]
        if isinstance(why, BaseException):   # (an engine gone meanwhile)
            raise APIError(503, f"the LoRA adapter '{body.lora_name}' was not loaded: the "
                                f"engine at {engine.address} did not answer: {why}",
                           code="engine_unavailable", headers={"Retry-After": "1"})
        raise APIError(400, f"the LoRA adapter '{body.lora_name}' was not loaded: "
                            f"{why.message}", param="lora_path")
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                    media_type="text/plain")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's: unload a LoRA adapter from every engine (each finishes the requests
    using it first); 404 where no engine serves it."""
    body: UnloadAdapterBody = await parse(request, UnloadAdapterBody)
    pipe = pipeline(request)
    pipe.loaded_adapters.pop(body.lora_name, None)
    engines = [e for e in pipe.engines.live() if body.lora_name in e.adapters]
    if not engines:
        raise APIError(404, f"no LoRA adapter named '{body.lora_name}' is loaded",
                       param="lora_name", code="model_not_found")
    await asyncio.gather(*(e.adapter(body.lora_name) for e in engines),
                         return_exceptions=True)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                    media_type="text/plain")


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    """OpenAI's embeddings (frontend/embeddings.py)."""
    body: EmbeddingRequest = await parse(request, EmbeddingRequest)
    return json_response(await embed(pipeline(request), body))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's shape: a prompt or chat messages in; count, tokens (and their text,
    with return_token_strs) and the context length out."""
    body: TokenizeBody = await parse(request, TokenizeBody)
    pipe = pipeline(request)
    if body.model is not None:
        pipe.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    kw: dict[str, Any] = {}
    if body.messages is not None:
        kw["messages"] = [chat_message(m) for m in body.messages]
        kw.update(template_options(body))
        kw["tools"] = tool_dicts(body.tools)
    else:
        kw["prompt"] = body.prompt
    kw["add_special_tokens"] = body.add_special_tokens
    try:
        result = await until_disconnected(request.receive, pipe.tokenize(**kw))
    except ClientDisconnected:
        return Response(status_code=499)
    ids = list(result.prompt_token_ids)
    ready = pipe.engines.ready()
    return json_response({
        "count": len(ids), "max_model_len": None if ready is None else ready.max_model_len,
        "tokens": ids, "token_strs": ([pipe.token_text(t) for t in ids]
                                      if body.return_token_strs else None)})


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    body: DetokenizeBody = await parse(request, DetokenizeBody)
    pipe = pipeline(request)
    if body.model is not None:
        pipe.check_model(body.model)
    try:
        check_token_ids(body.tokens, pipe.tokenizer.get_vocab_size(True), "tokens")
    except InvalidRequestError as e:
        raise APIError(400, e.message, param=e.param)
    return json_response({"prompt": pipe.tokenizer.decode(body.tokens,
                                                          skip_special_tokens=False)})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the tokenizer pool and at least one engine answer a round trip in
    time (requests can be served); each check is reported."""
    pipe: Optional[Pipeline] = getattr(request.app.state, "pipeline", None)
    if pipe is None:
        return json_response({"status": "starting"}, 503)
    engines, pool = pipe.engines.clients, pipe.tokenizer_client
    timeout = request.app.state.config.health_timeout_s
    results = await asyncio.gather(*(c.ping(timeout) for c in (*engines, pool)),
                                   return_exceptions=True)

    def verdict(r) -> str:
        return str(r) if isinstance(r, BaseException) else "ok"

    report = {f"engine {c.address}": verdict(r) for c, r in zip(engines, results)}
    report["tokenizer pool"] = verdict(results[-1])
    ok = (not isinstance(results[-1], BaseException)
          and any(not isinstance(r, BaseException) for r in results[:-1]))
    return json_response({"status": "ok" if ok else "unavailable", "checks": report},
                         200 if ok else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)
