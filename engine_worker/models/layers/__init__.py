"""The layers the families' models are built of (one file each: linear, norm,
embedding, rotary, attention, mlp, moe, decoder), and ``Backends``: what the platform
hands them to compute with, once, when the model is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from torch import nn

from engine_worker.attention import AttentionBackend
from engine_worker.models.layers.linear import Linear, Role, WeightFormats
from engine_worker.models.layers.parallel import NOT_SPLIT, Parallel, Shard
from engine_worker.ops import Ops


@dataclass(frozen=True)
class Backends:
    """What a model's layers compute with (engine_worker/platform.py chooses them)."""
    # attention over the paged KV cache, one instance for every layer
    attn: AttentionBackend
    # the elementwise ops (norms, RoPE and the KV write, gates)
    ops: Ops
    # the linear layers' weight formats
    formats: WeightFormats
    # gpt-oss's MXFP4 experts kept as they are, where the platform can ((experts,
    # hidden, intermediate, gate, bias) -> the module: the GPU's grouped experts);
    # None: each expert a pair of linear layers
    mxfp4_experts: Optional[Callable[..., nn.Module]] = None
    # the rank's place among the tensor-parallel ranks the model is split over
    parallel: Parallel = NOT_SPLIT

    def linear(self, in_features: int, output_sizes: Union[int, Sequence[int]],
               bias: bool = False, role: Role = Role.WEIGHT, shard: Optional[Shard] = None
               ) -> Linear:
        return Linear(in_features, output_sizes, bias, self.formats(role), shard)
