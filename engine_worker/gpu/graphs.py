"""CUDA graphs for decode steps and small prompt steps.

Model. A decode step of the Llama family launches hundreds of kernels; replaying them
as one captured graph removes the CPU's launch cost, which at small batches is larger
than the GPU's work. A graph replays fixed kernels on fixed addresses, so:
  * decode graphs are captured at bucketed batch sizes (1, 2, 4, 8, 16, then steps of
    16 up to the decode batch), and a step of b sequences runs the smallest bucket
    >= b, its rows past b padded (context length 0, slot -1: no KV write, no key read,
    and their logits are ignored);
  * prompt graphs are captured at bucketed token counts (16, 32, ... up to
    PROMPT_GRAPH_TOKENS or the token budget) for steps of prompt chunks alone in at
    most PROMPT_GRAPH_SEQS sequences: its tokens padded like decode rows, its
    sequences padded with empty ones, a fixed number of chunk tiles (the padding ones
    start past their chunk's end and read nothing) and of logits rows. A short
    prompt's time to first token is launch-bound without one: on an H200 a 512-token
    prompt of SmolLM2 took 10.7 ms of host time for as much device time;
  * every input lives in StepInputs' persistent buffers, whose packed layout depends
    only on the padded token and sequence counts, so the captured kernels read each
    step's inputs at the addresses they were captured with;
  * the number of splits of each decode row's context (attention.num_splits) is
    fixed per bucket.
Any other step (decode rows and prompt chunks mixed, more sequences or tokens than the
largest buckets, prompt logprobs) runs eagerly. A graph computes the hidden states and
the logits of its sampled rows; the sampler runs after it, eagerly.

``capture`` is how a callable becomes a replayable one: a CUDA graph on the GPU;
tests pass an eager stand-in (the callable itself) to check this bookkeeping on a CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from engine_worker.forward import EagerForward, Fill, Row, StepRows
from engine_worker.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


# Prompt graphs: steps of at most this many tokens (beyond, a step's device time hides
# its launches) in at most this many sequences.
PROMPT_GRAPH_TOKENS = 2048
PROMPT_GRAPH_SEQS = 4


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, up to max_batch (included)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


def prompt_graph_sizes(token_budget: int) -> list[int]:
    """16, 32, 64, ... up to PROMPT_GRAPH_TOKENS or the token budget (included)."""
    top = min(PROMPT_GRAPH_TOKENS, token_budget)
    return [n for n in (16 << i for i in range(12)) if n < top] + [top]


def prompt_graph_seqs(max_seqs: int) -> int:
    """Sequences a prompt graph's step holds: PROMPT_GRAPH_SEQS, or as many as the
    step buffers take."""
    return min(PROMPT_GRAPH_SEQS, max_seqs)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: what a capture needs. A capture in CUDA's
    global mode is invalidated by any call the driver forbids while a stream captures,
    and destroying a CUDA graph is one. Objects in reference cycles (an earlier
    engine's graph runner and its graphs) are freed when the collector runs, which
    an allocation anywhere in the process can trigger; torch no longer collects before
    a capture. Seen on an H200: "operation failed due to a previous error during
    capture", the earlier engines' graphs reset in the same millisecond."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphCapture:
    """Captures callables into CUDA graphs that share one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        fn()  # warm-up outside the capture: autotuning, lazy initialization
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class GraphForward:
    """A forward that replays a captured graph where the step fits one (a decode
    batch's bucket, or a prompt graph's), and runs ``eager`` otherwise."""

    def __init__(self, eager: EagerForward, max_batch: int, capture: Capture,
                 prompt_sizes: Sequence[int] = ()) -> None:
        """max_batch: the largest decode graph's batch; prompt_sizes: the token buckets
        of prompt graphs (none: decode graphs only)."""
        self.eager = eager
        self.inputs = eager.inputs
        self.sizes = graph_batch_sizes(min(max_batch, self.inputs.max_seqs))
        self.prompt_sizes = list(prompt_sizes)
        self.prompt_seqs = prompt_graph_seqs(self.inputs.max_seqs)
        self.capture = capture
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.prompt_graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Captures every bucket, largest first (smaller ones reuse its memory): the
        prompt graphs, then the decode graphs."""
        start = time.monotonic()
        step = self.eager.logits_of
        try:
            for size in reversed(self.prompt_sizes):
                batch = self.inputs.prepare([], [], 0, pad_chunks=(size, self.prompt_seqs))
                self.prompt_graphs[size] = self.capture(
                    lambda b=batch: step(b.input_ids, b.positions, b.meta, b.logits_rows))
        except Exception as e:  # prompt steps can run eagerly: not worth failing the start
            logger.warning("prompt steps run eagerly: capturing their CUDA graphs failed "
                           "(%s: %s)", type(e).__name__, e)
            self.prompt_graphs.clear()
            self.prompt_sizes = []
        for size in reversed(self.sizes):
            batch = self.inputs.prepare([], [], 0, pad_to=size,
                                        num_splits=self.eager.splits(size))
            self.graphs[size] = self.capture(
                lambda b=batch: step(b.input_ids, b.positions, b.meta, None))
        logger.info("captured %d CUDA graphs (decode batches %s; prompt steps of %s tokens) "
                    "in %.1f s", len(self.sizes) + len(self.prompt_sizes),
                    ", ".join(map(str, self.sizes)),
                    ", ".join(map(str, self.prompt_sizes)) or "none",
                    time.monotonic() - start)

    def bucket(self, num_seqs: int) -> Optional[int]:
        """The graph batch a decode step of num_seqs sequences runs at, if any."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def prompt_bucket(self, num_tokens: int, num_seqs: int) -> Optional[int]:
        """The token bucket a step of prompt chunks alone runs at, if any."""
        i = bisect.bisect_left(self.prompt_sizes, num_tokens)
        if i == len(self.prompt_sizes) or num_seqs > self.prompt_seqs:
            return None
        return self.prompt_sizes[i]

    def __call__(self, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
                 tokens: Optional[torch.Tensor], extra: Sequence[Row]
                 ) -> Optional[torch.Tensor]:
        rows = StepRows.of(scheduled, fills, extra)
        layout, sampled = rows.layout, rows.sampled
        if rows.extra:
            return self.eager.run(rows, tokens)
        if len(sampled) == len(layout) and all(s.num_tokens == 1 for s in layout):
            # every row of a decode step samples, in layout order = schedule order
            size = self.bucket(len(layout))
            if size is not None:
                batch = self.inputs.prepare(layout, sampled, len(sampled), pad_to=size,
                                            num_splits=self.eager.splits(size),
                                            fills=rows.fills)
                batch.fill_ids(tokens)
                return self.graphs[size]()[:batch.num_seqs]
        elif all(s.num_tokens > 1 for s in layout):
            size = self.prompt_bucket(sum(s.num_tokens for s in layout), len(layout))
            if size is not None:
                batch = self.inputs.prepare(layout, sampled, len(sampled), fills=rows.fills,
                                            pad_chunks=(size, self.prompt_seqs))
                batch.fill_ids(tokens)
                # (the logits of its sampled rows)
                logits = self.prompt_graphs[size]()[:batch.num_sampled]
                return logits if sampled else None
        return self.eager.run(rows, tokens)
