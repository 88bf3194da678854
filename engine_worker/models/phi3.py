"""Phi-3, Phi-3.5 and Phi-4-mini: a Llama whose checkpoints store q/k/v and gate/up
fused, one tensor each; a sliding window in every layer where the config gives one
(Phi-3-mini-4k); LongRoPE (the 128k models, Phi-3.5, Phi-4-mini: models/rope.py),
over 3/4 of each head in Phi-4-mini."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from common.gguf_reader import GgufReader
from engine_worker.models.config import (ConfigSource, ModelConfig, SlidingWindows,
                                         decoder_config)
from engine_worker.models.layers.decoder import DecoderModel
from engine_worker.models.layers.rotary import partial_rotary_order
from engine_worker.models.spec import Architecture, GgufSpec


def read_phi3(source: ConfigSource) -> ModelConfig:
    return decoder_config(source, windows=SlidingWindows(default_on=True, every_layer=True))


def read_gguf(raw: dict[str, Any], reader: GgufReader) -> dict[str, Any]:
    """What a phi3 file holds that transformers' reading leaves out: the share of each
    head RoPE turns (Phi-4-mini's 3/4: rope.dimension_count), the sliding window
    (Phi-3-mini-4k's) and LongRoPE (the 128k models, Phi-3.5, Phi-4-mini): its long
    and short factors, tensors of their own, with the original context and the
    attention factor."""
    fields, raw = reader.fields, dict(raw)
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    turned = fields.get("phi3.rope.dimension_count", head_dim)
    if turned != head_dim:
        raw["partial_rotary_factor"] = turned / head_dim
        raw["rope_parameters"] = {**(raw.get("rope_parameters") or {}),
                                  "partial_rotary_factor": turned / head_dim}
    raw["sliding_window"] = fields.get("phi3.attention.sliding_window") or None
    factors = {t.name: np.array(t.data).view(np.float32).reshape(-1).tolist()
               for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:
        longrope = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                    "short_factor": factors["rope_factors_short.weight"]}
        for key, name in (("original_context_length", "original_max_position_embeddings"),
                          ("attn_factor", "attention_factor")):
            if f"phi3.rope.scaling.{key}" in fields:
                longrope[name] = fields[f"phi3.rope.scaling.{key}"]
        raw["rope_parameters"] = {**(raw.get("rope_parameters") or {}), **longrope}
    return raw


def partial_rotary_rows(cfg: ModelConfig) -> Optional[list]:
    """Where RoPE turns part of each head (Phi-4-mini), the fused attn_qkv's q and k
    rows reordered as a checkpoint's are (rotary.py), v's as they are."""
    if cfg.rotary_dim is None:
        return None
    rows = partial_rotary_order(cfg)[0].numpy()
    total = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [np.concatenate([rows, np.arange(len(rows), total)])]


ARCHITECTURES = (
    Architecture(
        "Phi3ForCausalLM", read_phi3, DecoderModel, "Phi-3, Phi-3.5, Phi-4-mini",
        # stored fused, as we hold them
        names={"layers.*.self_attn.qkv_proj": "layers.*.self_attn.qkv_proj",
               "layers.*.mlp.gate_up_proj": "layers.*.mlp.gate_up_proj"},
        gguf=GgufSpec("phi3", names={"layers.*.self_attn.qkv_proj": "blk.*.attn_qkv",
                                     "layers.*.mlp.gate_up_proj": "blk.*.ffn_up"},
                      read=read_gguf, qkv_orders=partial_rotary_rows)),
)
