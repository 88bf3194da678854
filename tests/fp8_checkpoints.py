"""Tiny fp8 checkpoints made from a model folder, saved as the tools that publish them
save theirs: compressed-tensors (llm-compressor's FP8-dynamic: a scale per output
channel, (out, 1); its FP8 scheme: one per tensor, (1,), and a static input scale) and
FBGEMM (``fbgemm_fp8``: (out, 1) scales and an input_scale_ub). Every linear layer of
the decoder's blocks is quantized; the embeddings, norms, the lm_head and a mixture's
routers stay as they were (those tools' defaults). ``dequantized`` writes the same
weights back in float32 (the fp8 values times their scales), the plain checkpoint the
fp8 one stands for."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantized(name: str) -> bool:
    """Whether the tools quantize this tensor: a linear weight of a block (an expert's
    too: Mixtral's w1, w2, w3), not a router."""
    return ".layers." in f".{name}" and re.search(r"(proj|\.w[123])\.weight$", name) is not None


def _quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(1) if per_tensor \
        else scale


def fp8_checkpoint(src: Path, out: Path, style: str = "compressed-tensors",
                   per_tensor: bool = False) -> Path:
    """``src``'s model with its blocks' linear weights in fp8, saved in ``style``
    ("compressed-tensors" or "fbgemm") to ``out``."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    saved = {}
    for name, t in tensors.items():
        if not quantized(name):
            saved[name] = t
            continue
        q, scale = _quantize(t, per_tensor)
        prefix = name.removesuffix(".weight")
        saved[name], saved[f"{prefix}.weight_scale"] = q, scale
        if style == "fbgemm":
            saved[f"{prefix}.input_scale_ub"] = torch.tensor([1200.0])
        elif per_tensor:   # the FP8 scheme's static activation scale (not read)
            saved[f"{prefix}.input_scale"] = torch.tensor([0.05])
    save_file(saved, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(style, per_tensor)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _config(style: str, per_tensor: bool) -> dict:
    if style == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "tensor" if per_tensor else "channel", "group_size": None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True,
                   "dynamic": not per_tensor, "strategy": "tensor" if per_tensor else "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}}}


def dequantized(fp8_dir: Path, out: Path) -> Path:
    """The fp8 checkpoint's weights in float32, as a plain checkpoint."""
    shutil.copytree(fp8_dir, out, dirs_exist_ok=True)
    tensors = load_file(fp8_dir / "model.safetensors")
    saved = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", ".input_scale_ub")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale")
        saved[name] = t if scale is None else t.float() * scale.float().reshape(-1, 1)
    save_file(saved, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
