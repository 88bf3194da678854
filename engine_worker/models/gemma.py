"""Gemma 2 and Gemma 3 (and the language model of Gemma 3's multimodal checkpoints):
GELU gates (tanh form); RMSNorms that scale by 1 + weight; the attention's and the
MLP's outputs normed before they join the residual stream; the embeddings scaled by
sqrt(hidden_size) and the scores by query_pre_attn_scalar^-1/2; sliding layers (every
other one of Gemma 2's, five of six of Gemma 3's); Gemma 2's soft-capped scores and
logits; Gemma 3's q and k normed per head and its sliding layers' RoPE of their own."""

from __future__ import annotations

import math
from typing import Any, Callable

from common.errors import ModelLoadError
from common.gguf_reader import GgufReader
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config, rotary_dims)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.rope import rope_config
from engine_worker.models.spec import Architecture, GgufSpec, LanguageModel

_SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def read_gemma2(source: ConfigSource) -> ModelConfig:
    raw = source.raw
    return decoder_config(
        source, windows=SlidingWindows(default_on=True, pattern=2), tie_word_embeddings=True,
        attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        **_scales(raw, gemma3=False))


def read_gemma3(source: ConfigSource) -> ModelConfig:
    """Its two RoPEs, the full layers' and the sliding ones' (rope_parameters keyed by
    layer type, or in older configs rope_theta and rope_scaling, and
    rope_local_base_freq)."""
    raw = source.raw
    scales = _scales(raw, gemma3=True)
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        full = {**raw, "rope_parameters": params["full_attention"], "rope_scaling": None}
        local = {**raw, "rope_parameters": params.get("sliding_attention") or {},
                 "rope_scaling": None}
    else:
        full = raw
        local = {"rope_parameters": {"rope_type": "default",
                                     "rope_theta": raw.get("rope_local_base_freq", 10000.0)},
                 "max_position_embeddings": raw["max_position_embeddings"]}
    rotary_dim = rotary_dims(raw, _head_dim(raw))
    return decoder_config(
        source, windows=SlidingWindows(default_on=True, pattern=6, keep_long=True),
        tie_word_embeddings=True, qk_norm=True,
        rope=rope_config(full, rotary_dim, source.served),
        rope_local=rope_config(local, rotary_dim, source.served), **scales)


def _head_dim(raw: dict[str, Any]) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def _scales(raw: dict[str, Any], gemma3: bool) -> dict[str, Any]:
    """The fields both Gemmas share: their norms and scales; the soft caps checked."""
    for name in _SOFT_CAPS:
        cap = raw.get(name)
        if cap is not None and gemma3:
            raise ModelLoadError(f"{name} is not supported for Gemma 3 (Gemma 2's)")
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ModelLoadError(f"{name} must be a positive number, not {cap!r}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (an embedding model) is not served")
    return {"norm_offset": True, "sandwich_norms": True,
            "embedding_multiplier": math.sqrt(raw["hidden_size"]),
            "attention_multiplier":
                float(raw.get("query_pre_attn_scalar", _head_dim(raw))) ** -0.5}


def gguf_reading(arch: str) -> Callable[[dict[str, Any], GgufReader], dict[str, Any]]:
    """What llama.cpp takes a gemma2 or gemma3 file to mean, which its metadata does not
    say: the scores scaled by head_dim^-1/2, but hidden_size / heads for the 27B models
    (Gemma 2's 46 layers, Gemma 3's 62); a sliding window where the file gives one (in
    every other layer of Gemma 2, five of six of Gemma 3, the sliding layers' RoPE base
    10,000: transformers' defaults), none where it does not; the soft caps the file
    gives (Gemma 2's; Gemma 3 has none, and one the file gives is refused, by name)."""
    big = {"gemma2": 46, "gemma3": 62}[arch]

    def read(raw: dict[str, Any], reader: GgufReader) -> dict[str, Any]:
        fields, raw = reader.fields, dict(raw)
        raw["query_pre_attn_scalar"] = (
            raw["hidden_size"] // raw["num_attention_heads"]
            if raw["num_hidden_layers"] == big else raw["head_dim"])
        if not fields.get(f"{arch}.attention.sliding_window"):
            raw["sliding_window"] = None
        for name in _SOFT_CAPS:
            if fields.get(f"{arch}.{name}"):
                raw[name] = fields[f"{arch}.{name}"]
        return raw
    return read


# Our norm before the MLP, and those of the attention's and the MLP's outputs, as
# Gemma's checkpoints name them
GEMMA_NAMES = {"layers.*.post_attention_layernorm": "layers.*.pre_feedforward_layernorm",
               "layers.*.attn_out_norm": "layers.*.post_attention_layernorm",
               "layers.*.mlp_out_norm": "layers.*.post_feedforward_layernorm"}

ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", read_gemma2, DecoderModel, "Gemma 2",
                 names=GEMMA_NAMES, gguf=GgufSpec("gemma2", read=gguf_reading("gemma2"))),
    Architecture("Gemma3ForCausalLM", read_gemma3, DecoderModel, "Gemma 3 (text)",
                 names=GEMMA_NAMES, gguf=GgufSpec("gemma3", read=gguf_reading("gemma3"))),
)

LANGUAGE_MODELS = (
    LanguageModel("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM", "Gemma3TextConfig"),
)
