"""CUDA graphs for decode steps.

Model. A decode step of the Llama family launches hundreds of kernels; replaying them
as one captured graph removes the CPU's launch cost, which at small batches is larger
than the GPU's work. A graph replays fixed kernels on fixed addresses, so:
  * graphs are captured at bucketed batch sizes (1, 2, 4, 8, 16, then steps of 16 up
    to the decode batch), and a step of b sequences runs the smallest bucket >= b, its
    rows past b padded (context length 0, slot -1: no KV write, no key read, and
    their logits are ignored);
  * every input lives in StepInputs' persistent buffers, whose packed layout for a
    padded decode step depends only on the bucket size, so the captured kernels read
    each step's inputs at the addresses they were captured with;
  * the number of splits of each decode row's context (attention.num_splits) is
    fixed per bucket.
A step with prompt chunks, or more sequences than the largest bucket, runs eagerly.
The graph computes the hidden states and the logits of every row; the sampler runs
after it, eagerly.

``capture`` is how a callable becomes a replayable one: a CUDA graph on the GPU;
tests pass an eager stand-in (the callable itself) to check this bookkeeping on a CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import torch

from engine_worker.attention import AttentionMetadata
from engine_worker.step_inputs import StepBatch, StepInputs

logger = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, up to max_batch (included)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


class CudaGraphCapture:
    """Captures callables into CUDA graphs that share one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        fn()  # warm-up outside the capture: autotuning, lazy initialization
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


class GraphRunner:
    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata],
                                      torch.Tensor],
                 inputs: StepInputs, max_batch: int, splits: Callable[[int], int],
                 capture: Capture) -> None:
        """step(input_ids, positions, meta) -> logits of every row: what a graph
        holds. splits(batch) -> the decode splits of a bucket."""
        self.step = step
        self.inputs = inputs
        self.sizes = graph_batch_sizes(max_batch)
        self.splits = splits
        self.capture = capture
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def capture_all(self) -> None:
        """Captures every bucket, largest first (smaller ones reuse its memory)."""
        start = time.monotonic()
        for size in reversed(self.sizes):
            batch = self.inputs.prepare([], [], 0, pad_to=size, num_splits=self.splits(size))
            self.graphs[size] = self.capture(
                lambda b=batch: self.step(b.input_ids, b.positions, b.meta))
        logger.info("captured %d CUDA graphs (decode batches %s) in %.1f s",
                    len(self.sizes), ", ".join(map(str, self.sizes)), time.monotonic() - start)

    def bucket(self, num_seqs: int) -> Optional[int]:
        """The graph batch a decode step of num_seqs sequences runs at, if any."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Replays the graph the batch was prepared for (prepare(..., pad_to=bucket));
        returns the logits of its real rows, (num_seqs, V)."""
        size = batch.meta.num_decode
        return self.graphs[size]()[:batch.num_seqs]
