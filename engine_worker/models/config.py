"""What the engine needs to know about a checkpoint, read from its config.json.

Supported: the Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, GraniteForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM,
Gemma2ForCausalLM, Gemma3ForCausalLM, and the language model of
Gemma3ForConditionalGeneration and Mistral3ForConditionalGeneration, and the mixtures
of experts MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and
GptOssForCausalLM: RMSNorm,
RoPE, grouped-query attention, SwiGLU; Qwen3 also RMS-norms each head of q and k;
Granite scales the embeddings, attention scores, each layer's outputs and the logits by
constants of its config; Phi-3 stores q/k/v and gate/up fused; SmolLM3 leaves RoPE out
of every fourth layer; Gemma 2 and 3 have GELU gates, 1 + weight norms, norms of each
layer's outputs and sliding layers, Gemma 2 soft-capped scores and logits, Gemma 3's
sliding layers a RoPE of their own; gpt-oss a learned sink logit per head, biased
routers and experts, a clamped SwiGLU and MXFP4 experts) and GPT2LMHeadModel. Anything
else is a ModelLoadError that names the architecture and what is supported. RoPE's
scalings are read in engine_worker/models/rope.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from common.errors import ModelLoadError
from engine_worker.models.rope import RopeConfig, rope_config

logger = logging.getLogger(__name__)

LLAMA_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GptOssForCausalLM": "gpt_oss",
}
GPT2_FAMILY = {"GPT2LMHeadModel": "gpt2"}
# Multimodal checkpoints whose language model is served (text only): architecture ->
# the language model's, and the transformers config class that fills in its
# text_config's defaults
LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
                   "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "MistralConfig")}
SUPPORTED_ARCHITECTURES = sorted({**LLAMA_FAMILY, **GPT2_FAMILY, **LANGUAGE_MODELS})


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # "llama" (every architecture but GPT-2) or "gpt2"
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
    # (LlamaModel.permute_partial_rotary).
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
    # The checkpoint's tensor layout: "llama" (q, k, v, gate, up apart), "phi3"
    # (qkv_proj and gate_up_proj as one tensor each) or "gpt_oss" (a layer's experts
    # stacked in one tensor a projection, gate and up interleaved, bfloat16 or MXFP4)
    layout: str = "llama"
    # Granite's constants: the embeddings are multiplied by embedding_multiplier, the
    # attention scores scaled by attention_multiplier (None: 1/sqrt(head_dim); the
    # attention kernels' scale), each attention and MLP output by residual_multiplier
    # before it joins the residual stream, the logits divided by logits_scaling. The
    # loader folds the others into the weights (LlamaModel.fold_scales), so every
    # kernel computes a plain Llama.
    embedding_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

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
        if self.family == "gpt2":
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
        pos = self.max_model_len * self.hidden_size if self.family == "gpt2" else 0
        return 2 * (self._params(self.experts_per_token) - emb - pos + lm_head)


def load_model_config(model_dir: Path, max_model_len: Optional[int] = None) -> ModelConfig:
    """max_model_len: the context to serve, where the user caps it (LongRoPE picks its
    factors by it)."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{model_dir} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    multimodal = next((a for a in archs if a in LANGUAGE_MODELS), None)
    if multimodal is not None:
        raw = _language_model_config(raw, multimodal)
        archs = raw["architectures"]
    arch = next((a for a in archs if a in LLAMA_FAMILY or a in GPT2_FAMILY), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    eos = _eos_token_ids(raw, model_dir)
    name = model_dir.resolve().name
    try:
        if arch in GPT2_FAMILY:
            return _gpt2_config(raw, str(name), eos)
        config = _llama_config(raw, LLAMA_FAMILY[arch], str(name), eos, max_model_len)
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks the field {e.args[0]!r}") from None
    if multimodal is None:
        return config
    logger.info("%s: serving its language model (text only; the vision tower is not "
                "loaded)", multimodal)
    return dataclasses.replace(
        config, checkpoint_prefixes=("language_model.model.", "model.language_model.",
                                     "language_model."),
        checkpoint_skips=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector."))


def _llama_config(raw: dict[str, Any], kind: str, name: str, eos: tuple[int, ...],
                  served: Optional[int] = None) -> ModelConfig:
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    head_dim = raw.get("head_dim") or hidden // num_heads
    partial = ({**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
               .get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {partial} turns {rotary_dim} of "
                             f"{head_dim} dimensions a head; it must be an even number "
                             f"from 2 to {head_dim}")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"unsupported hidden_act {act!r} (the Llama family takes 'silu' "
                             f"or 'gelu_pytorch_tanh')")
    gemma = (_gemma(raw, kind, head_dim, rotary_dim, served) if kind in ("gemma2", "gemma3")
             else {})
    rope = gemma.pop("rope", None) or rope_config(raw, rotary_dim, served)
    max_len = max(raw["max_position_embeddings"], rope.context_length or 0)
    attention_bias = bool(raw.get("attention_bias", False))
    experts = (_experts(raw, kind) if kind in ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")
               else {})
    return ModelConfig(
        name=name,
        family="llama",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        intermediate_size=experts.pop("intermediate_size", raw["intermediate_size"]),
        max_model_len=max_len,
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                         kind in ("gemma2", "gemma3"))),
        qkv_bias=attention_bias or kind in ("qwen2", "qwen2_moe"),
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=act,
        eos_token_ids=eos,
        rope=rope,
        qk_norm=kind in ("qwen3", "gemma3", "qwen3_moe"),
        layout=kind if kind in ("phi3", "gpt_oss") else "llama",
        **experts,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        nope_layers=_nope_layers(raw) if kind == "smollm3" else (),
        windows=_sliding_windows(raw, kind, max_len),
        **(_granite_scales(raw) if kind == "granite" else {}),
        **gemma,
    )


def _gemma(raw: dict[str, Any], kind: str, head_dim: int, rotary_dim: int,
           served: Optional[int]) -> dict[str, Any]:
    """Gemma 2's and 3's fields: their norms, their scales (the embeddings by
    sqrt(hidden_size), the scores by query_pre_attn_scalar^-1/2); Gemma 2's soft caps
    of the scores and the logits; Gemma 3's two RoPEs, the full layers' and the sliding
    ones' (rope_parameters keyed by layer type, or in older configs rope_theta and
    rope_scaling, and rope_local_base_freq)."""
    caps = {name: raw.get(name) for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    for name, cap in caps.items():
        if cap is not None and kind == "gemma3":
            raise ModelLoadError(f"{name} is not supported for Gemma 3 (Gemma 2's)")
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ModelLoadError(f"{name} must be a positive number, not {cap!r}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (an embedding model) is not served")
    scales = {"norm_offset": True, "sandwich_norms": True,
              "embedding_multiplier": math.sqrt(raw["hidden_size"]),
              "attention_multiplier": float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5}
    if kind == "gemma2":
        return {**scales, "attn_softcap": float(caps["attn_logit_softcapping"] or 0.0),
                "logit_softcap": float(caps["final_logit_softcapping"] or 0.0)}
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
    return {**scales, "rope": rope_config(full, rotary_dim, served),
            "rope_local": rope_config(local, rotary_dim, served)}


def _experts(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """A mixture of experts' fields. Mixtral: every layer's MLP is one, the chosen
    experts' weights renormalized; Qwen3-MoE and Qwen2-MoE: every decoder_sparse_step-th
    layer not in mlp_only_layers, renormalized where norm_topk_prob says; Qwen2-MoE's
    shared expert."""
    layers = raw["num_hidden_layers"]
    if kind in ("mixtral", "gpt_oss"):
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
    shared = raw.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    fields = {"moe_layers": moe, "num_experts": experts, "experts_per_token": k,
              "expert_intermediate_size": inner, "norm_topk": norm,
              "shared_expert_size": shared}
    return fields if kind != "gpt_oss" else {**fields, **_gpt_oss(raw)}


def _gpt_oss(raw: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields beyond a mixture's: every MLP a mixture (its intermediate_size
    is the experts'), the sinks, the biases, the clamped SwiGLU; its experts as the
    published checkpoints hold them (MXFP4) or dequantized (bfloat16)."""
    quant = raw.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise ModelLoadError(f"gpt-oss checkpoints are served dequantized or in MXFP4, not "
                             f"{quant.get('quant_method')!r}")
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{name} must be a positive number, not {value!r}")
    return {"intermediate_size": 0, "attn_sinks": True, "expert_bias": True,
            "swiglu_limit": float(limit), "swiglu_alpha": float(alpha),
            "expert_format": "mxfp4" if quant else ""}


def _sliding_windows(raw: dict[str, Any], kind: str, max_len: int) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers reads the config: Mistral and
    Phi-3 slide in every layer where sliding_window is set; Gemma 3 in the layers
    layer_types names (else all but every sliding_window_pattern-th); Qwen2/Qwen3 and
    SmolLM3 only with use_sliding_window, in the layers layer_types names (else, Qwen's,
    those from max_window_layers on). () where no layer's window is shorter than the
    context."""
    window = raw.get("sliding_window")
    if not window or not raw.get("use_sliding_window", kind in (
            "mistral", "mixtral", "phi3", "gemma2", "gemma3", "gpt_oss")):
        return ()
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, not {window!r}")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and kind in ("gemma2", "gemma3", "gpt_oss"):
        # older configs: every pattern-th layer is full
        pattern = raw.get("sliding_window_pattern", 6 if kind == "gemma3" else 2)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif kind in ("mistral", "mixtral", "phi3") or (
            types is None and kind not in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")):
        sliding = [True] * layers
    elif types is None:
        sliding = [i >= raw.get("max_window_layers", layers) for i in range(layers)]
    elif isinstance(types, list) and len(types) == layers:
        sliding = [t == "sliding_attention" for t in types]
    else:
        raise ModelLoadError(f"layer_types must name each of the {layers} layers' attention")
    # a window as long as the context is full attention; Gemma 3's are kept, as its
    # sliding layers also take a RoPE of their own
    if (window >= max_len and kind != "gemma3") or not any(sliding):
        return ()
    return tuple(window if s else 0 for s in sliding)


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


def _granite_scales(raw: dict[str, Any]) -> dict[str, Any]:
    scales = {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
              "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
              "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
              "logits_scaling": float(raw.get("logits_scaling", 1.0))}
    for name, value in scales.items():
        if not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{name} must be a positive number, not {value}")
    return scales


def _language_model_config(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """A multimodal config's text_config, with the defaults its config class fills in
    (Gemma 3's published configs give a few fields and leave the rest to them)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{arch}'s config has no text_config")
    import transformers

    language_model, config_class = LANGUAGE_MODELS[arch]
    full = getattr(transformers, config_class)(**text).to_dict()
    full["architectures"] = [language_model]
    return full


def _gpt2_config(raw: dict[str, Any], name: str, eos: tuple[int, ...]) -> ModelConfig:
    hidden = raw["n_embd"]
    num_heads = raw["n_head"]
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"unsupported GPT-2 activation_function {act!r}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if raw.get(flag):
            raise ModelLoadError(f"GPT-2 option {flag}=true is not supported")
    if not raw.get("scale_attn_weights", True):
        raise ModelLoadError("GPT-2 option scale_attn_weights=false is not supported")
    return ModelConfig(
        name=name,
        family="gpt2",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["n_layer"],
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        max_model_len=raw["n_positions"],
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act=act,
        eos_token_ids=eos,
        rope=None,
    )


def _eos_token_ids(raw: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may list several)."""
    ids: list[int] = []
    sources = [raw]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            sources.append(json.loads(gen_path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen_path} is not valid JSON: {e}") from None
    for source in sources:
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)

