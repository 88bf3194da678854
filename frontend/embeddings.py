"""POST /v1/embeddings (OpenAI's shape): each input's tokens through an engine as an
embedding request (the prompt's final hidden states pooled as the engine's --pooling
says, normalized; batched into the engine's steps beside generations), returned as
floats or base64 (little-endian float32, as OpenAI's), with the prompt tokens counted
in usage."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal, Optional, Union

import numpy as np
from pydantic import BaseModel

from common.protocol import SamplingParams
from frontend.errors import APIError

# Inputs of one request, at most (OpenAI's limit).
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


async def embed(pipe, body: EmbeddingRequest) -> dict:
    """The response to a parsed /v1/embeddings request (APIError: a 400 naming what
    is wrong, or what the engine refused)."""
    model = body.model or pipe.model_name
    adapter = pipe.check_model(model) if body.model is not None else None
    inputs = body.input
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                   and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(inputs)} items, more than {MAX_INPUTS}",
                       param="input")
    ready = pipe.engines.ready()
    if ready is None:
        raise APIError(503, "no engine is available", code="engine_unavailable")
    hidden = ready.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise APIError(400, f"this model's embeddings have {hidden} dimensions and cannot "
                            f"be shortened (dimensions {body.dimensions})",
                       param="dimensions")
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "an input string must not be empty", param="input")
            result = await pipe.tokenize(prompt=item, add_special_tokens=True)
            ids = list(result.prompt_token_ids)
        else:
            ids = list(item)
        if not ids:
            raise APIError(400, "an input must hold at least one token", param="input")
        if len(ids) >= ready.max_model_len:
            raise APIError(400, f"an input of {len(ids)} tokens is too long: this model "
                                f"takes up to {ready.max_model_len - 1}", param="input")
        prompts.append(ids)
    params = SamplingParams(max_tokens=1, embed=True, adapter=adapter)
    tasks = [asyncio.ensure_future(_one(pipe, ids, params)) for ids in prompts]
    try:   # (one that fails, or the request's time running out, ends the others)
        vectors = await asyncio.wait_for(asyncio.gather(*tasks),
                                         pipe.config.request_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(504, f"the embeddings took longer than the request timeout "
                            f"({pipe.config.request_timeout_s:g} s)",
                       code="request_timeout") from None
    finally:
        for task in tasks:
            task.cancel()
    data = []
    for i, vector in enumerate(vectors):
        value: object = vector
        if body.encoding_format == "base64":
            value = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(len(p) for p in prompts)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _one(pipe, ids: list[int], params: SamplingParams) -> list[float]:
    from engine_worker.client import EngineDeadError, EngineRequestError

    engine = pipe.engines.pick(ids, None, adapter=params.adapter)
    try:
        async for out in engine.generate(f"embd-{uuid.uuid4().hex}", ids, params):
            if out.embedding is not None:
                return out.embedding
            if out.error is not None:
                raise APIError(500, f"the embedding failed: {out.error}")
    except EngineRequestError as e:   # (an adapter unloaded since: the model is gone)
        if "does not exist" in str(e):
            raise APIError(404, str(e), param="model", code="model_not_found") from e
        raise APIError(400, str(e), param="input") from e
    except EngineDeadError as e:
        raise APIError(503, f"the engine went away: {e}", code="engine_unavailable",
                       headers={"Retry-After": "1"}) from e
    finally:
        pipe.engines.release(engine)
    raise APIError(500, "the engine returned no embedding")
