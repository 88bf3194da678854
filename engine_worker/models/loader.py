"""Building a model: its architecture's class on the meta device, given memory, and
its weights from a checkpoint (safetensors), a GGUF file (models/gguf.py) or made up
(--load-format dummy).

A checkpoint is read a block at a time (``load_checkpoint``): every module's tensors by
the architecture's names (models/names.py), the block's checkpoint fix-ups
(``finish_layer``: Gemma's 1 + weight norms, Granite's residual scale, a partial
RoPE's row order), then its linear layers finished (packed, on the CPU), so that no
more than a block's dense weights stand at once: a 30B mixture's would take 120 GB in
float32 (untouched, the rest of the model's empty tensors take no memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from common.errors import ModelLoadError
from engine_worker.models import registry
from engine_worker.models.checkpoint import Checkpoint
from engine_worker.models.config import ModelConfig
from engine_worker.models.gguf import load_gguf
from engine_worker.models.layers import Backends
from engine_worker.models.layers.attention import Attention
from engine_worker.models.layers.fp8 import quantize_rows
from engine_worker.models.layers.linear import DenseMethod, Linear, finish_linears
from engine_worker.models.names import SPLIT, TensorNames
from engine_worker.models.spec import Architecture
from engine_worker.ops import FP8


def load_model(cfg: ModelConfig, model_dir: Path, backends: Backends, device: torch.device,
               dtype: torch.dtype, gguf_path: Optional[Path] = None, load_format: str = "auto",
               seed: int = 0) -> nn.Module:
    """The model of ``cfg`` on ``device``, its floating-point tensors in ``dtype``, its
    weights read from ``model_dir``'s checkpoint, or from ``gguf_path`` where the folder
    stands for a GGUF file (load_format "dummy": random ones, made on the device)."""
    arch = registry.architecture(cfg.architecture)
    if backends.parallel.size > 1:
        _check_splits(arch)
    # Built on the meta device, then given uninitialized memory: random init of
    # weights that are overwritten next would be wasted work.
    with torch.device("meta"):
        model = arch.model(cfg, backends)
    _to_empty(model, device, dtype)
    with torch.no_grad():
        if gguf_path is not None:
            load_gguf(model, gguf_path, arch, backends.formats)
        elif load_format == "dummy":
            dummy_weights(model, seed)
            finish_linears(model)
            tie_lm_head(model)
        else:
            ckpt = Checkpoint(model_dir, strip_prefixes=cfg.checkpoint_prefixes,
                              skip_prefixes=cfg.checkpoint_skips)
            load_checkpoint(model, ckpt, arch, dtype)
            ckpt.finish()
    return model.eval()


def _check_splits(arch: Architecture) -> None:
    """Whether this model can be split over tensor-parallel ranks (ModelLoadError)."""
    if not getattr(arch.model, "splits", False) or arch.loaders:
        raise ModelLoadError(f"{arch.name} is not split over tensor-parallel ranks yet")


def load_checkpoint(model: nn.Module, ckpt: Checkpoint, arch: Architecture,
                    dtype: Optional[torch.dtype] = None) -> None:
    """Every weight of ``model`` from ``ckpt``, a block at a time (the module
    docstring). dtype: the model's, which an fp8 checkpoint's layers left unquantized
    keep (its ignore list, FBGEMM's modules_to_not_convert)."""
    family, plain = TensorNames(arch.names, SPLIT), TensorNames({}, SPLIT)
    dense = dtype if model.cfg.weight_format == "fp8" else None

    def names(path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The family's names, or Hugging Face's Llama-style ones where the checkpoint
        has those instead (Mixtral's experts under mlp., say)."""
        found = family(path)
        if _has(ckpt, found[0]):
            return found
        other = plain(path)
        return other if _has(ckpt, other[0]) else found

    loaders = arch.loaders
    transposed = set(arch.transposed)

    def load(path: str, module: nn.Module) -> None:
        family_loader = loaders.get(_wildcard(path))
        if family_loader is not None:
            family_loader(module, ckpt, names(path)[0][0], model.cfg)
        elif isinstance(module, Linear):
            _load_linear(module, names(path)[0], ckpt, _wildcard(path) in transposed, dense)
        else:
            # (a tensor split over ranks: the module's ``shards``, name -> (its whole
            # shape, the rank's rows); the embeddings' vocabulary, the sinks' heads)
            shards = getattr(module, "shards", {})
            for name, param in module.named_parameters(recurse=False):
                shape, rows = shards.get(name, (tuple(param.shape), slice(None)))
                param.copy_(ckpt.take(names(f"{path}.{name}")[0][0], shape)[rows])
            for name, child in module.named_children():
                load(f"{path}.{name}", child)

    for name, child in model.named_children():
        if name != model.blocks:
            load(name, child)
            continue
        for i, block in enumerate(child):
            load(f"{name}.{i}", block)
            _take_kv_scales(ckpt, block, lambda sub: names(f"{name}.{i}.{sub}")[0][0])
            model.finish_layer(block)
            finish_linears(block)
    if model.cfg.tie_word_embeddings:
        ckpt.discard("lm_head.weight")  # tied; some checkpoints store the copy anyway
    ckpt.discard_suffixes(arch.unused)
    model.finish_checkpoint()
    finish_linears(model)   # the lm_head (untied)
    tie_lm_head(model)


def _load_linear(linear: Linear, parts: tuple[str, ...], ckpt: Checkpoint,
                 transposed: bool, dense: Optional[torch.dtype] = None) -> None:
    """A linear layer's weight (and bias) from its tensors: one for the layer, or one
    for each part of a fused one, stacked; (in, out) where ``transposed``. ``dense``:
    an fp8 checkpoint's model dtype, which a layer it left unquantized keeps."""
    if linear.weight is None:   # a tied lm_head
        return
    # (the whole layer's: one split over ranks takes its part, Linear.load)
    sizes = (sum(linear.full_sizes),) if len(parts) == 1 else linear.full_sizes
    if len(parts) != len(sizes):
        raise ModelLoadError(f"{parts} are not the {len(sizes)} parts of a layer")
    inputs = linear.full_in
    weights = [ckpt.take(f"{p}.weight", (inputs, rows) if transposed else (rows, inputs))
               for p, rows in zip(parts, sizes)]
    weights = [w.t() if transposed else w for w in weights]
    scales = [_fp8_scale(ckpt, p, w) for p, w in zip(parts, weights)]
    if all(s is None for s in scales):
        if dense is not None and linear.fmt == "fp8":
            linear.keep_dense(DenseMethod(dense))
        linear.load(torch.cat(weights))
    else:   # an fp8 checkpoint's (a part in another dtype: quantized as it loads)
        quantized = [(w, s) if s is not None else quantize_rows(w)
                     for w, s in zip(weights, scales)]
        linear.load(torch.cat([w for w, _ in quantized]),
                    torch.cat([s.reshape(-1) for _, s in quantized]))
    if linear.bias is not None:
        linear.load_bias(torch.cat([ckpt.take(f"{p}.bias", (rows,))
                                    for p, rows in zip(parts, sizes)]))


def _fp8_scale(ckpt: Checkpoint, part: str, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """An fp8 weight's scales, a row's each (float32): its checkpoint's per-channel
    ones, or its one per-tensor scale repeated; None for a weight in another dtype."""
    if weight.dtype != FP8:
        return None
    name = f"{part}.weight_scale"
    if name not in ckpt:
        raise ModelLoadError(f"{part}.weight is fp8 but the checkpoint has no {name}")
    scale = ckpt.take(name).float().reshape(-1)
    if scale.numel() not in (1, weight.shape[0]):
        raise ModelLoadError(f"{name} has {scale.numel()} values; an fp8 weight of "
                             f"{weight.shape[0]} rows takes one per row or one in all")
    for other in ("input_scale", "input_scale_ub"):   # (activations are scaled per token)
        ckpt.discard(f"{part}.{other}")
    return scale.expand(weight.shape[0])


def _take_kv_scales(ckpt: Checkpoint, block: nn.Module, where: Callable[[str], str]) -> None:
    """A block's fp8 KV cache scales, where the checkpoint has them (compressed-tensors'
    kv_cache_scheme: the attention's k_scale and v_scale, or its k and v projections'
    output_scale; one per head taken as their largest), kept for an fp8 cache
    (engine_worker/kv_scales.py). ``where``: a module's checkpoint name."""
    for path, module in block.named_modules():
        if not isinstance(module, Attention):
            continue
        p = where(path)
        for k, v in ((f"{p}.k_scale", f"{p}.v_scale"),
                     (f"{p}.k_proj.output_scale", f"{p}.v_proj.output_scale")):
            if k in ckpt and v in ckpt:
                module.checkpoint_kv_scale = torch.stack(
                    [ckpt.take(k).float().amax(), ckpt.take(v).float().amax()])


def tie_lm_head(model: nn.Module) -> None:
    """A tied lm_head computes with the embeddings (as finished: Gemma's scaled)."""
    if model.lm_head.weight is None and not hasattr(model.lm_head, "packed"):
        model.lm_head.tie(model.embeddings.weight)


def _has(ckpt: Checkpoint, names: tuple[str, ...]) -> bool:
    """Whether the checkpoint holds the tensor ``names[0]`` or its weight."""
    return names[0] in ckpt or f"{names[0]}.weight" in ckpt


def _wildcard(path: str) -> str:
    return ".".join("*" if p.isdigit() else p for p in path.split("."))


def _to_empty(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every parameter and buffer of a model built on the meta device made an
    uninitialized tensor of its shape on ``device``, in ``dtype`` if it was made in
    torch's default (float32; a weight made in its format's dtype keeps that: fp8).
    (nn.Module.to_empty does this through torch's Python reference ops, whose first use
    imports sympy and torch.fx: 0.43 s of every engine start.)"""
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None:
                    continue
                empty = torch.empty(t.shape, device=device,
                                    dtype=dtype if t.dtype == torch.float32 else t.dtype)
                tensors[name] = nn.Parameter(empty, requires_grad=False) \
                    if isinstance(t, nn.Parameter) else empty


def _whole(module: nn.Module, leaf: str, param: torch.Tensor
           ) -> tuple[tuple[int, ...], Callable[[torch.Tensor], None]]:
    """The whole shape of a parameter (split over ranks, or an fp8 weight), and what
    takes its part of a whole tensor."""
    if isinstance(module, Linear) and leaf == "weight":
        return (sum(module.full_sizes), module.full_in), module.load
    shape, rows = module.shards[leaf]
    return shape, lambda t: param.copy_(t[rows])


def dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place, made on the model's device from ``seed``: normal with
    std 0.02 (Hugging Face's initializer range), norm scales 1, biases 0. For
    benchmarks: the numbers flow like a real model's, the tokens mean nothing. An fp8
    layer quantizes its own (Linear.load). A model split over tensor-parallel ranks
    draws each whole tensor and takes its part: the same model as one not split."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        if param.dtype == FP8 or leaf in getattr(module, "shards", {}) or (
                isinstance(module, Linear) and module.shard is not None and leaf == "weight"):
            shape, put = _whole(module, leaf, param)
            put(torch.empty(shape, dtype=torch.float32 if param.dtype == FP8 else param.dtype,
                            device=param.device).normal_(0.0, 0.02, generator=generator))
        elif param.dtype == torch.uint8:   # MXFP4 experts: random codes, scales near 2^-6
            if name.endswith("scales"):
                param.fill_(121)
            else:
                param.random_(0, 256, generator=generator)
        elif name.endswith("bias"):
            param.zero_()
        elif "norm" in name or "ln_" in name:  # RMSNorm / LayerNorm scales
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)

