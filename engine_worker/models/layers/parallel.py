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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from engine_worker.models.config import ModelConfig


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

    def even(self, n: int, what: str) -> slice:
        """The rank's run of ``n`` things split evenly (ValueError where they do not)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) do not split evenly over {self.size} tensor-"
                             f"parallel ranks")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[slice, slice]:
        """The query heads and the KV heads this rank holds (the module docstring)."""
        q = self.even(num_heads, "the attention heads")
        if num_kv_heads >= self.size:
            return q, self.even(num_kv_heads, "the KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be shared evenly by "
                             f"{self.size} tensor-parallel ranks")
        head = self.rank // (self.size // num_kv_heads)
        return q, slice(head, head + 1)

    def vocab(self, vocab_size: int) -> slice:
        """The rank's rows of the vocabulary: ceil(V / W) each, the last rank's fewer."""
        per = -(-vocab_size // self.size)
        return slice(min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size))

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
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(S, the rank's rows of the vocabulary) on each rank -> (S, V): the logits'
        columns of every rank side by side."""
        if self.size == 1:
            return x
        per = -(-vocab_size // self.size)
        if x.shape[-1] < per:   # (the last rank's fewer rows, padded for the gather)
            x = torch.nn.functional.pad(x, (0, per - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


NOT_SPLIT = Parallel()


def join(size: int) -> Parallel:
    """This process's place among ``size`` tensor-parallel ranks: torch.distributed's
    default group, set up by the caller (every rank a process of its own)."""
    if size == 1:
        return NOT_SPLIT
    if not dist.is_initialized() or dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size {size} needs torch.distributed's default "
                         f"group of {size} processes set up first")
    return Parallel(dist.get_rank(), size)
