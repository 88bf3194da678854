"""gpt-oss: a learned sink logit per head (attention a query may pay to nothing), a
sliding window in every other layer, and every MLP a mixture of experts whose router
and experts have biases, the router's softmax over the k chosen logits, each expert's
gate a clamped SwiGLU. Its checkpoints stack a layer's experts in one tensor a
projection (gate and up interleaved), in bfloat16 or MXFP4 (the published ones), kept
MXFP4 where the platform can (the CPU kernels' MXFP4 panels; the GPU's grouped
experts)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from common.errors import ModelLoadError
from common.gguf_reader import GgufReader
from engine_worker.models.checkpoint import Checkpoint, mxfp4_to_float
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config, mixture_fields, positive_numbers)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.spec import Architecture, GgufSpec


def read_gpt_oss(source: ConfigSource) -> ModelConfig:
    """Its fields beyond a mixture's: every MLP a mixture (its intermediate_size is the
    experts'), the sinks, the biases, the clamped SwiGLU; its experts as the published
    checkpoints hold them (MXFP4) or dequantized (bfloat16)."""
    raw = source.raw
    quant = raw.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ModelLoadError(f"gpt-oss checkpoints are served dequantized or in MXFP4, not "
                             f"{quant.get('quant_method')!r}")
    return decoder_config(
        source, windows=SlidingWindows(default_on=True, pattern=2),
        **mixture_fields(raw, every_layer=True), intermediate_size=0, attn_sinks=True,
        expert_bias=True, expert_format="mxfp4" if quant else "",
        **positive_numbers(raw, {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}))


def load_experts(moe: nn.Module, ckpt: Checkpoint, p: str, cfg: ModelConfig) -> None:
    """A layer's router (weight and bias) and experts, each projection one tensor of
    all of a layer's experts with its biases: as transformers holds them, (E, C, 2 I)
    and (E, I, C), or as the published checkpoints do, MXFP4 blocks and scales of (E,
    2 I, C) and (E, C, I). gate_up's columns interleave gate and up; ours holds gate's
    rows, then up's."""
    c, i_size, e = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    moe.gate.weight.copy_(ckpt.take(p + ".router.weight", (e, c)))
    moe.gate.bias.copy_(ckpt.take(p + ".router.bias", (e,)))
    p += ".experts."
    if moe.grouped is not None:   # MXFP4 kept
        _load_mxfp4_experts(ckpt, p, moe.grouped, (e, c, i_size))
        return
    gate_up = _stacked(ckpt, p + "gate_up_proj", (e, 2 * i_size, c))
    down = _stacked(ckpt, p + "down_proj", (e, c, i_size))
    gate_up_bias = ckpt.take(p + "gate_up_proj_bias", (e, 2 * i_size))
    down_bias = ckpt.take(p + "down_proj_bias", (e, c))
    for k, expert in enumerate(moe.experts):
        w = gate_up(k)
        expert.gate_up_proj.weight.copy_(torch.cat([w[0::2], w[1::2]]))
        expert.gate_up_proj.bias.copy_(torch.cat([gate_up_bias[k, 0::2],
                                                  gate_up_bias[k, 1::2]]))
        expert.down_proj.weight.copy_(down(k))
        expert.down_proj.bias.copy_(down_bias[k])


def _load_mxfp4_experts(ckpt: Checkpoint, p: str, grouped: nn.Module,
                        sizes: tuple[int, int, int]) -> None:
    """A checkpoint's MXFP4 experts into the grouped experts' bytes and scales as they
    are (gate_up's rows, interleaved gate and up, put gate's first), and their
    biases."""
    e, c, i = sizes

    def halves(t: torch.Tensor) -> torch.Tensor:   # interleaved rows: gate's, then up's
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)

    for name, rows, cols, order in (("gate_up_proj", 2 * i, c, halves),
                                    ("down_proj", c, i, lambda t: t)):
        blocks = ckpt.take(p + name + "_blocks", (e, rows, cols // 32, 16))
        scales = ckpt.take(p + name + "_scales", (e, rows, cols // 32))
        mine = name.removesuffix("_proj")
        getattr(grouped, mine).copy_(order(blocks).reshape(e, rows, cols // 2))
        getattr(grouped, mine + "_scales").copy_(order(scales))
        getattr(grouped, mine + "_bias").copy_(order(ckpt.take(p + name + "_bias", (e, rows))))


def _stacked(ckpt: Checkpoint, name: str, shape: tuple[int, int, int]
             ) -> Callable[[int], torch.Tensor]:
    """A stacked projection of experts: expert k's weight, (out, in) as a linear
    layer's, for each k: MXFP4 blocks and scales dequantized an expert at a time, or a
    tensor stored (E, in, out) transposed."""
    e, rows, cols = shape
    if name + "_blocks" not in ckpt:
        stored = ckpt.take(name, (e, cols, rows))
        return lambda k: stored[k].T
    blocks = ckpt.take(name + "_blocks", (e, rows, cols // 32, 16))
    scales = ckpt.take(name + "_scales", (e, rows, cols // 32))
    return lambda k: mxfp4_to_float(blocks[k], scales[k])


def read_gguf(raw: dict[str, Any], reader: GgufReader) -> dict[str, Any]:
    """What transformers' reading of a gpt-oss file misses: the sliding window (under
    attention.), the experts' width where the file gives it apart, and YaRN's ramp
    unrounded, as gpt-oss's own config has it (truncate false; a file cannot say)."""
    fields, raw = reader.fields, dict(raw)
    window = fields.get("gpt-oss.attention.sliding_window")
    if window:
        raw["sliding_window"] = window
    raw["intermediate_size"] = fields.get("gpt-oss.expert_feed_forward_length",
                                          raw["intermediate_size"])
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        raw["rope_parameters"] = {**rope, "truncate": False}
    return raw


ARCHITECTURES = (
    Architecture(
        "GptOssForCausalLM", read_gpt_oss, DecoderModel, "gpt-oss-20b, gpt-oss-120b",
        loaders={"layers.*.mlp": load_experts},
        # (its norm before the MLP has the name Gemma's after the attention has)
        gguf=GgufSpec("gpt-oss", read=read_gguf,
                      names={"layers.*.post_attention_layernorm": "blk.*.post_attention_norm"})),
)
