"""Mixtral: every layer's MLP a mixture of experts (each a SwiGLU MLP as wide as a
dense one would be), the chosen experts' weights renormalized; a sliding window in
every layer where the config gives one. Its checkpoints keep the mixture under
block_sparse_moe and name each expert's projections w1 (gate), w3 (up) and w2 (down);
llama.cpp stores it as the llama architecture with experts."""

from __future__ import annotations

from typing import Any

from common.gguf_reader import GgufReader
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config, mixture_fields)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.llama import unpermuted_qk
from engine_worker.models.spec import Architecture, GgufSpec


def read_mixtral(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, windows=SlidingWindows(default_on=True, every_layer=True),
                          **mixture_fields(source.raw, every_layer=True))


def read_gguf(raw: dict[str, Any], reader: GgufReader) -> dict[str, Any]:
    """transformers reads a llama file with experts as a Llama, keeping none of them."""
    fields = reader.fields
    return {**raw, "num_local_experts": fields["llama.expert_count"],
            "num_experts_per_tok": fields["llama.expert_used_count"]}


def has_experts(fields: dict[str, Any]) -> bool:
    return bool(fields.get("llama.expert_count"))


ARCHITECTURES = (
    Architecture(
        "MixtralForCausalLM", read_mixtral, DecoderModel, "Mixtral 8x7B, 8x22B",
        names={"layers.*.mlp": "layers.*.block_sparse_moe",
               "layers.*.mlp.experts.*.gate_up_proj": (
                   "layers.*.block_sparse_moe.experts.*.w1",
                   "layers.*.block_sparse_moe.experts.*.w3"),
               "layers.*.mlp.experts.*.down_proj": "layers.*.block_sparse_moe.experts.*.w2"},
        gguf=GgufSpec("llama", read=read_gguf, qkv_orders=unpermuted_qk, matches=has_experts)),
)
