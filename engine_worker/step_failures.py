"""When a step fails: the engine's ways of keeping one request's failure its own.

A sticky CUDA error leaves the device unusable for the process (FatalDeviceError: the
engine exits and its supervisor restarts it); anything else raised while a batch is
computed or sampled is narrowed down to the requests that raise it alone, which end
with an error while the others go on (engine.LLMEngine.step).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from common.protocol import RequestOutput
from engine_worker.request import Request
from engine_worker.sampler import Sampler, Samples
from engine_worker.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from engine_worker.engine import LLMEngine

logger = logging.getLogger(__name__)

# CUDA errors after which the context is unusable: every later kernel fails too.
_STICKY_DEVICE_ERRORS = ("illegal memory access", "unspecified launch failure",
                         "device-side assert", "illegal instruction", "misaligned address",
                         "an illegal address", "uncorrectable ECC", "launch timed out",
                         "CUDA-capable device(s) is/are busy or unavailable")


class FatalDeviceError(RuntimeError):
    """The device is broken for this process (a sticky CUDA error): the engine cannot
    go on, and its process exits so that its supervisor restarts it."""


def raise_if_fatal(e: BaseException) -> None:
    """Raise FatalDeviceError for a sticky CUDA error; anything else (an out-of-memory
    error included) is left to the caller, as one request's failure."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return
    message = str(e)
    if isinstance(e, RuntimeError) and any(s in message for s in _STICKY_DEVICE_ERRORS):
        raise FatalDeviceError(f"fatal CUDA error, the engine cannot continue: {message}") from e


def sample_one_by_one(sampler: Sampler, logits: torch.Tensor, requests: list[Request]
                      ) -> Samples:
    """Each request's row sampled alone: after sampling the batch raised."""
    samples = Samples([None] * len(requests), [None] * len(requests))
    for i, request in enumerate(requests):
        try:
            one = sampler(logits[i:i + 1].clone(), [request])
        except Exception as e:
            raise_if_fatal(e)
            samples.errors[i] = f"sampling failed: {type(e).__name__}: {e}"
            continue
        samples.token_ids[i], samples.logprobs[i] = one.token_ids[0], one.logprobs[0]
        if 0 in one.errors:
            samples.errors[i] = one.errors[0]
    return samples


def forward_one_by_one(engine: "LLMEngine", scheduled: list[ScheduledRequest]
                       ) -> tuple[list[ScheduledRequest], Optional[torch.Tensor],
                                  list[RequestOutput]]:
    """After a batch's forward pass raised: run each request alone, in schedule
    order (a request may attend to blocks an earlier one fills in this step).
    A request that fails alone ends with an error, and the blocks it was filling
    leave the prefix cache; a later request that attached any of them (in-batch
    dedup) read that KV, so it is preempted and recomputed, not failed. Returns
    the requests that ran, their logits, and the failures' outputs."""
    ran: list[ScheduledRequest] = []
    rows: list[torch.Tensor] = []
    outputs: list[RequestOutput] = []
    poisoned: set[int] = set()
    for s in scheduled:
        request = s.request
        if poisoned.intersection(request.blocks.block_ids):
            engine.scheduler.preempt(request)
            continue
        try:
            logits = engine.runner.forward([s])
        except Exception as e:
            raise_if_fatal(e)
            logger.exception("the forward pass of %s failed on its own", request.request_id)
            poisoned.update(engine.block_manager.forget_from(request.blocks,
                                                             request.num_computed_tokens))
            outputs.append(engine._fail(request, f"engine step failed: {type(e).__name__}: "
                                                 f"{e}"))
            continue
        ran.append(s)
        engine._record_logits()
        if logits is not None:
            rows.append(logits)
    return ran, (torch.cat(rows) if rows else None), outputs
