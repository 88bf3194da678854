"""Qwen3 (each head of q and k RMS-normed before RoPE) and Qwen3-MoE (Qwen3-30B-A3B,
Qwen3-235B-A22B: mixtures of experts in the layers the config names)."""

from __future__ import annotations

from engine_worker.models.config import ConfigSource, ModelConfig, decoder_config, mixture_fields
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.qwen2 import QWEN_WINDOWS, expert_sizes
from engine_worker.models.spec import Architecture, GgufSpec


def read_qwen3(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, qk_norm=True, windows=QWEN_WINDOWS)


def read_qwen3_moe(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, qk_norm=True, windows=QWEN_WINDOWS,
                          **mixture_fields(source.raw, every_layer=False))


ARCHITECTURES = (
    Architecture("Qwen3ForCausalLM", read_qwen3, DecoderModel, "Qwen3",
                 gguf=GgufSpec("qwen3")),
    Architecture("Qwen3MoeForCausalLM", read_qwen3_moe, DecoderModel,
                 "Qwen3-30B-A3B, Qwen3-235B-A22B",
                 gguf=GgufSpec("qwen3moe", read=expert_sizes("qwen3moe", norm_topk=True))),
)
