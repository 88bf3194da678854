"""Reading safetensors checkpoints (single file or sharded with an index).

``Checkpoint.take(name)`` loads one tensor on demand, so a model copies its weights in
layer by layer without holding a second copy of the whole checkpoint; ``finish()``
then rejects tensors nobody took (a sign the architecture was misread).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from common.errors import ModelLoadError


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing shard(s): {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        raise ModelLoadError(
            f"{model_dir} has only PyTorch pickle weights; roseserve loads safetensors "
            f"only (model.safetensors, or model.safetensors.index.json and its shards)")
    raise ModelLoadError(
        f"{model_dir} has no model.safetensors (or model.safetensors.index.json); for "
        f"random weights from its config alone, use --load-format dummy")


class Checkpoint:
    def __init__(self, model_dir: Path, strip_prefixes: tuple[str, ...] = (),
                 skip_prefixes: tuple[str, ...] = ()) -> None:
        """strip_prefixes: removed from each tensor's name, in order; skip_prefixes:
        tensors not read (a multimodal checkpoint's vision tower)."""
        self.model_dir = model_dir
        self._files = [safe_open(str(p), framework="pt") for p in checkpoint_files(model_dir)]
        self._where: dict[str, tuple[int, str]] = {}
        for i, f in enumerate(self._files):
            for key in f.keys():
                if key.startswith(skip_prefixes):
                    continue
                name = key
                for prefix in strip_prefixes:
                    name = name.removeprefix(prefix)
                self._where[name] = (i, key)

    def take(self, name: str, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"checkpoint in {self.model_dir} lacks tensor {name!r}")
        i, key = self._where.pop(name)
        tensor = self._files[i].get_tensor(key)
        if shape is not None and tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def discard(self, name: str) -> None:
        self._where.pop(name, None)

    def discard_suffixes(self, suffixes: tuple[str, ...]) -> None:
        """Tensors nothing reads (a family's Architecture.unused)."""
        for name in [n for n in self._where if n.endswith(suffixes)]:
            del self._where[name]

    def finish(self) -> None:
        left = sorted(self._where)
        if left:
            raise ModelLoadError(
                f"checkpoint in {self.model_dir} has {len(left)} tensor(s) this "
                f"architecture does not use, e.g. {left[:3]}")


# The values of MXFP4's 4-bit elements (FP4 E2M1), by code; a block's scale is 2^(s - 127)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 weights, as gpt-oss's checkpoints hold them, dequantized: blocks (..., G,
    16) uint8, two elements a byte (the low nibble first), a block of 32 elements
    sharing the power of two its scale (..., G) uint8 encodes -> (..., G * 32) (exact:
    every element and scale is a float32)."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).int()    # (..., G, 16, 2)
    values = lut[codes].flatten(-3)                                     # (..., G * 32)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.view(*scales.shape, 32), exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)
