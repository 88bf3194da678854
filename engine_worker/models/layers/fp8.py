"""fp8 weights (W8A8, e4m3): a linear layer's weight in float8_e4m3fn with a float32
scale per output feature, multiplied by activations quantized per token when they come
(a scale per row: its largest magnitude over 448). ``torch._scaled_mm`` does the
product (cuBLASLt on Hopper, which takes row-wise scales; torch's own on a CPU), the
scales applied to its float32 sums, the result in the model's dtype.

An fp8 checkpoint's weights load as they are (compressed-tensors' FP8 and FBGEMM's:
models/quantization.py): per-channel scales kept, per-tensor ones repeated for each
row. A checkpoint in another dtype is quantized here as each block loads
(``--quantization fp8``), as the CPU does for int8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from engine_worker.models.layers.linear import DenseMethod, LinearMethod, Role, WeightFormats
from engine_worker.ops import FP8, FP8_MAX

if TYPE_CHECKING:
    from engine_worker.models.layers.linear import Linear

# A row of zeros keeps a scale this small, not 0 (0/0 would make NaNs)
_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, n) -> (x in fp8, (rows, 1) float32 scales): each row scaled so that its
    largest magnitude is fp8's largest, 448, and rounded to the nearest fp8."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Method(LinearMethod):
    name = "fp8"
    weight_dtype = FP8

    def load(self, layer: "Linear", weight: torch.Tensor,
             scale: Optional[torch.Tensor]) -> None:
        """The checkpoint's fp8 weight and its row scales as they are; a weight in
        another dtype quantized a row at a time."""
        if layer.weight.is_cuda and (layer.in_features % 16 or layer.out_features % 16):
            raise ValueError(f"fp8 weights on CUDA need layers whose sizes are multiples of "
                             f"16 (cuBLASLt's fp8 GEMM); this model has one of "
                             f"{layer.in_features} -> {layer.out_features}: serve it in "
                             f"bfloat16")
        if scale is None:
            weight, scale = quantize_rows(weight.to(layer.weight.device))
        layer.weight.copy_(weight)
        layer.register_buffer("weight_scale", scale.float().reshape(-1).to(
            layer.weight.device), persistent=False)

    def rows(self, layer: "Linear") -> list[torch.Tensor]:
        return [layer.weight, layer.weight_scale]

    def scale_rows(self, layer: "Linear", factor: float) -> None:
        layer.weight_scale *= factor

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        q, scale = quantize_rows(rows)
        y = torch._scaled_mm(q, layer.weight.t(), scale_a=scale,
                             scale_b=layer.weight_scale.view(1, -1), out_dtype=x.dtype)
        if layer.bias is not None:   # (added apart: not every row-wise GEMM takes a bias)
            y += layer.bias
        return y.view(*x.shape[:-1], layer.out_features)


def fp8_formats(dtype: torch.dtype) -> WeightFormats:
    """A model's formats in fp8: every linear layer but the lm_head and a mixture's
    routers (kept in ``dtype``, as fp8 checkpoints keep them); MXFP4 experts dense
    where the platform does not keep them so."""
    dense = DenseMethod(dtype)
    return WeightFormats(Fp8Method(), {role: dense for role in
                                       (Role.LM_HEAD, Role.ROUTER, Role.MXFP4)})
