"""A checkpoint's own quantization, from its config.json's ``quantization_config``.

Served: fp8 weights (e4m3) with a scale per output channel or one per tensor, as
compressed-tensors (llm-compressor's "FP8", "FP8-dynamic") and FBGEMM (``fbgemm_fp8``)
save them: ``<layer>.weight`` in float8_e4m3fn beside ``<layer>.weight_scale``; the
layers they leave out (the lm_head, a mixture's routers) stay in the checkpoint's dtype.
Activations are quantized per token as they come (models/layers/fp8.py), so a static
input scale in the file is not read. gpt-oss's MXFP4 experts are its family's
(models/gpt_oss.py). Anything else is refused by name, not misread.
"""

from __future__ import annotations

from typing import Any

from common.errors import ModelLoadError

_SERVED = ("fp8 weights: compressed-tensors (float-quantized, 8-bit float weights per "
           "channel or per tensor) or fbgemm_fp8")


def checkpoint_format(raw: dict[str, Any]) -> str:
    """"fp8" where the checkpoint's linear weights are fp8 with scales, "" where it has
    no quantization of its own (or its family reads it: MXFP4); ModelLoadError for
    any other."""
    quant = raw.get("quantization_config")
    if not quant:
        return ""
    method = quant.get("quant_method")
    if method == "mxfp4":
        return ""
    if method == "fbgemm_fp8":
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(quant)
        return "fp8"
    raise ModelLoadError(f"quantization_config: quant_method {method!r} is not served "
                         f"(served: {_SERVED})")


def _check_compressed_tensors(quant: dict[str, Any]) -> None:
    """Every group's weights fp8 with a scale per channel or per tensor, symmetric."""
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ModelLoadError(f"quantization_config: compressed-tensors format {fmt!r} is not "
                             f"served (served: {_SERVED})")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ModelLoadError("quantization_config: compressed-tensors without config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("channel", "tensor"):
            raise ModelLoadError(
                f"quantization_config: group {name!r} quantizes weights as {kind} (type, "
                f"bits, strategy); served: {_SERVED}")
        if weights.get("symmetric") is False or weights.get("dynamic"):
            raise ModelLoadError(f"quantization_config: group {name!r}: asymmetric or "
                                 f"dynamic weight scales are not served")
