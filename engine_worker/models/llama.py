"""The Llama family: Llama 2 and 3 (3.1-3.3's RoPE scaling), SmolLM2, Mistral (a
sliding window in every layer; and the language model of Mistral Small 3's
multimodal checkpoints), SmolLM3 (RoPE left out of every fourth layer).

Pre-norm decoder layers (models/layers/decoder.py): RMSNorm, RoPE, grouped-query
attention, a SwiGLU MLP. llama.cpp's files of the llama architecture hold Llama,
Mistral and SmolLM alike, their q and k rows permuted for llama.cpp's RoPE."""

from __future__ import annotations

from typing import Any

from common.errors import ModelLoadError
from common.gguf_reader import unpermute_rows
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.spec import Architecture, GgufSpec, LanguageModel


def read_llama(source: ConfigSource) -> ModelConfig:
    return decoder_config(source)


def read_mistral(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, windows=SlidingWindows(default_on=True, every_layer=True))


def read_smollm3(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, nope_layers=_nope_layers(source.raw))


def _nope_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: no_rope_layers holds 1 for a layer with it, 0
    without; absent, every no_rope_layer_interval-th layer (4) is without."""
    layers = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or set(flags) - {0, 1}:
        raise ModelLoadError(f"no_rope_layers must be {layers} flags of 0 or 1, one a layer")
    return tuple(i for i, flag in enumerate(flags) if not flag)


def unpermuted_qk(cfg: ModelConfig) -> list:
    """llama.cpp's converter stores the llama architecture's q and k rows permuted for
    its RoPE (pairs of rotated dimensions interleaved): the order that puts them back
    in Hugging Face's (halves), per tensor (v as it is)."""
    return [unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads),
            unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads), None]


def is_llama_without_experts(fields: dict[str, Any]) -> bool:
    return not fields.get("llama.expert_count")


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", read_llama, DecoderModel,
                 "Llama 2, Llama 3 and 3.1-3.3, SmolLM2",
                 gguf=GgufSpec("llama", qkv_orders=unpermuted_qk,
                               matches=is_llama_without_experts)),
    Architecture("MistralForCausalLM", read_mistral, DecoderModel,
                 "Mistral (7B v0.1: a sliding window in every layer), Mistral Small 3"),
    Architecture("SmolLM3ForCausalLM", read_smollm3, DecoderModel,
                 "SmolLM3 (no RoPE in every fourth layer)"),
)

LANGUAGE_MODELS = (
    LanguageModel("Mistral3ForConditionalGeneration", "MistralForCausalLM", "MistralConfig"),
)

