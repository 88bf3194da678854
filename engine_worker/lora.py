"""The LoRA adapters an engine serves: PEFT's folders (adapter_config.json and
adapter_model.safetensors), each in a slot of every layer it targets
(models/layers/lora.py), loaded at start (--lora-modules NAME=PATH) or while serving,
and unloaded once the requests that use them end.

An adapter is checked as it loads, and refused with a message naming what is wrong: a
folder that is not a LoRA adapter, a rank above --max-lora-rank, DoRA, trained biases
or whole modules (modules_to_save), a module this engine does not serve adapters on
(embeddings, the lm_head, a mixture's experts and router), and weights whose shapes
are not this model's (an adapter of another base model).

A request names its adapter (SamplingParams.adapter); its prefix-cache blocks are
salted with the adapter's name and a fingerprint of its weights, so that KV computed
under one adapter is never served to a request of another (or of none).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.errors import InvalidRequestError
from common.protocol import AdapterInfo
from engine_worker.models.layers.linear import Linear
from engine_worker.models.layers.lora import LoraContext, LoraWeights
from engine_worker.models.names import SPLIT, TensorNames
from engine_worker.models.spec import Architecture

# PEFT's prefix of a saved adapter's tensor names (its wrapper of the model)
PEFT_PREFIX = "base_model.model."
MAX_NAME_CHARS = 128

logger = logging.getLogger(__name__)


class AdapterError(InvalidRequestError):
    """An adapter that cannot be loaded or used (a 400 naming why)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_path")


@dataclass
class Adapter:
    name: str
    path: str
    slot: int
    rank: int
    # its name and a fingerprint of its weights: the prefix cache's salt
    key: str
    # requests using it; unloading: it takes no more, and goes when they end
    users: int = 0
    unloading: bool = False


class Adapters:
    def __init__(self, model: nn.Module, arch: Architecture, checkpoint_prefixes: tuple,
                 max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 split: bool = False) -> None:
        """dtype: the activations' (the model computes in); split: whether the model
        is split over tensor-parallel ranks (no adapter is loaded then)."""
        self.device, self.dtype, self.split = device, dtype, split
        self.context = LoraContext()
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}
        self.free_slots = list(range(1, max_loras + 1))
        self.prefixes = checkpoint_prefixes
        names = TensorNames(arch.names, SPLIT)
        # The layers adapters may target: our path -> (the layer, its parts' names as
        # the checkpoint has them)
        self.targets: dict[str, tuple[Linear, tuple[str, ...]]] = {}
        for path, module in model.named_modules():
            if isinstance(module, Linear) and _adaptable(path):
                self.targets[path] = (module, names(path)[0])

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def infos(self) -> list[AdapterInfo]:
        """The adapters served (not those unloading), as the protocol lists them."""
        return [AdapterInfo(name=a.name, path=a.path, rank=a.rank, key=a.key)
                for a in sorted(self.by_name.values(), key=lambda a: a.name)
                if not a.unloading]

    # -- loading -----------------------------------------------------------------

    def load(self, name: str, path: str) -> Adapter:
        """Load the adapter at ``path`` as ``name`` (AdapterError where it cannot)."""
        if self.split:
            raise AdapterError("LoRA adapters are not served with the model split over "
                               "tensor-parallel ranks yet")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS \
                or any(c.isspace() for c in name):
            raise AdapterError(f"an adapter's name is 1 to {MAX_NAME_CHARS} characters "
                               f"without whitespace, got {name!r}")
        if name in self.by_name:
            raise AdapterError(f"an adapter named {name!r} is loaded already")
        folder = Path(path)
        config, tensors = _read(folder)
        weights = self._weights(folder, config, tensors)
        if not self.free_slots:
            raise AdapterError(f"{len(self.by_name)} adapters are loaded, the most this "
                               f"engine holds (--max-loras); unload one first")
        slot = self.free_slots[0]
        rank = max(ab[0].shape[0] for parts in weights.values() for ab in parts
                   if ab is not None)
        try:
            for layer_path, parts in weights.items():
                layer = self.targets[layer_path][0]
                a, b, ranks = _fused(layer, parts)
                if layer.lora is None:
                    layer.lora = LoraWeights(self.context, _row_parts(layer, len(parts)))
                layer.lora.set(slot, a.to(self.device, self.dtype),
                               b.to(self.device, self.dtype), ranks)
        except Exception as e:   # (out of memory): no layer keeps any of it
            self._clear(slot)
            raise AdapterError(f"{folder}: loading the adapter failed: {e}") from e
        self.free_slots.pop(0)
        digest = hashlib.blake2b(digest_size=8)
        for key in sorted(tensors):
            digest.update(key.encode() + tensors[key].float().numpy().tobytes())
        adapter = Adapter(name, str(folder), slot, rank, f"{name}:{digest.hexdigest()}")
        self.by_name[name] = adapter
        logger.info("LoRA adapter %s loaded from %s", name, path)
        return adapter

    def _weights(self, folder: Path, config: dict, tensors: dict[str, torch.Tensor]
                 ) -> dict[str, list]:
        """Our target layers' parts' (A, B scaled), by layer (AdapterError where the
        adapter is not one this model can take)."""
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{folder} is a {config.get('peft_type')} adapter; LoRA "
                               f"adapters are served")
        for key, what in (("use_dora", "DoRA"), ("modules_to_save", "whole modules "
                          "(modules_to_save)"), ("layers_to_transform", "some layers only "
                          "(layers_to_transform)")):
            if config.get(key):
                raise AdapterError(f"{folder}: {what} is not served")
        if config.get("bias", "none") != "none":
            raise AdapterError(f"{folder}: trained biases (bias={config['bias']!r}) are not "
                               f"served")
        by_name: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise AdapterError(f"{folder}: tensor {key!r} is not a LoRA A or B weight "
                                   f"of a linear layer (adapters on embeddings are not "
                                   f"served)")
            for prefix in self.prefixes:
                module = module.removeprefix(prefix)
            by_name.setdefault(module, {})[kind[0]] = t
        out: dict[str, list] = {}
        for path, (layer, parts) in self.targets.items():
            found = [by_name.pop(p, None) for p in parts]
            if not any(found):
                continue
            out[path] = [None if f is None else _scaled(folder, config, p, f, self.max_rank)
                         for p, f in zip(parts, found)]
            _check_shapes(folder, layer, parts, out[path])
        if by_name:
            raise AdapterError(f"{folder} targets modules this engine does not serve "
                               f"adapters on: {sorted(by_name)[:4]} (the attention's and "
                               f"the MLP's linear layers are served; not the lm_head, "
                               f"embeddings or a mixture's experts)")
        if not out:
            raise AdapterError(f"{folder} holds no LoRA weights")
        return out

    # -- use ---------------------------------------------------------------------

    def acquire(self, name: str) -> Adapter:
        """A request's adapter, counted as in use (InvalidRequestError: no such one)."""
        adapter = self.by_name.get(name)
        if adapter is None or adapter.unloading:
            raise InvalidRequestError(f"the model {name!r} does not exist", "model")
        adapter.users += 1
        return adapter

    def release(self, slot: int) -> None:
        """A request of the adapter in ``slot`` ended."""
        for adapter in self.by_name.values():
            if adapter.slot == slot:
                adapter.users -= 1
                if adapter.unloading and adapter.users == 0:
                    self._free(adapter)
                return

    def unload(self, name: str) -> bool:
        """Unload ``name`` (now, or once its requests end); whether it was loaded."""
        adapter = self.by_name.get(name)
        if adapter is None or adapter.unloading:
            return False
        adapter.unloading = True
        if adapter.users == 0:
            self._free(adapter)
        return True

    def _clear(self, slot: int) -> None:
        for layer, _ in self.targets.values():
            if layer.lora is not None:
                layer.lora.drop(slot)

    def _free(self, adapter: Adapter) -> None:
        self._clear(adapter.slot)
        del self.by_name[adapter.name]
        self.free_slots.append(adapter.slot)
        self.free_slots.sort()


def _adaptable(path: str) -> bool:
    """Whether adapters may target the layer at ``path``: the attention's and the
    MLP's (not the lm_head, a mixture's experts or routers)."""
    last = path.rpartition(".")[2]
    return path != "lm_head" and ".experts." not in path and last not in (
        "gate", "shared_expert_gate")


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{folder} is not a LoRA adapter folder (adapter_config.json "
                           f"and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
        from safetensors.torch import load_file

        tensors = load_file(str(weights_path))
    except Exception as e:   # unreadable JSON or safetensors
        raise AdapterError(f"{folder}: cannot read the adapter: {e}") from e
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object")
    return config, tensors


def _pattern(patterns: dict, module: str):
    """PEFT's per-module override (rank_pattern, alpha_pattern): a key matching the
    module's name, whole or a suffix of its dotted path."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return None


def _scaled(folder: Path, config: dict, module: str, ab: dict, max_rank: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's (A, B times the scaling)."""
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{folder}: {module} has lora_{''.join(ab)} without its pair")
    a, b = ab["A"].float(), ab["B"].float()
    r = a.shape[0]
    if r > max_rank:
        raise AdapterError(f"{folder}: rank {r} ({module}) is above this engine's "
                           f"--max-lora-rank {max_rank}")
    alpha = _pattern(config.get("alpha_pattern"), module) or config.get("lora_alpha", r)
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    return a, b * scaling


def _check_shapes(folder: Path, layer: Linear, parts: tuple[str, ...], found: list) -> None:
    sizes = layer.full_sizes if len(parts) > 1 else (sum(layer.full_sizes),)
    for part, size, ab in zip(parts, sizes, found):
        if ab is None:
            continue
        a, b = ab
        if a.shape[1] != layer.full_in or b.shape != (size, a.shape[0]):
            raise AdapterError(f"{folder} is not an adapter of this model: {part} has "
                               f"A {tuple(a.shape)} and B {tuple(b.shape)}, where this "
                               f"model's layer takes {layer.full_in} inputs to {size} "
                               f"outputs")


def _fused(layer: Linear, parts: list
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """A layer's (A, B) from its parts': A's rows stacked, B block-diagonal; then what
    the loader did to the layer's outputs, and the rank's part of a split layer. Also
    each part's rank (0: the adapter has none of it)."""
    sizes = layer.full_sizes if len(parts) > 1 else (sum(layer.full_sizes),)
    ranks = tuple(0 if ab is None else ab[0].shape[0] for ab in parts)
    a = torch.zeros(sum(ranks), layer.full_in)
    b = torch.zeros(sum(sizes), sum(ranks))
    row = col = 0
    for size, ab, r in zip(sizes, parts, ranks):
        if ab is not None:
            a[col:col + r] = ab[0]
            b[row:row + size, col:col + r] = ab[1]
            col += r
        row += size
    return (*_outputs(layer, a, b), ranks)


def _row_parts(layer: Linear, num_parts: int) -> torch.Tensor:
    """Each of the layer's output rows' part (0, 1, ...), in the order _fused leaves B's
    rows."""
    sizes = layer.full_sizes if num_parts > 1 else (sum(layer.full_sizes),)
    part = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    rows = _outputs(layer, torch.zeros(0, layer.full_in), part[:, None], scaled=False)[1]
    return rows[:, 0].int()


def _outputs(layer: Linear, a: torch.Tensor, b: torch.Tensor, scaled: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) as the layer's outputs are: the rank's part of a split layer, then what
    the loader did to them (a factor, unless not ``scaled``; rows reordered)."""
    if layer.shard is not None:
        b = layer.shard.take_rows(b, layer.full_sizes)
        if layer.shard.cols is not None:
            a = a[:, layer.shard.cols]
    if scaled:
        b = b * layer.output_factor
    if layer.output_rows is not None:
        rows = layer.output_rows
        b[:len(rows)] = b[rows].clone()
    return a.contiguous(), b.contiguous()
