"""The engine's own model implementations, and building one from a checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from common.errors import ModelLoadError
from engine_worker.attention import AttentionBackend
from engine_worker.models.gguf import gguf_file, load_gguf
from engine_worker.cpu.kernels import CpuKernels
from engine_worker.models.config import ModelConfig
from engine_worker.models.gpt2 import GPT2Model
from engine_worker.models.llama import LlamaModel, MoE, Ops
from engine_worker.models.checkpoint import Checkpoint

Model = Union[LlamaModel, GPT2Model]


def load_model(cfg: ModelConfig, model_dir: Path, device: torch.device,
               dtype: torch.dtype, attn: AttentionBackend, ops: Ops,
               kernels: Optional[CpuKernels] = None, weight_format: str = "float32",
               load_format: str = "auto", seed: int = 0) -> Model:
    """Build the model for ``cfg`` on ``device`` and copy the checkpoint in (or, with
    load_format "dummy", fill it with random weights made on the device). ``ops``:
    the Llama family's elementwise ops. With ``kernels`` (CPU float32 only), every
    linear layer (lm_head included) computes from a weight packed in
    ``weight_format``."""
    # Built on the meta device, then given uninitialized memory: random init of
    # weights that are overwritten next would be wasted work.
    with torch.device("meta"):
        if cfg.family == "llama":
            model: Model = LlamaModel(cfg, attn, ops)
        else:
            model = GPT2Model(cfg, attn)
    _to_empty(model, device, dtype)
    gguf_path = gguf_file(model_dir) if load_format != "dummy" else None
    if gguf_path is not None:
        if kernels is None or cfg.family != "llama":
            raise ModelLoadError("a GGUF file is served by the CPU C kernels, for the llama "
                                 "family (--device cpu, float32, a C compiler)")
        load_gguf(model, gguf_path, kernels)
        return model.eval()
    if load_format == "dummy":
        dummy_weights(model, seed)
    else:
        prefix = cfg.checkpoint_prefixes if cfg.family == "llama" else ("transformer.",)
        ckpt = Checkpoint(model_dir, strip_prefixes=prefix, skip_prefixes=cfg.checkpoint_skips)
        # On the CPU each layer is packed as soon as it is read: its float32 weights are
        # freed then, so a mixture of 30B parameters never stands whole in float32
        # (untouched, the rest of the model's empty tensors take no memory)
        pack = None if kernels is None else functools.partial(
            _pack_linears, kernels=kernels, fmt=weight_format)
        with torch.no_grad():
            model.load_weights(ckpt, on_layer=pack)
        ckpt.finish()
    if kernels is not None:
        _pack_linears(model, kernels, weight_format)  # an untied lm_head is one of them
        if model.lm_head is None:  # tied: pack a copy, the embedding keeps its own
            model.lm_head = PackedLinear(kernels, model.tied_lm_head_weight(), None,
                                         weight_format)
    return model.eval()


def _to_empty(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every parameter and buffer of a model built on the meta device made an
    uninitialized tensor of its shape on ``device``, in ``dtype`` if it is floating
    point. (nn.Module.to_empty does this through torch's Python reference ops, whose
    first use imports sympy and torch.fx: 0.43 s of every engine start.)"""
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None:
                    continue
                empty = torch.empty(t.shape, device=device,
                                    dtype=dtype if t.is_floating_point() else t.dtype)
                tensors[name] = nn.Parameter(empty, requires_grad=False) \
                    if isinstance(t, nn.Parameter) else empty


@torch.no_grad()
def dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place, made on the model's device from ``seed``: normal with
    std 0.02 (Hugging Face's initializer range), norm scales 1, biases 0. For
    benchmarks: the numbers flow like a real model's, the tokens mean nothing."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype == torch.uint8:   # MXFP4 experts: random codes, scales near 2^-6
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


class PackedLinear(nn.Module):
    """A linear layer computing from a packed copy of its weight (CPU, float32; see
    engine_worker/cpu/csrc/gemm.c). The packed copy replaces the weight."""

    def __init__(self, kernels: CpuKernels, weight: torch.Tensor,
                 bias: Optional[torch.Tensor], fmt: str = "float32") -> None:
        super().__init__()
        self.kernels = kernels
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", kernels.pack(weight, fmt), persistent=False)
        self.bias = bias

    @classmethod
    def from_packed(cls, kernels: CpuKernels, packed: torch.Tensor, fmt: str,
                    out_features: int, in_features: int) -> "PackedLinear":
        """One over a weight packed already (engine_worker/models/gguf.py: a file's blocks)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kernels, layer.fmt, layer.bias = kernels, fmt, None
        layer.out_features, layer.in_features = out_features, in_features
        layer.register_buffer("packed", packed, persistent=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x.reshape(-1, self.in_features), self.packed,
                                self.out_features, self.bias, self.fmt)
        return y.view(*x.shape[:-1], self.out_features)


def _pack_linears(module: nn.Module, kernels: CpuKernels, fmt: str) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            # a mixture's router stays float32 (as vLLM's and llama.cpp's files keep it):
            # a rounded score can send a token to another expert
            router = isinstance(module, MoE) and name in ("gate", "shared_expert_gate")
            setattr(module, name, PackedLinear(kernels, child.weight, child.bias,
                                               "float32" if router else fmt))
        elif isinstance(module, MoE) and name == "experts" and module.expert_format == "mxfp4":
            # gpt-oss's MXFP4 experts stay MXFP4 in any format: their values exactly, in
            # 5 bits a weight (float32 takes 32, int8 9 and rounds them)
            _pack_linears(child, kernels, "mxfp4")
        else:
            _pack_linears(child, kernels, fmt)
