"""The HTTP routes: plain module-level handlers. Each parses its body, asks the
pipeline (frontend/serving.py) for the work and shapes the answer. What they share
lives on ``app.state``, set by create_app (frontend/app.py): the pipeline (once the
lifespan has started it), the metrics, the config and the start time.

A client that goes away is noticed in every phase (while its prompt is tokenized,
while it waits, mid-stream): the work for it is cancelled, which aborts its engine
requests at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from common.errors import InvalidRequestError
from common.protocol import ChatMessage
from common.validation import check_token_ids
from common.version import __version__
from frontend.errors import APIError, from_validation_error
from frontend.openai_protocol import (ChatCompletionRequest, ChatMessageParam, CompletionRequest,
                                      DetokenizeBody, TokenizeBody, ToolParam)
from frontend.responses import ChatFormatter, CompletionFormatter, Formatter
from frontend.serving import Job, Pipeline

T = TypeVar("T")
router = APIRouter()


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


async def respond(request: Request, body, job_work: Awaitable[Job],
                  formatter_cls: type[Formatter]) -> Response:
    """A started job's answer: an SSE stream, or one JSON body once it is done."""
    pipe = pipeline(request)
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


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    received = time.monotonic()
    body: CompletionRequest = await parse(request, CompletionRequest)
    work = pipeline(request).start(body, body.prompts(), None, body.max_tokens, body.logprobs,
                                   "cmpl", received)
    return await respond(request, body, work, CompletionFormatter)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    received = time.monotonic()
    body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    messages = [chat_message(m) for m in body.messages]
    work = pipeline(request).start(body, [], messages, body.max_new_tokens(),
                                   body.num_logprobs(), "chatcmpl", received,
                                   body.add_generation_prompt, tool_dicts(body.tools))
    return await respond(request, body, work, ChatFormatter)


def model_card(request: Request, name: str) -> dict:
    pipe = pipeline(request)
    ready = pipe.engines.ready()
    return {"id": name, "object": "model", "created": request.app.state.created,
            "owned_by": "roseserve", "root": pipe.model_name,
            "max_model_len": None if ready is None else ready.max_model_len}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return json_response({"object": "list", "data": [
        model_card(request, m) for m in pipeline(request).model_names]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    pipeline(request).check_model(model)
    return json_response(model_card(request, model))


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


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
