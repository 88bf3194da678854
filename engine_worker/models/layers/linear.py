"""Linear layers and the weight formats they hold.

A ``Linear`` is one projection, or several fused into one matmul (q, k and v; gate and
up: ``output_sizes``, its output their concatenation). What it holds and how it
multiplies is its ``method``, a ``LinearMethod`` per weight format: torch's dense
weight in the model's dtype on any device (``DenseMethod``), or the CPU kernels'
packed panels in float32, bfloat16, int8, q4, iq4 or mxfp4
(engine_worker/cpu/formats.py). Every layer is built with a dense weight (on the meta
device, then given memory, then the checkpoint's values: models/loader.py), and as soon
as its block's weights are in, ``finish`` makes that what it computes with (the packed
formats pack it and let the dense copy go); a GGUF file's blocks go to ``load_packed``
as they are.

Which method a layer gets is ``WeightFormats``'s choice, made once for the model by the
platform from --dtype, --quantization and the file (engine_worker/platform.py), with
the exceptions a layer's role asks for (``Role``).

A layer split across tensor-parallel ranks (models/layers/parallel.py) is built with
its ``Shard``: it is the shape of its part, and takes its part of each whole tensor the
checkpoint gives it (``load``, ``load_bias``); ``full_sizes`` and ``full_in`` are the
whole layer's, as the checkpoint holds it.

LoRA adapters (models/layers/lora.py) add each row's low-rank product to ``forward``'s
result; what the loader did to the outputs (``output_factor``, ``output_rows``) is
done to theirs too.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.models.layers.lora import LoraWeights
from engine_worker.models.layers.parallel import Shard


class Role(enum.Enum):
    """What a layer is for, where that changes its format."""
    # most layers: the model's format
    WEIGHT = "weight"
    # a mixture's router: kept float32 where the model's format would round it (as
    # vLLM's and llama.cpp's files keep it): a rounded score can send a token to another
    # expert
    ROUTER = "router"
    # weights whose values are MXFP4's (gpt-oss's experts): kept MXFP4 where a method
    # holds that exactly (5 bits a weight, where int8 takes 9 and rounds them)
    MXFP4 = "mxfp4"
    # the logits' projection: kept in the model's dtype by fp8 (as fp8 checkpoints
    # keep it: its rounding moves every logit)
    LM_HEAD = "lm_head"


class LinearMethod:
    """How one weight format holds a linear layer's weight and multiplies by it."""

    # the format's name ("float32", "bfloat16", "int8", ...), as the logs and
    # --quantization name it
    name: str
    # the dtype the layer's weight is made in; None: the model's (loaded dense)
    weight_dtype: Optional[torch.dtype] = None

    def load(self, layer: "Linear", weight: torch.Tensor,
             scale: Optional[torch.Tensor]) -> None:
        """The checkpoint's weight (out, in) into the layer; ``scale``: an fp8
        weight's, a row's each (models/layers/fp8.py), which a dense weight takes
        dequantized."""
        if scale is not None:
            weight = weight.float() * scale.float().reshape(-1, 1)
        layer.weight.copy_(weight)

    def rows(self, layer: "Linear") -> list[torch.Tensor]:
        """The loaded tensors whose rows are its output features'."""
        return [layer.weight]

    def scale_rows(self, layer: "Linear", factor: float) -> None:
        """The loaded weight's every row multiplied by ``factor``."""
        layer.weight *= factor

    def finish(self, layer: "Linear") -> None:
        """The loaded dense weight made what ``apply`` computes with."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> x @ weight.T + bias, (..., out)."""
        raise NotImplementedError


class DenseMethod(LinearMethod):
    """The weight as a torch tensor in the model's dtype: torch's matmul (any device)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.name = dtype, str(dtype).removeprefix("torch.")

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class WeightFormats:
    """The methods of a model's linear layers: its format's, and where a role asks for
    another, that one."""

    def __init__(self, method: LinearMethod,
                 by_role: Optional[dict[Role, LinearMethod]] = None,
                 packing: Any = None) -> None:
        """packing: the CPU kernels' packed formats (cpu/formats.py: Packing), which a
        GGUF file's blocks are served in; None where they are not."""
        self.method = method
        self.by_role = by_role or {}
        self.packing = packing

    def __call__(self, role: Role = Role.WEIGHT) -> LinearMethod:
        return self.by_role.get(role, self.method)


class Linear(nn.Module):
    """A linear layer; ``output_sizes``: the parts of its output, fused into one matmul
    (their weights stacked in that order); ``shard``: the part of it this rank holds
    (None: all of it)."""

    def __init__(self, in_features: int, output_sizes: Union[int, Sequence[int]],
                 bias: bool, method: LinearMethod, shard: Optional[Shard] = None) -> None:
        super().__init__()
        self.full_sizes = ((output_sizes,) if isinstance(output_sizes, int)
                           else tuple(output_sizes))
        self.full_in = in_features
        self.shard = shard
        self.output_sizes = shard.sizes(self.full_sizes) if shard else self.full_sizes
        if shard is not None and shard.cols is not None:
            in_features = len(range(in_features)[shard.cols])
        self.in_features, self.out_features = in_features, sum(self.output_sizes)
        self.method = method
        # LoRA adapters on it (lora.py), and what the loader did to its outputs since
        # the checkpoint: a factor folded in, and its first rows' order
        self.lora: Optional[LoraWeights] = None
        self.output_factor = 1.0
        self.output_rows: Optional[torch.Tensor] = None
        # made on the meta device and given memory by the loader; empty until loaded
        self.weight: Optional[nn.Parameter] = nn.Parameter(
            torch.empty(self.out_features, in_features,
                        dtype=method.weight_dtype or torch.float32), requires_grad=False)
        self.bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None)

    @property
    def fmt(self) -> str:
        return self.method.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.add(x, y)

    def load(self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        """Its weight (out, in) from a checkpoint, in the method's form; ``scale``: an
        fp8 weight's row scales. Whole: a split layer takes its part."""
        if self.shard is not None:
            weight = self.shard.take(weight, self.full_sizes)
            if scale is not None:
                scale = self.shard.take_rows(scale, self.full_sizes)
        self.method.load(self, weight, scale)

    def load_bias(self, bias: torch.Tensor) -> None:
        """Its bias from a checkpoint, whole (a split layer takes its part; a
        row-parallel layer's is added by one rank alone)."""
        assert self.bias is not None
        if self.shard is None:
            self.bias.copy_(bias)
        elif self.shard.bias:
            self.bias.copy_(self.shard.take_rows(bias, self.full_sizes))
        else:
            self.bias.zero_()

    def keep_dense(self, method: "DenseMethod") -> None:
        """Computes with a dense weight in ``method``'s dtype instead (a layer an fp8
        checkpoint left unquantized), its memory made anew."""
        self.method = method
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               dtype=method.dtype, device=self.weight.device),
                                   requires_grad=False)

    def scale_outputs(self, factor: float) -> None:
        """Every output multiplied by ``factor``, folded into the loaded weight and bias
        (before ``finish``)."""
        self.method.scale_rows(self, factor)
        if self.bias is not None:
            self.bias *= factor
        self.output_factor *= factor

    def reorder_outputs(self, rows: torch.Tensor) -> None:
        """Its first len(rows) outputs taken in the order of ``rows`` (before
        ``finish``)."""
        tensors = self.method.rows(self) + ([self.bias] if self.bias is not None else [])
        for t in tensors:
            if t.element_size() == 1:   # fp8: moved as bytes (not every index op takes it)
                t = t.view(torch.uint8)
            t[:len(rows)] = t[rows.to(t.device)]
        before = self.output_rows
        self.output_rows = rows if before is None else before[rows]

    def finish(self) -> None:
        """Called once its weight is loaded (models/loader.py)."""
        self.method.finish(self)

    def tie(self, weight: torch.Tensor) -> None:
        """Computes with ``weight`` (a tied lm_head: the embedding's), finished: the
        dense method shares it, a packed one packs a copy."""
        self.weight = weight
        self.finish()

    def load_packed(self, packed: torch.Tensor, method: LinearMethod) -> None:
        """Computes with ``packed``, a weight already in ``method``'s form (a GGUF
        file's blocks, engine_worker/models/gguf.py); the dense weight is let go."""
        self.method = method
        self.weight = None
        self.register_buffer("packed", packed, persistent=False)

    def extra_repr(self) -> str:
        shard = "" if self.shard is None else f", of in={self.full_in}, out={self.full_sizes}"
        return (f"in={self.in_features}, out={self.output_sizes}{shard}, "
                f"bias={self.bias is not None}, format={self.fmt}")


def finish_linears(module: nn.Module) -> None:
    """Every linear layer of ``module`` that holds a dense weight, finished (again:
    a no-op, for those that compute with it)."""
    for layer in module.modules():
        if isinstance(layer, Linear) and layer.weight is not None:
            layer.finish()
