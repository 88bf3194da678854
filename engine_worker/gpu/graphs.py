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
  * any other step of up to the largest prompt bucket's tokens (decode rows and prompt
    chunks mixed, as staggered arrivals make them; more sequences than a prompt graph
    holds) but one that wants prompt logprobs replays piecewise graphs (``PiecewiseGraphs``) captured at
    the same token buckets: the model in pieces around each layer's attention (the
    embeddings and the first layer's projections, RoPE and KV write; each layer's
    output projection and MLP with the next one's projections; the last with the final
    norm), the attention between them run eagerly on the step's own metadata, which
    no graph could hold for every mix. What passes from a piece to the next lives in
    buffers of their own. The logits are computed after, eagerly.
Larger steps run eagerly (their device time hides their launches). A graph computes
the hidden states and the logits of its sampled rows; the sampler runs after it,
eagerly.

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


class PiecewiseGraphs:
    """The model's steps at bucketed token counts, captured in pieces around each
    layer's attention, which runs eagerly between them (the module docstring). Needs a
    model of layers with two parts (DecoderModel's: ``embed``, each layer's
    ``before_attention`` and ``after_attention``, ``final_norm``)."""

    def __init__(self, eager: EagerForward, capture: Capture, sizes: Sequence[int]) -> None:
        self.eager, self.capture, self.sizes = eager, capture, list(sizes)
        self.pieces: dict[int, list[Callable[[], torch.Tensor]]] = {}
        # what passes between the pieces, by name: one buffer for every bucket (made
        # at the largest, captured first; a bucket's are its first rows), and by bucket
        self.buffers: dict[str, torch.Tensor] = {}
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def bucket(self, num_tokens: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture_all(self, inputs) -> None:
        for size in reversed(self.sizes):
            self._capture(size, inputs.prepare([], [], 0, pad_tokens=size))

    def _capture(self, size: int, batch) -> None:
        model, caches, meta = self.eager.model, self.eager.kv_caches, batch.meta
        layers = model.layers
        kept = self.kept.setdefault(size, {})

        def keep(name: str, t: torch.Tensor) -> torch.Tensor:
            """t copied into the buffer ``name`` (made by the first, uncaptured run)."""
            if name not in kept:
                if name not in self.buffers:
                    self.buffers[name] = torch.empty_like(t)
                kept[name] = self.buffers[name][:t.shape[0]]
            return kept[name].copy_(t)

        def rope(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            kind = layers[i].rope_kind
            return kept[f"cos{kind}"], kept[f"sin{kind}"]

        def before(i: int, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
            q, k, v, carry = layers[i].before_attention(x, residual, rope(i), caches[i], meta)
            for name, t in (("q", q), ("k", k), ("v", v), ("carry", carry)):
                keep(name, t)
            return kept["q"]

        def first() -> torch.Tensor:
            x, ropes = model.embed(batch.input_ids, batch.positions)
            for kind, (cos, sin) in enumerate(ropes):
                keep(f"cos{kind}", cos)
                keep(f"sin{kind}", sin)
            return before(0, x, None)

        def middle(i: int) -> torch.Tensor:
            x, residual = layers[i - 1].after_attention(kept["out"], kept["carry"])
            return before(i, x, residual)

        def last() -> torch.Tensor:
            x, residual = layers[-1].after_attention(kept["out"], kept["carry"])
            return keep("hidden", model.final_norm(x, residual))

        def captured(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
            fn()   # once as it is, outside the capture: the buffers it keeps made
            return self.capture(fn)

        with torch.inference_mode():
            pieces = [captured(first)]
            for i in range(len(layers)):
                keep("out", self._attend(size, i, meta))   # (its buffer, before a capture)
                pieces.append(captured(lambda i=i: middle(i + 1) if i + 1 < len(layers)
                                       else last()))
        self.pieces[size] = pieces

    def _attend(self, size: int, i: int, meta) -> torch.Tensor:
        kept = self.kept[size]
        return self.eager.model.layers[i].self_attn.attend(
            kept["q"], kept["k"], kept["v"], self.eager.kv_caches[i], meta)

    def hidden(self, size: int, batch) -> torch.Tensor:
        """The final hidden states (size, C) of a step in ``batch`` (prepared with
        pad_tokens=size): the pieces replayed, each layer's attention run between."""
        kept, pieces = self.kept[size], self.pieces[size]
        with torch.inference_mode():
            pieces[0]()
            for i in range(len(pieces) - 1):
                kept["out"].copy_(self._attend(size, i, batch.meta))
                pieces[i + 1]()
        return kept["hidden"]


class GraphForward:
    """A forward that replays a captured graph where the step fits one (a decode
    batch's bucket, or a prompt graph's), piecewise graphs where it fits their token
    buckets, and runs ``eager`` otherwise."""

    def __init__(self, eager: EagerForward, max_batch: int, capture: Capture,
                 prompt_sizes: Sequence[int] = (), piecewise: bool = False) -> None:
        """max_batch: the largest decode graph's batch; prompt_sizes: the token buckets
        of prompt graphs (none: decode graphs only) and, with ``piecewise``, of the
        piecewise graphs."""
        self.eager = eager
        self.inputs = eager.inputs
        self.sizes = graph_batch_sizes(min(max_batch, self.inputs.max_seqs))
        self.prompt_sizes = list(prompt_sizes)
        self.prompt_seqs = prompt_graph_seqs(self.inputs.max_seqs)
        self.capture = capture
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.prompt_graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.piecewise = PiecewiseGraphs(eager, capture, prompt_sizes) if piecewise else None

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
        pieces = 0
        if self.piecewise is not None:
            try:
                self.piecewise.capture_all(self.inputs)
                pieces = sum(len(p) for p in self.piecewise.pieces.values())
            except Exception as e:  # mixed steps can run eagerly
                logger.warning("mixed steps run eagerly: capturing their piecewise CUDA "
                               "graphs failed (%s: %s)", type(e).__name__, e)
                self.piecewise = None
        logger.info("captured %d CUDA graphs (decode batches %s; prompt steps of %s tokens; "
                    "%d pieces of mixed steps) in %.1f s",
                    len(self.sizes) + len(self.prompt_sizes), ", ".join(map(str, self.sizes)),
                    ", ".join(map(str, self.prompt_sizes)) or "none", pieces,
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

    def serves_lora(self) -> bool:
        return False   # (the graphs hold no adapters' products: such steps run eagerly)

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
        num_tokens = sum(s.num_tokens for s in layout)
        size = self.piecewise.bucket(num_tokens) if self.piecewise is not None else None
        if size is not None:
            batch = self.inputs.prepare(layout, sampled, len(sampled),
                                        num_splits=self.eager.splits(rows.num_decode),
                                        fills=rows.fills, pad_tokens=size)
            batch.fill_ids(tokens)
            return self.eager.logits(self.piecewise.hidden(size, batch), batch)
        return self.eager.run(rows, tokens)
