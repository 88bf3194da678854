"""Granite (IBM's Granite 3): a Llama that scales the embeddings, the attention scores,
each layer's outputs and the logits by constants of its config. The loader folds
them into the weights (DecoderModel.finish_layer, fold_scales) but the scores' scale,
the attention kernels' own, so every kernel computes a plain Llama."""

from __future__ import annotations

from engine_worker.models.config import (ConfigSource, ModelConfig, decoder_config,
                                         positive_numbers)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.spec import Architecture


def read_granite(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, **positive_numbers(source.raw, {
        "embedding_multiplier": 1.0, "attention_multiplier": 1.0,
        "residual_multiplier": 1.0, "logits_scaling": 1.0}))


ARCHITECTURES = (
    Architecture("GraniteForCausalLM", read_granite, DecoderModel, "Granite 3"),
)
