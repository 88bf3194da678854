"""Tensor parallelism in the model layer: which part of each layer a rank holds
(``Shard``), and the collectives that join the parts (``Parallel``, over
torch.distributed: gloo on the CPU, NCCL on CUDA).

A decoder layer split over W ranks (Megatron-LM's scheme):
  * attention: each rank holds H/W query heads and the KV heads they read (KV heads
    split the same way, or, where there are fewer KV heads than ranks, each rank holds
    the one its query heads read: replicated), q, k and v's rows of them, and the
    output projection's columns of its heads; its KV cache holds its KV heads only;
  * the MLP: each rank holds I/W of the intermediate features (gate's and up's rows,
    down's columns); a mixture's every expert alike, its router whole;
  * the output projections' sums are partial on each rank: one all-reduce after the
    attention and one after the MLP join them (their biases added on rank 0 alone);
  * the vocabulary: each rank holds V/W rows of the embeddings (a token outside its
    rows embeds as zeros; an all-reduce joins them) and of the lm_head (the logits'
    columns, gathered).
Norms, RoPE, the router and everything outside the layers are every rank's whole.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig


# Seconds spent in the ranks' collectives, by kind ("all_reduce", "gather", and the
# step's "broadcast" from rank 0: step_inputs.py), while ``on`` (benchmarks time them).
class CollectiveClock:
    on = False
    seconds: Counter = Counter()
    # (and how many were called from Python: a CUDA graph's replays call none)
    calls: Counter = Counter()

    @classmethod
    def timed(cls, kind: str, collective, *args, **kw) -> None:
        if not cls.on:
            collective(*args, **kw)
            return
        start = time.perf_counter()
        collective(*args, **kw)
        cls.seconds[kind] += time.perf_counter() - start
        cls.calls[kind] += 1


@dataclass(frozen=True)
class Shard:
    """The part of a linear layer's weight a rank holds (the checkpoint holds it
    whole): of each output part, the rows ``rows[i]`` (column parallel); or the input
    columns ``cols`` (row parallel: the output is this rank's partial sum, which the
    caller all-reduces, and only the rank with ``bias`` set adds the bias)."""
    rows: Optional[tuple[slice, ...]] = None
    cols: Optional[slice] = None
    bias: bool = True

    def sizes(self, output_sizes: Sequence[int]) -> tuple[int, ...]:
        """The rank's parts' sizes."""
        if self.rows is None:
            return tuple(output_sizes)
        return tuple(len(range(n)[s]) for n, s in zip(output_sizes, self.rows))

    def take_rows(self, t: torch.Tensor, output_sizes: Sequence[int]) -> torch.Tensor:
        """The rank's rows of ``t``, whose rows are the whole layer's outputs (a weight,
        a bias, an fp8 weight's row scales)."""
        if self.rows is None:
            return t
        parts = torch.split(t, list(output_sizes))
        return torch.cat([p[s] for p, s in zip(parts, self.rows)])

    def take(self, weight: torch.Tensor, output_sizes: Sequence[int]) -> torch.Tensor:
        """The rank's part of a whole (out, in) weight."""
        weight = self.take_rows(weight, output_sizes)
        return weight if self.cols is None else weight[:, self.cols]


@dataclass(frozen=True)
class Parallel:
    """A rank's place among the ranks that split the model (size 1: not split)."""
    rank: int = 0
    size: int = 1
    # the ranks' torch.distributed process group (None: the default group)
    group: Any = None
    # Whether the collectives run: in a group (of one too: an engine in a group of
    # its own runs the code a split one does, CUDA graphs capturing its collectives)
    joined: bool = False

    def split(self, n: int, what: str, unit: int = 1) -> slice:
        """The rank's run of ``n`` things, shared as evenly as runs of ``unit`` allow
        (a packed weight format's blocks of 32 inputs: a run of whole blocks is packed
        as the whole layer's are), the later ranks' the larger (rank 0 schedules and
        samples besides). ValueError where a rank would get none."""
        if n % unit or n // unit < self.size:
            unit = 1
        units = n // unit
        if units < self.size:
            raise ValueError(f"{what} ({n}) are too few for {self.size} tensor-parallel "
                             f"ranks")
        return slice(self.rank * units // self.size * unit,
                     (self.rank + 1) * units // self.size * unit)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[slice, slice]:
        """The query heads and the KV heads this rank holds (the module docstring):
        whole KV heads, as evenly as they go, with the query heads that read them
        (SmolLM2-135M's 3 and 9 over 2 ranks: 1 and 3, and 2 and 6); where there are
        fewer KV heads than ranks, the query heads of each split evenly among the ranks
        that share it."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            kv = self.split(num_kv_heads, "the KV heads")
            return slice(kv.start * group, kv.stop * group), kv
        share = self.size // num_kv_heads
        if self.size % num_kv_heads or group % share:
            raise ValueError(f"{num_heads} query heads reading {num_kv_heads} KV heads do "
                             f"not split over {self.size} tensor-parallel ranks (the ranks "
                             f"that share a KV head split its query heads evenly)")
        head, part = divmod(self.rank, share)
        first = head * group + part * (group // share)
        return slice(first, first + group // share), slice(head, head + 1)

    def vocab(self, vocab_size: int) -> slice:
        """The rank's rows of the vocabulary: ceil(V / W) each, the last rank's fewer."""
        per = -(-vocab_size // self.size)
        return slice(min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size))

    def kv_share(self, num_heads: int, num_kv_heads: int) -> float:
        """This rank's part of the KV heads the ranks hold in all (replicated ones
        counted on each rank that holds one): of an engine's KV byte budget."""
        if self.size == 1:
            return 1.0
        held = [Parallel(r, self.size).heads(num_heads, num_kv_heads)[1]
                for r in range(self.size)]
        mine = held[self.rank]
        return (mine.stop - mine.start) / sum(h.stop - h.start for h in held)

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` as this rank's attention and KV cache see it: its heads."""
        if self.size == 1:
            return cfg
        q, kv = self.heads(cfg.num_heads, cfg.num_kv_heads)
        return dataclasses.replace(cfg, num_heads=q.stop - q.start,
                                   num_kv_heads=kv.stop - kv.start)

    def column(self, *rows: slice) -> Optional[Shard]:
        """A column-parallel layer's shard: its parts' rows (None: not split)."""
        return Shard(rows=rows) if self.size > 1 else None

    def row(self, cols: slice) -> Optional[Shard]:
        """A row-parallel layer's shard: its input columns (None: not split)."""
        return Shard(cols=cols, bias=self.rank == 0) if self.size > 1 else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        if self.joined:
            CollectiveClock.timed("all_reduce", dist.all_reduce, x, group=self.group)
        return x

    def agree(self, settings: str) -> None:
        """Every rank was started with the same ``settings`` (ValueError naming the
        ranks that were not: their steps would not line up)."""
        if self.size == 1:
            return
        mine = self._on_backend(torch.tensor([zlib.crc32(settings.encode())]))
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        other = [r for r, t in enumerate(every) if t.item() != every[0].item()]
        if other:
            raise ValueError(f"tensor-parallel rank(s) {other} were started with settings "
                             f"other than rank 0's: every rank needs the same model and "
                             f"engine flags")

    def least(self, counts: Sequence[int]) -> tuple[int, ...]:
        """Each of ``counts``' least over the ranks (what every rank has room for)."""
        if self.size == 1:
            return tuple(counts)
        t = self._on_backend(torch.tensor(counts, dtype=torch.int64))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(t.tolist())

    def _on_backend(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the group's backend moves tensors (NCCL: the rank's GPU)."""
        return t.cuda() if dist.get_backend(self.group) == "nccl" else t

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of every rank's ``x``, in place."""
        CollectiveClock.timed("all_reduce", dist.all_reduce, x, op=dist.ReduceOp.MAX,
                              group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(S, the rank's rows of the vocabulary) on each rank -> (S, V): the logits'
        columns of every rank side by side."""
        if not self.joined:
            return x
        per = -(-vocab_size // self.size)
        if x.shape[-1] < per:   # (the last rank's fewer rows, padded for the gather)
            x = torch.nn.functional.pad(x, (0, per - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        CollectiveClock.timed("gather", dist.all_gather, parts, x.contiguous(),
                              group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


NOT_SPLIT = Parallel()


def join(size: int) -> Parallel:
    """This process's place among ``size`` tensor-parallel ranks: torch.distributed's
    default group, set up by the caller (every rank a process of its own). Size 1:
    not split; in a group of one, where the caller set one up, it runs the
    collectives (gpu-check captures them in CUDA graphs that way)."""
    if size == 1 and not (dist.is_initialized() and dist.get_world_size() == 1):
        return NOT_SPLIT
    if not dist.is_initialized() or dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size {size} needs torch.distributed's default "
                         f"group of {size} processes set up first")
    return Parallel(dist.get_rank(), size, joined=True)
