"""The Llama family: Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3, SmolLM3, Gemma 2 and
Gemma 3 checkpoints, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and
gpt-oss (each head's sink logit, biased routers and experts, a clamped SwiGLU).

RMSNorm, rotary position embeddings (rotate-half convention, as in Hugging Face
checkpoints), grouped-query attention, SwiGLU MLP; optional q/k/v biases (Qwen2), q and
k RMS-normed per head before RoPE (Qwen3), and tied or untied embeddings. Runs on a
flat batch of tokens (N, C): every sequence of the step is concatenated, so each
projection is one matmul for the whole step. q/k/v and gate/up are fused into one
matmul each at load time. The residual stream is carried
beside the hidden states so that each residual add fuses into the next RMSNorm, and
the elementwise work goes through ``ops`` (fused C kernels on the CPU, see ops.py).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.cpu.kernels import CpuKernels
from engine_worker.models.config import ModelConfig
from engine_worker.models.rope import RopeConfig
from engine_worker.models.layers import embedding, linear
from engine_worker.ops import TorchOps, soft_cap
from engine_worker.models.checkpoint import Checkpoint, mxfp4_to_float

Ops = Union[TorchOps, CpuKernels]


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), scaled as the rope type says."""
    # Explicit device: models are built under torch.device("meta").
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band between them interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    if rope.kind == "longrope":
        return inv_freq / torch.tensor(rope.ext_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context
    are interpolated (slowed by the factor), those that turn more than beta_fast times
    kept, and the band between them blended along a linear ramp."""
    def dimension(rotations: float) -> float:
        # the dimension whose wavelength fits ``rotations`` times in the original context
        return (head_dim * math.log(rope.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    # ramp 0: kept (extrapolated); 1: interpolated
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def partial_rotary_order(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Where RoPE turns only a head's first R dimensions (pairs i and i + R/2): the
    order of q's and k's rows in the fused q/k/v weight (q's heads, then k's), and of
    a head's dimensions (its norms'), that puts those pairs where the kernels'
    full-head RoPE turns pairs (i and i + D/2, for i < R/2), and the rest where Rotary
    gives frequency 0. Each head alike, q and k alike, so q.k is unchanged."""
    d, half, r = cfg.head_dim, cfg.head_dim // 2, cfg.rotary_dim // 2
    rest = list(range(2 * r, d))
    order = torch.tensor(list(range(r)) + rest[:half - r]
                         + list(range(r, 2 * r)) + rest[half - r:])
    heads = torch.arange(cfg.num_heads + cfg.num_kv_heads).unsqueeze(1) * d
    return (heads + order).flatten(), order


class Rotary:
    """cos/sin of each position, computed per step from the positions (as Hugging Face
    does) rather than from a table, so the numbers match bit for bit."""

    def __init__(self, rope: RopeConfig, head_dim: int, rotary_dim: Optional[int] = None
                 ) -> None:
        """rotary_dim: the dimensions RoPE turns, where not all: their frequencies come
        first (the loader moved them there, LlamaModel.permute_partial_rotary), the
        others' are 0 (cos 1, sin 0: left as they are)."""
        turned, half = (rotary_dim or head_dim) // 2, head_dim // 2
        self.inv_freq = rope_inv_freq(rope, rotary_dim or head_dim)  # (D/2,), float32
        # YaRN's and LongRoPE's attention factor multiplies cos and sin (1 for the other
        # kinds), of the dimensions turned only
        self.scale: Union[float, torch.Tensor] = rope.attention_factor
        if turned < half:   # explicit device: models are built under torch.device("meta")
            self.inv_freq = torch.cat([self.inv_freq, torch.zeros(half - turned, device="cpu")])
            if rope.attention_factor != 1.0:
                self.scale = torch.ones(half, device="cpu")
                self.scale[:turned] = rope.attention_factor

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) -> cos, sin (N, D/2)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if isinstance(self.scale, torch.Tensor):
                self.scale = self.scale.to(positions.device)
        freqs = positions.float().unsqueeze(1) * self.inv_freq
        if isinstance(self.scale, torch.Tensor) or self.scale != 1.0:
            return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, ops: Ops, window: int = 0
                 ) -> None:
        super().__init__()
        self.window = window  # > 0: a sliding window of that many keys
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias)
        self.o_proj = linear(q_size, cfg.hidden_size, cfg.o_bias)
        # Qwen3: each head of q and k RMS-normed before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # gpt-oss: each head's sink logit
        self.sinks = (nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False)
                      if cfg.attn_sinks else None)
        self.attn = attn
        self.ops = ops

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.window and meta.local is not None:
            meta = meta.local  # its blocks in the sliding layers' pool
        qkv = self.qkv_proj(x)  # (N, (Hq + 2 Hkv) D)
        qk_norm = (None if self.q_norm is None
                   else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        q, k, v = self.ops.rope_write_kv(qkv, *rope, self.num_heads, self.num_kv_heads,
                                         self.head_dim, kv_cache, meta.slot_mapping, qk_norm)
        return self.o_proj(self.attn.attend(q, k, v, kv_cache, meta, self.window, self.sinks))


def gate_of(cfg: ModelConfig, ops: Ops, expert: bool = False
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP's gate: SiLU, Gemma's GELU (tanh form), or gpt-oss's experts' clamped
    SwiGLU."""
    if expert and cfg.swiglu_limit:
        return functools.partial(ops.clamped_swiglu, alpha=cfg.swiglu_alpha,
                                 limit=cfg.swiglu_limit)
    return ops.gelu_tanh_mul if cfg.hidden_act == "gelu_pytorch_tanh" else ops.silu_mul


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, intermediate: Optional[int] = None,
                 expert: bool = False) -> None:
        """expert: one of a mixture's experts (gpt-oss's have biases and a gate of
        their own)."""
        super().__init__()
        intermediate = intermediate or cfg.intermediate_size
        bias = cfg.mlp_bias or (expert and cfg.expert_bias)
        self.gate_up_proj = linear(cfg.hidden_size, 2 * intermediate, bias)
        self.down_proj = linear(intermediate, cfg.hidden_size, bias)
        self.ops = ops
        self.act = gate_of(cfg, ops, expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class MoE(nn.Module):
    """A mixture of experts (Mixtral, Qwen3-MoE): the router's softmax over the experts
    picks each token's top k, whose SwiGLU MLPs run on it and are summed, weighted by
    their probabilities (renormalized over the k, where the model says; gpt-oss's: a
    softmax over the k chosen logits, as its router has it, the same up to rounding).
    Layer by layer (the torch ops), each expert runs once a step on the rows routed to
    it; the CPU's fused forward does the same in C (csrc/llama.c, ``mixture``); on the
    GPU they run grouped (engine_worker/gpu/moe.py: ``grouped``, which replaces
    ``experts``), routed on the device."""

    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.gate = linear(cfg.hidden_size, cfg.num_experts, cfg.expert_bias)   # the router
        self.experts: Optional[nn.ModuleList] = None
        self.grouped: Optional[nn.Module] = None
        self.expert_format = cfg.expert_format   # "mxfp4": the CPU kernels keep them so
        if cfg.expert_format == "mxfp4" and getattr(ops, "grouped_experts", False):
            # gpt-oss's checkpoints' MXFP4 experts, kept so on a GPU (4.25 bits a weight)
            from engine_worker.gpu.moe import GroupedExperts

            self.grouped = GroupedExperts.mxfp4(
                cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size,
                gate_of(cfg, ops, expert=True), cfg.expert_bias)
        else:
            self.experts = nn.ModuleList(MLP(cfg, ops, cfg.expert_intermediate_size,
                                             expert=True) for _ in range(cfg.num_experts))
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk
        self.softmax_chosen = cfg.expert_bias
        # Qwen2-MoE's shared expert, gated by a sigmoid of its own
        self.shared_expert = (MLP(cfg, ops, cfg.shared_expert_size)
                              if cfg.shared_expert_size else None)
        self.shared_expert_gate = (linear(cfg.hidden_size, 1, False)
                                   if cfg.shared_expert_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if self.softmax_chosen:
            weights, chosen = torch.topk(logits, self.top_k, dim=-1)   # (N, k)
            weights = torch.softmax(weights, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.grouped is not None:
            out = self.grouped(x, weights, chosen)
        else:
            out = self._each_expert(x, weights, chosen)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _each_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                     ) -> torch.Tensor:
        """Each chosen expert once, on its rows, in the experts' order and each one's
        rows in theirs, as transformers sums them. The choices are sorted once by expert
        (stably: (row, slot) pairs in row order) and each expert takes its run of them:
        a scan of every choice per expert took 1.25-1.56x the time a layer in Python
        (32 experts and 4 a token, or 128 and 8; 1 to 64 rows)."""
        k = chosen.shape[1]
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows_of, weight_of = order // k, weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(torch.bincount(flat).tolist()):
            if count:
                rows = rows_of[start:start + count]
                out.index_add_(0, rows, self.experts[expert](x[rows]) *
                               weight_of[start:start + count])
                start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, ops: Ops, index: int) -> None:
        super().__init__()
        window = cfg.windows[index] if cfg.windows else 0
        # its RoPE: 1 the model's, 2 the local one (Gemma 3's sliding layers), 0 none
        # (SmolLM3's NoPE layers)
        self.rope_kind = (0 if index in cfg.nope_layers
                          else 2 if window and cfg.rope_local is not None else 1)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg, attn, ops, window)
        # the norm before the MLP (Gemma's pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg, ops) if index in cfg.moe_layers else MLP(cfg, ops)
        # Gemma's norms of the attention's and the MLP's outputs
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.sandwich_norms else None
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None)."""
        norm = self.input_layernorm
        h, residual = self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self._normed(self.self_attn(h, rope, kv_cache, meta), self.attn_out_norm)
        norm = self.post_attention_layernorm
        h, residual = self.ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self._normed(self.mlp(h), self.mlp_out_norm), residual

    def _normed(self, h: torch.Tensor, norm: Optional[RMSNorm]) -> torch.Tensor:
        return h if norm is None else self.ops.add_rms_norm(h, None, norm.weight, norm.eps)[0]


def _load_mxfp4_experts(ckpt: Checkpoint, p: str, grouped: nn.Module,
                        sizes: tuple[int, int, int]) -> None:
    """A checkpoint's MXFP4 experts into GroupedExperts.mxfp4's bytes and scales as
    they are (gate_up's rows, interleaved gate and up, put gate's first), and their
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
    """A stacked projection of experts: expert k's weight, (out, in) as nn.Linear's,
    for each k: MXFP4 blocks and scales dequantized an expert at a time, or a tensor
    stored (E, in, out) transposed."""
    e, rows, cols = shape
    if name + "_blocks" not in ckpt:
        stored = ckpt.take(name, (e, cols, rows))
        return lambda k: stored[k].T
    blocks = ckpt.take(name + "_blocks", (e, rows, cols // 32, 16))
    scales = ckpt.take(name + "_scales", (e, rows, cols // 32))
    return lambda k: mxfp4_to_float(blocks[k], scales[k])


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, ops: Ops) -> None:
        super().__init__()
        assert cfg.rope is not None
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.rotary_dim)
        # Gemma 3's sliding layers' own RoPE
        self.rotary_local = (None if cfg.rope_local is None
                             else Rotary(cfg.rope_local, cfg.head_dim, cfg.rotary_dim))
        self.layers = nn.ModuleList(DecoderLayer(cfg, attn, ops, i)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # None when tied to the embedding (until load_model packs it).
        self.lm_head: Optional[nn.Module] = (
            None if cfg.tie_word_embeddings else linear(cfg.hidden_size, cfg.vocab_size, False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (N,) -> final hidden states (N, C)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        ropes = [
            # SmolLM3's layers without RoPE turn by angle 0
            (torch.ones_like(rope[0]), torch.zeros_like(rope[1])) if self.cfg.nope_layers
            else rope, rope,
            rope if self.rotary_local is None else self.rotary_local(positions, x.dtype)]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, ropes[layer.rope_kind], kv_cache, meta)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    def tied_lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, C) -> (S, V) (Gemma 2's soft-capped)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return soft_cap(logits, self.cfg.logit_softcap)

    def load_weights(self, ckpt: Checkpoint,
                     on_layer: Optional[Callable[[nn.Module], None]] = None) -> None:
        """Copy Hugging Face tensors in, fusing q/k/v and gate/up. on_layer: called
        with each layer once its weights are in, as the model computes with them (the
        CPU packs its linear layers there, so that no more than a layer of the
        checkpoint's weights is held unpacked)."""
        cfg = self.cfg
        c = cfg.hidden_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.embed_tokens.weight.copy_(ckpt.take("embed_tokens.weight", (cfg.vocab_size, c)))
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj.weight.copy_(self._fused(ckpt, p + "self_attn.", "qkv_proj", {
                "q_proj": q, "k_proj": kv, "v_proj": kv}, c))
            if cfg.qkv_bias:
                attn.qkv_proj.bias.copy_(torch.cat([
                    ckpt.take(p + "self_attn.q_proj.bias", (q,)),
                    ckpt.take(p + "self_attn.k_proj.bias", (kv,)),
                    ckpt.take(p + "self_attn.v_proj.bias", (kv,))]))
            attn.o_proj.weight.copy_(ckpt.take(p + "self_attn.o_proj.weight", (c, q)))
            if cfg.qk_norm:
                d = cfg.head_dim
                attn.q_norm.weight.copy_(ckpt.take(p + "self_attn.q_norm.weight", (d,)))
                attn.k_norm.weight.copy_(ckpt.take(p + "self_attn.k_norm.weight", (d,)))
            if cfg.o_bias:
                attn.o_proj.bias.copy_(ckpt.take(p + "self_attn.o_proj.bias", (c,)))
            if cfg.attn_sinks:
                attn.sinks.copy_(ckpt.take(p + "self_attn.sinks", (cfg.num_heads,)))
            i_size = cfg.intermediate_size
            if isinstance(mlp, MoE) and cfg.layout == "gpt_oss":
                self._load_stacked_experts(ckpt, p + "mlp.", mlp)
            elif isinstance(mlp, MoE):
                self._load_experts(ckpt, p, mlp)
            else:
                mlp.gate_up_proj.weight.copy_(self._fused(ckpt, p + "mlp.", "gate_up_proj", {
                    "gate_proj": i_size, "up_proj": i_size}, c))
                mlp.down_proj.weight.copy_(ckpt.take(p + "mlp.down_proj.weight", (c, i_size)))
            if cfg.mlp_bias:
                mlp.gate_up_proj.bias.copy_(torch.cat([
                    ckpt.take(p + "mlp.gate_proj.bias", (i_size,)),
                    ckpt.take(p + "mlp.up_proj.bias", (i_size,))]))
                mlp.down_proj.bias.copy_(ckpt.take(p + "mlp.down_proj.bias", (c,)))
            layer.input_layernorm.weight.copy_(ckpt.take(p + "input_layernorm.weight", (c,)))
            if cfg.sandwich_norms:   # Gemma's names: its post_attention_layernorm is ours
                layer.attn_out_norm.weight.copy_(      # of the attention's output
                    ckpt.take(p + "post_attention_layernorm.weight", (c,)))
                layer.post_attention_layernorm.weight.copy_(
                    ckpt.take(p + "pre_feedforward_layernorm.weight", (c,)))
                layer.mlp_out_norm.weight.copy_(
                    ckpt.take(p + "post_feedforward_layernorm.weight", (c,)))
            else:
                layer.post_attention_layernorm.weight.copy_(
                    ckpt.take(p + "post_attention_layernorm.weight", (c,)))
            ckpt.discard(p + "self_attn.rotary_emb.inv_freq")
            self._finish_layer(layer)
            if on_layer is not None:
                on_layer(layer)
        self.norm.weight.copy_(ckpt.take("norm.weight", (c,)))
        if cfg.tie_word_embeddings:
            ckpt.discard("lm_head.weight")  # tied; some checkpoints store the copy anyway
        else:
            self.lm_head.weight.copy_(ckpt.take("lm_head.weight", (cfg.vocab_size, c)))
        if cfg.norm_offset:   # Gemma's norms scale by 1 + weight
            self.norm.weight += 1.0
        self.fold_scales()

    def _load_experts(self, ckpt: Checkpoint, prefix: str, moe: MoE) -> None:
        """A mixture's router and experts: Mixtral's block_sparse_moe.gate and experts'
        w1 (gate), w3 (up), w2 (down); Qwen3-MoE's mlp.gate and experts' gate_proj,
        up_proj, down_proj."""
        cfg = self.cfg
        c, i_size = cfg.hidden_size, cfg.expert_intermediate_size
        mixtral = prefix + "block_sparse_moe.gate.weight" in ckpt
        p = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        moe.gate.weight.copy_(ckpt.take(p + "gate.weight", (cfg.num_experts, c)))
        if moe.shared_expert is not None:
            s = cfg.shared_expert_size
            moe.shared_expert.gate_up_proj.weight.copy_(torch.cat([
                ckpt.take(p + "shared_expert.gate_proj.weight", (s, c)),
                ckpt.take(p + "shared_expert.up_proj.weight", (s, c))]))
            moe.shared_expert.down_proj.weight.copy_(
                ckpt.take(p + "shared_expert.down_proj.weight", (c, s)))
            moe.shared_expert_gate.weight.copy_(ckpt.take(p + "shared_expert_gate.weight", (1, c)))
        for e, expert in enumerate(moe.experts):
            gate, up, down = (f"{p}experts.{e}.{name}.weight" for name in names)
            expert.gate_up_proj.weight.copy_(torch.cat([ckpt.take(gate, (i_size, c)),
                                                        ckpt.take(up, (i_size, c))]))
            expert.down_proj.weight.copy_(ckpt.take(down, (c, i_size)))

    def _load_stacked_experts(self, ckpt: Checkpoint, p: str, moe: MoE) -> None:
        """gpt-oss's router (weight and bias) and experts, each projection one tensor
        of all of a layer's experts with its biases: as transformers holds them,
        (E, C, 2 I) and (E, I, C), or as the published checkpoints do, MXFP4 blocks
        and scales of (E, 2 I, C) and (E, C, I). gate_up's columns interleave gate and
        up; ours holds gate's rows, then up's."""
        cfg = self.cfg
        c, i_size, e = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
        moe.gate.weight.copy_(ckpt.take(p + "router.weight", (e, c)))
        moe.gate.bias.copy_(ckpt.take(p + "router.bias", (e,)))
        p += "experts."
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

    def _fused(self, ckpt: Checkpoint, prefix: str, fused: str, parts: dict[str, int],
               columns: int) -> torch.Tensor:
        """One fused projection's weight: Phi-3 stores it so, the others as parts."""
        if self.cfg.layout == "phi3":
            return ckpt.take(prefix + fused + ".weight", (sum(parts.values()), columns))
        return torch.cat([ckpt.take(f"{prefix}{name}.weight", (rows, columns))
                          for name, rows in parts.items()])

    @torch.no_grad()
    def _finish_layer(self, layer: DecoderLayer) -> None:
        """A layer's weights, as read, made what the kernels compute with: Gemma's
        norms' 1 + weight; Granite's residual multiplier folded into o and down, whose
        outputs join the residual stream; where RoPE turns only a head's first
        dimensions, q's and k's reordered (partial_rotary_order; v, and so every
        output, is untouched)."""
        cfg = self.cfg
        if cfg.norm_offset:
            for module in layer.modules():
                if isinstance(module, RMSNorm):
                    module.weight += 1.0
        if cfg.residual_multiplier != 1.0:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight *= cfg.residual_multiplier
                if proj.bias is not None:
                    proj.bias *= cfg.residual_multiplier
        if cfg.rotary_dim is None:
            return
        rows, order = partial_rotary_order(cfg)
        attn = layer.self_attn
        params = [attn.qkv_proj.weight] + (
            [attn.qkv_proj.bias] if attn.qkv_proj.bias is not None else [])
        for t in params:
            t[:len(rows)] = t[rows.to(t.device)]
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None:
                norm.weight.copy_(norm.weight[order.to(norm.weight.device)])

    @torch.no_grad()
    def fold_scales(self) -> None:
        """Granite's constants and Gemma's scales of the embeddings folded into the
        weights they multiply: the embeddings; the final norm, whose output only makes
        the logits (so a tied lm_head can keep the scaled embedding). (The residual
        multiplier is each layer's: _finish_layer.) The scores' scale is the attention
        kernels' own (ModelConfig.attention_scale), as transformers applies it: a GGUF
        file's q rows are packed as the file holds them."""
        cfg = self.cfg
        multiplier = cfg.embedding_multiplier
        if cfg.norm_offset:   # Gemma's: rounded to the weights' dtype, as transformers has it
            multiplier = float(torch.tensor(multiplier, dtype=self.embed_tokens.weight.dtype))
        if multiplier != 1.0:
            self.embed_tokens.weight *= multiplier
        tied = multiplier if self.lm_head is None else 1.0
        if cfg.logits_scaling * tied != 1.0:
            self.norm.weight /= cfg.logits_scaling * tied
