"""What the engine needs to know about a model, read from its config.json.

``ModelConfig`` is what every architecture's reader (in its family's file; the
registry finds it: models/registry.py, load_model_config) makes of a config.json, and
the readers share what most configs have: ``decoder_config`` (sizes, RoPE, sliding
windows), ``mixture_fields`` (mixtures of experts).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional

from common.errors import ModelLoadError
from engine_worker.models.rope import RopeConfig, rope_config

@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # Context length: max_position_embeddings (YaRN's: the original times its factor)
    max_model_len: int
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    rope: Optional[RopeConfig]  # None for GPT-2 (learned positions)
    # Qwen3: each head of q and k RMS-normed (its own weight, head_dim wide) before RoPE
    qk_norm: bool = False
    # the leading dimensions of each head RoPE turns (Phi-4-mini: 3/4 of them); None:
    # all. The loader moves them so that the kernels' full-head RoPE turns exactly them
    # (layers/rotary.py).
    rotary_dim: Optional[int] = None
    # SmolLM3: the layers that apply no RoPE (every fourth), their keys and queries as
    # projected
    nope_layers: tuple[int, ...] = ()
    # Each layer's sliding window (keys a query sees, its own included; 0: all of
    # them), or () where every layer sees all (Mistral 7B v0.1, Phi-3-mini-4k: every
    # layer; Qwen2 with use_sliding_window: those from max_window_layers on)
    windows: tuple[int, ...] = ()
    # Gemma 3: RMSNorms scale by 1 + weight (the loader adds the 1); the attention's and
    # the MLP's outputs RMS-normed before they join the residual stream; the sliding
    # layers' own RoPE (None: every layer the model's)
    norm_offset: bool = False
    sandwich_norms: bool = False
    rope_local: Optional[RopeConfig] = None
    # Gemma 2: each attention score s becomes attn_softcap tanh(s / attn_softcap), and
    # each logit likewise with logit_softcap (0: none)
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # Where the checkpoint keeps the language model's tensors (prefixes stripped from
    # their names, in order) and what else it holds that is not read (a multimodal
    # checkpoint's vision tower)
    checkpoint_prefixes: tuple[str, ...] = ("model.",)
    checkpoint_skips: tuple[str, ...] = ()
    # Mixtures of experts (Mixtral, Qwen2/3-MoE): the layers whose MLP is num_experts
    # experts (each a SwiGLU MLP of expert_intermediate_size), experts_per_token of them
    # run for each token, weighted by the router's softmax over the chosen (norm_topk)
    # or over all; the other layers' MLP is dense
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk: bool = True
    # Qwen2-MoE: a shared expert (a SwiGLU MLP this wide) every token runs, its output
    # scaled by the sigmoid of a gate of its own; 0: none
    shared_expert_size: int = 0
    # gpt-oss: each head's learned sink, a logit every query's softmax also spreads
    # over and that adds no value (attention a query may pay to nothing)
    attn_sinks: bool = False
    # gpt-oss's mixtures: router and experts with biases; the router's softmax over the
    # k chosen logits; each expert's gate the clamped SwiGLU (clamp(up, -L, L) + 1) g
    # sigmoid(alpha g), g = min(gate, L), for swiglu_limit L > 0 (0: SiLU or GELU)
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # "mxfp4": the checkpoint's experts are MXFP4 blocks (gpt-oss's published ones),
    # which a GPU keeps as they are (engine_worker/gpu/moe.py) and so do the CPU kernels
    # (MXFP4 panels, gemm.c; the torch path dequantizes them)
    expert_format: str = ""
    # GPT-2: learned position embeddings (a row per position of the context) and an
    # MLP of two matrices, not a gated one of three (parameter and FLOP counts)
    learned_positions: bool = False
    # Granite's constants: the embeddings are multiplied by embedding_multiplier, the
    # attention scores scaled by attention_multiplier (None: 1/sqrt(head_dim); the
    # attention kernels' scale), each attention and MLP output by residual_multiplier
    # before it joins the residual stream, the logits divided by logits_scaling. The
    # loader folds the others into the weights (DecoderModel.fold_scales), so every
    # kernel computes a plain Llama.
    embedding_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Hugging Face's name of the architecture (its spec's, models/registry.py)
    architecture: str = ""
    # "fp8": the checkpoint's linear weights are fp8 with scales (models/quantization.py)
    weight_format: str = ""

    @property
    def attention_scale(self) -> float:
        """What every attention score q.k is multiplied by."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim ** -0.5

    @property
    def kv_signature(self) -> str:
        """What the keys this model caches depend on beyond its name: where a choice
        made at start changes them (LongRoPE's set of factors), that choice, so that
        engines that made different ones do not exchange KV blocks."""
        if self.rope is not None and self.rope.kind == "longrope":
            factors = ",".join(repr(f) for f in self.rope.ext_factors)
            return f"{self.name}|longrope={hashlib.sha256(factors.encode()).hexdigest()[:12]}"
        return self.name

    def _params(self, experts: int) -> int:
        """Parameters (tied embeddings once), counting ``experts`` of each mixture's
        experts (and its router)."""
        c, d = self.hidden_size, self.head_dim
        attn = c * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.learned_positions:   # GPT-2's, and its MLP of two matrices
            mlp = 2 * c * self.intermediate_size
            pos = self.max_model_len * c
        else:
            mlp = 3 * c * self.intermediate_size
            pos = 0
        moe = len(self.moe_layers) * (
            3 * c * self.expert_intermediate_size * experts + c * self.num_experts - mlp
            + (3 * c * self.shared_expert_size + c if self.shared_expert_size else 0))
        emb = self.vocab_size * c * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + moe + emb + pos

    @property
    def num_params(self) -> int:
        """Parameters, counting tied embeddings once."""
        return self._params(self.num_experts)

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs per generated token: 2 x (weights touched, lm_head included; of
        a mixture's experts, those a token runs)."""
        lm_head = self.vocab_size * self.hidden_size
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        pos = self.max_model_len * self.hidden_size if self.learned_positions else 0
        return 2 * (self._params(self.experts_per_token) - emb - pos + lm_head)


@dataclass(frozen=True)
class ConfigSource:
    """A config as a family's reader gets it: the dict, and what every model takes
    from beside it."""
    raw: dict[str, Any]
    # the model's name (its folder's)
    name: str
    eos_token_ids: tuple[int, ...]
    # the context to serve, where the user caps it (LongRoPE picks its factors by it)
    served: Optional[int] = None


@dataclass(frozen=True)
class SlidingWindows:
    """How a family's config says which layers slide (as transformers reads it)."""
    # whether sliding_window applies without use_sliding_window saying so
    default_on: bool = False
    # every layer slides, whatever layer_types says (Mistral, Mixtral, Phi-3)
    every_layer: bool = False
    # without layer_types: every pattern-th layer is full, the others slide (Gemma,
    # gpt-oss; sliding_window_pattern in the config, else this)
    pattern: int = 0
    # without layer_types: the layers from max_window_layers on slide (Qwen)
    from_max_window_layers: bool = False
    # a window as long as the context is kept (Gemma 3's sliding layers have a RoPE
    # of their own); otherwise it is full attention
    keep_long: bool = False


def decoder_config(source: ConfigSource, *,
                   windows: SlidingWindows = SlidingWindows(), qkv_bias: bool = False,
                   tie_word_embeddings: bool = False, rope: Optional[RopeConfig] = None,
                   **fields: Any) -> ModelConfig:
    """The fields of a decoder's config most families share (Llama's names), and a
    family's own (``fields``). qkv_bias: q, k and v have biases whatever the config
    says (Qwen2's); tie_word_embeddings: the default where the config gives none;
    rope: the model's RoPE where the family reads it itself (Gemma 3's)."""
    raw = source.raw
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    head_dim = raw.get("head_dim") or hidden // num_heads
    rotary_dim = rotary_dims(raw, head_dim)
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"unsupported hidden_act {act!r} (the decoders take 'silu' "
                             f"or 'gelu_pytorch_tanh')")
    rope = rope or rope_config(raw, rotary_dim, source.served)
    max_len = max(raw["max_position_embeddings"], rope.context_length or 0)
    attention_bias = bool(raw.get("attention_bias", False))
    base: dict[str, Any] = dict(
        name=source.name,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        max_model_len=max_len,
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_word_embeddings)),
        qkv_bias=attention_bias or qkv_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=act,
        eos_token_ids=source.eos_token_ids,
        rope=rope,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        windows=sliding_windows(raw, windows, max_len))
    return ModelConfig(**{**base, **fields})


def rotary_dims(raw: dict[str, Any], head_dim: int) -> int:
    """The dimensions of each head RoPE turns (partial_rotary_factor of them)."""
    partial = ({**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
               .get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {partial} turns {rotary_dim} of "
                             f"{head_dim} dimensions a head; it must be an even number "
                             f"from 2 to {head_dim}")
    return rotary_dim


def sliding_windows(raw: dict[str, Any], rule: SlidingWindows, max_len: int
                    ) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers reads the config (``rule``: the
    family's way), or () where no layer's window is shorter than the context."""
    window = raw.get("sliding_window")
    if not window or not raw.get("use_sliding_window", rule.default_on):
        return ()
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, not {window!r}")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and rule.pattern:
        # older configs: every pattern-th layer is full
        pattern = raw.get("sliding_window_pattern", rule.pattern)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif rule.every_layer or (types is None and not rule.from_max_window_layers):
        sliding = [True] * layers
    elif types is None:
        sliding = [i >= raw.get("max_window_layers", layers) for i in range(layers)]
    elif isinstance(types, list) and len(types) == layers:
        sliding = [t == "sliding_attention" for t in types]
    else:
        raise ModelLoadError(f"layer_types must name each of the {layers} layers' attention")
    if (window >= max_len and not rule.keep_long) or not any(sliding):
        return ()
    return tuple(window if s else 0 for s in sliding)


def mixture_fields(raw: dict[str, Any], every_layer: bool, shared_expert: bool = False
                   ) -> dict[str, Any]:
    """A mixture of experts' fields. every_layer (Mixtral, gpt-oss): every layer's MLP
    is num_local_experts experts of intermediate_size, the chosen experts' weights
    renormalized; else (Qwen3-MoE, Qwen2-MoE) every decoder_sparse_step-th layer not in
    mlp_only_layers, of moe_intermediate_size, renormalized where norm_topk_prob says,
    and Qwen2-MoE's shared expert (``shared_expert``)."""
    layers = raw["num_hidden_layers"]
    if every_layer:
        experts, inner, norm = raw["num_local_experts"], raw["intermediate_size"], True
        moe = tuple(range(layers))
    else:
        # num_experts in the published configs; transformers 5 writes num_local_experts
        experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        inner = raw["moe_intermediate_size"]
        norm = bool(raw.get("norm_topk_prob", False))
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        moe = tuple(i for i in range(layers)
                    if experts > 0 and i not in dense and (i + 1) % step == 0)
    # gpt-oss's published configs have experts_per_token beside num_experts_per_tok
    k = raw["num_experts_per_tok" if "num_experts_per_tok" in raw else "experts_per_token"]
    if not 0 < k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {k} must be from 1 to the {experts} experts")
    return {"moe_layers": moe, "num_experts": experts, "experts_per_token": k,
            "expert_intermediate_size": inner, "norm_topk": norm,
            "shared_expert_size": (raw.get("shared_expert_intermediate_size", 0)
                                   if shared_expert else 0)}


def positive_numbers(raw: dict[str, Any], defaults: dict[str, float]) -> dict[str, float]:
    """The config's values of ``defaults``' fields (or the defaults), each checked to
    be a positive finite number."""
    values = {name: raw.get(name, default) for name, default in defaults.items()}
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{name} must be a positive number, not {value!r}")
    return {name: float(value) for name, value in values.items()}
