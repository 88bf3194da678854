"""The CPU kernels' weight formats as the linear layers' methods
(models/layers/linear.py): a weight packed once, when its block is loaded, into panels
of 16 output features in float32, bfloat16, int8, q4, iq4 or mxfp4 (cpu/csrc/gemm.c),
and multiplied by the packed GEMM."""

from __future__ import annotations

import torch

from engine_worker.cpu.kernels import CpuKernels
from engine_worker.models.layers.linear import Linear, LinearMethod, Role, WeightFormats


class PackedMethod(LinearMethod):
    def __init__(self, kernels: CpuKernels, fmt: str) -> None:
        self.kernels, self.name = kernels, fmt

    def finish(self, layer: Linear) -> None:
        """The packed copy replaces the dense weight (float32, as loaded)."""
        layer.register_buffer("packed", self.kernels.pack(layer.weight, self.name),
                              persistent=False)
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x.reshape(-1, layer.in_features), layer.packed,
                                layer.out_features, layer.bias, self.name)
        return y.view(*x.shape[:-1], layer.out_features)


class Packing:
    """The packed formats of these kernels, a method each; and, for a GGUF file's
    blocks packed as they are (models/gguf.py), the kernels themselves."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self._methods: dict[str, PackedMethod] = {}

    def method(self, fmt: str) -> PackedMethod:
        if fmt not in self._methods:
            self._methods[fmt] = PackedMethod(self.kernels, fmt)
        return self._methods[fmt]

    def formats(self, fmt: str) -> WeightFormats:
        """A model's formats: ``fmt``, but a mixture's routers float32 and MXFP4 experts
        MXFP4 (linear.py: Role)."""
        return WeightFormats(self.method(fmt), {Role.ROUTER: self.method("float32"),
                                                Role.MXFP4: self.method("mxfp4")}, self)
