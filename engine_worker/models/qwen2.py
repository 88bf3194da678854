"""Qwen2 and Qwen2.5 (q, k and v with biases; a sliding window in the layers from
max_window_layers on, where use_sliding_window says), and Qwen2-MoE (Qwen1.5-MoE,
Qwen2-57B-A14B: mixtures of experts beside a shared expert gated by a sigmoid)."""

from __future__ import annotations

from typing import Any, Callable

from common.gguf_reader import GgufReader
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config, mixture_fields)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.spec import Architecture, GgufSpec

QWEN_WINDOWS = SlidingWindows(from_max_window_layers=True)


def read_qwen2(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, qkv_bias=True, windows=QWEN_WINDOWS)


def read_qwen2_moe(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, qkv_bias=True, windows=QWEN_WINDOWS,
                          **mixture_fields(source.raw, every_layer=False, shared_expert=True))


def expert_sizes(arch: str, norm_topk: bool
                 ) -> Callable[[dict[str, Any], GgufReader], dict[str, Any]]:
    """What transformers' reading of a qwen2moe or qwen3moe file leaves out: the
    experts' width (and Qwen2-MoE's shared expert's), and whether llama.cpp renormalizes
    the chosen experts' weights: Qwen3-MoE's, as its own configs say; not Qwen2-MoE's
    (Qwen1.5-MoE's config)."""
    def read(raw: dict[str, Any], reader: GgufReader) -> dict[str, Any]:
        fields = reader.fields
        raw = {**raw, "norm_topk_prob": norm_topk, "moe_intermediate_size": fields.get(
            f"{arch}.expert_feed_forward_length", raw.get("moe_intermediate_size"))}
        if arch == "qwen2moe":
            raw["shared_expert_intermediate_size"] = fields.get(
                "qwen2moe.expert_shared_feed_forward_length",
                raw.get("shared_expert_intermediate_size"))
        return raw
    return read


ARCHITECTURES = (
    Architecture("Qwen2ForCausalLM", read_qwen2, DecoderModel, "Qwen2, Qwen2.5",
                 gguf=GgufSpec("qwen2")),
    Architecture("Qwen2MoeForCausalLM", read_qwen2_moe, DecoderModel,
                 "Qwen1.5-MoE, Qwen2-57B-A14B",
                 gguf=GgufSpec("qwen2moe", read=expert_sizes("qwen2moe", norm_topk=False))),
)
