"""The fused CPU forward (csrc/llama.c) from Python: a loaded decoder's packed
weights, norms, KV caches and mixtures described in llama.c's structs, and one call a
step (``FusedForward``: the step's tokens as flat arrays, in the scheduler's order)."""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from engine_worker.cpu.formats import PackedMethod
from engine_worker.cpu.kernels import WEIGHT_FORMATS, CpuKernels, kv_type, ptr_or_none
from engine_worker.forward import Fill, Row
from engine_worker.models.layers.attention import Attention
from engine_worker.models.layers.decoder import DecoderLayer, DecoderModel
from engine_worker.models.layers.linear import Linear
from engine_worker.models.layers.lora import LoraContext
from engine_worker.models.layers.mlp import MLP
from engine_worker.models.layers.moe import MoE
from engine_worker.ops import soft_cap
from engine_worker.scheduler import ScheduledRequest


class _Moe(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "num_experts", "top_k", "intermediate", "routing", "act")),
        ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
        ("router", ctypes.c_void_p), ("router_bias", ctypes.c_void_p),
        ("router_format", ctypes.c_int64),
        *((name, ctypes.POINTER(ctypes.c_void_p)) for name in (
            "gate_up", "down", "gate_up_bias", "down_bias")),
        ("gate_up_format", ctypes.c_int64), ("down_format", ctypes.c_int64),
        ("shared_gate", ctypes.c_void_p), ("shared_gate_format", ctypes.c_int64),
        ("shared_intermediate", ctypes.c_int64)]


class _Lora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("row_part", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in ("rank", "parts", "slots"))]


LORA_TARGETS = ("lora_qkv", "lora_o", "lora_gate_up", "lora_down")


class _Layer(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "attn_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "mlp_norm",
        "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")),
        *((name, ctypes.c_int64) for name in (
            "qkv_format", "o_format", "gate_up_format", "down_format", "rope", "window")),
        ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
        ("moe", ctypes.POINTER(_Moe)), ("sinks", ctypes.c_void_p),
        *((name, ctypes.POINTER(_Lora)) for name in LORA_TARGETS)]


class _Llama(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "vocab", "block_size")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("lm_head_format", ctypes.c_int64),
        ("kv_type", ctypes.c_int64),
        ("embed", ctypes.c_void_p), ("lm_head", ctypes.c_void_p), ("norm", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)), ("gelu", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        *((name, ctypes.c_int64) for name in (
            "moe_experts", "moe_top_k", "moe_intermediate", "lora_width"))]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in (
                    "ids", "slots", "seq", "ctx_lens", "cos", "sin", "block_tables")),
                ("max_blocks", ctypes.c_int64), ("max_ctx", ctypes.c_int64),
                ("num_samples", ctypes.c_int64), ("sample_rows", ctypes.c_void_p),
                ("num_threads", ctypes.c_int64),
                ("scratch", ctypes.c_void_p), ("logits", ctypes.c_void_p),
                ("profile", ctypes.c_void_p), ("cos_local", ctypes.c_void_p),
                ("sin_local", ctypes.c_void_p), ("local_slots", ctypes.c_void_p),
                ("local_block_tables", ctypes.c_void_p), ("lora_slots", ctypes.c_void_p)]


class FusedLlama:
    """A decoder's forward pass in one C call (llama.c: the shared decoder's layers,
    models/layers/decoder.py), over the weights of a loaded model whose linear layers
    are packed (each in its own format), and the engine's
    KV caches; mixtures of experts included (each expert a packed gate_up and down).
    Set ``profile`` to a float64 tensor of 3 to have the seconds spent in linear layers,
    attention and the rest added to it."""

    def __init__(self, kernels: CpuKernels, model, kv_caches: list[torch.Tensor],
                 block_size: int) -> None:
        cfg = model.cfg
        self.profile: Optional[torch.Tensor] = None
        self._kernels = kernels
        self._vocab = cfg.vocab_size
        self._logit_softcap = cfg.logit_softcap
        self._keep: list = [model, kv_caches]  # everything the pointers point into
        # Each layer's linear layers in LORA_TARGETS' order (a mixture's MLP: none), and
        # those whose adapters this call does not apply (a mixture's shared expert's)
        self._lora_targets: list[tuple[Optional[Linear], ...]] = []
        self._lora_others: list[Linear] = []
        self._lora_version, self._lora_served = -1, True
        self._lora_keep: list = []
        layers = []
        for layer, kv in zip(model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            moe = None
            if isinstance(mlp, MoE):   # a mixture: its shared expert (or none) as the MLP
                moe = self._mixture(cfg, mlp)
                self._keep.append(moe)
                mlp = mlp.shared_expert
            dense = (None, None) if mlp is None else (mlp.gate_up_proj, mlp.down_proj)
            self._lora_targets.append((attn.qkv_proj, attn.o_proj,
                                       *(dense if moe is None else (None, None))))
            if moe is not None:
                self._lora_others += [lin for lin in dense if lin is not None]
            layers.append(_Layer(
                ptr_or_none(layer.input_layernorm.weight), ptr_or_none(attn.qkv_proj.packed),
                ptr_or_none(attn.qkv_proj.bias),
                *(ptr_or_none(None if norm is None else norm.weight)
                  for norm in (attn.q_norm, attn.k_norm)),
                ptr_or_none(attn.o_proj.packed), ptr_or_none(attn.o_proj.bias),
                ptr_or_none(layer.post_attention_layernorm.weight),
                *(ptr_or_none(t) for lin in dense
                  for t in ((None, None) if lin is None else (lin.packed, lin.bias))),
                ptr_or_none(kv[0]), ptr_or_none(kv[1]),
                *(0 if lin is None else WEIGHT_FORMATS[lin.fmt]
                  for lin in (attn.qkv_proj, attn.o_proj, *dense)),
                layer.rope_kind, layer.self_attn.window,
                *(ptr_or_none(None if norm is None else norm.weight)
                  for norm in (layer.attn_out_norm, layer.mlp_out_norm)),
                None if moe is None else ctypes.pointer(moe), ptr_or_none(attn.sinks)))
        self._layers = (_Layer * len(layers))(*layers)
        self._local_rope = any(layer.rope_kind == 2 for layer in model.layers)
        mixtures = [layer.moe.contents for layer in layers if layer.moe]
        self._model = _Llama(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, block_size, cfg.norm_eps,
            cfg.attention_scale, WEIGHT_FORMATS[model.lm_head.fmt],
            kv_type(kv_caches[0].dtype),
            ptr_or_none(model.embed_tokens.weight), ptr_or_none(model.lm_head.packed),
            ptr_or_none(model.norm.weight), self._layers, int(cfg.hidden_act != "silu"),
            cfg.attn_softcap, max((m.num_experts for m in mixtures), default=0),
            max((m.top_k for m in mixtures), default=0),
            max((max(m.intermediate, m.shared_intermediate) for m in mixtures), default=0), 0)
        self._scratch = torch.empty(0)

    def serves_lora(self, context: LoraContext) -> bool:
        """Whether this call applies the adapters loaded now (their weights pointed
        to afresh after any load or unload): not where one targets a mixture's shared
        expert."""
        if context.version != self._lora_version:
            # (every layer's packed first: one that fails leaves the structs as they were)
            keep, width, pointers = [], 0, []
            for targets in self._lora_targets:
                for lin in targets:
                    lora = None
                    if lin is not None and lin.lora is not None and lin.lora.slots:
                        a, b, row_part, rank, parts, num = lin.lora.packed()
                        lora = _Lora(a.data_ptr(), b.data_ptr(), row_part.data_ptr(), rank,
                                     parts, num)
                        keep.append((a, b, row_part, lora))
                        width = max(width, parts * rank)
                    pointers.append(None if lora is None else ctypes.pointer(lora))
            at = iter(pointers)
            for layer in self._layers:
                for name in LORA_TARGETS:
                    setattr(layer, name, next(at))
            self._lora_keep = keep   # (what the structs point into, until the next)
            self._model.lora_width = width
            self._lora_served = not any(lin.lora is not None and lin.lora.slots
                                        for lin in self._lora_others)
            self._lora_version = context.version
        return self._lora_served

    @staticmethod
    def supports(model) -> bool:
        """Whether the C forward computes this model as its modules do: the shared
        decoder's layers (a family's own layer or attention computes otherwise: OLMo-2's
        norms), every linear layer packed, a mixture's experts each projection's in one
        format (not the GPU's grouped experts)."""
        if type(model) is not DecoderModel or model.parallel.size > 1:
            return False
        for layer in model.layers:
            if (type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention
                    or type(layer.mlp) not in (MLP, MoE)):
                return False
            if not all(isinstance(m.method, PackedMethod) for m in layer.modules()
                       if isinstance(m, Linear)):
                return False
            experts = layer.mlp.experts if isinstance(layer.mlp, MoE) else ()
            if experts is None:   # the GPU's grouped experts
                return False
            for lins in ([e.gate_up_proj for e in experts], [e.down_proj for e in experts]):
                if lins and len({lin.fmt for lin in lins}) != 1:
                    return False
        return isinstance(model.lm_head.method, PackedMethod)

    def _mixture(self, cfg, mlp) -> _Moe:
        """A layer's mixture of experts as llama.c's struct rs_moe."""
        def pointers(tensors: list) -> Optional[ctypes.Array]:
            if all(t is None for t in tensors):
                return None
            array = (ctypes.c_void_p * len(tensors))(*(ptr_or_none(t) for t in tensors))
            self._keep.append(array)
            return ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))

        gate_up = [e.gate_up_proj for e in mlp.experts]
        down = [e.down_proj for e in mlp.experts]
        shared = mlp.shared_expert
        routing = 2 if mlp.softmax_chosen else 1 if mlp.norm_topk else 0
        act = 2 if cfg.swiglu_limit else int(cfg.hidden_act == "gelu_pytorch_tanh")
        return _Moe(
            len(gate_up), mlp.top_k, cfg.expert_intermediate_size, routing, act,
            cfg.swiglu_alpha or 0.0, cfg.swiglu_limit or 0.0,
            ptr_or_none(mlp.gate.packed), ptr_or_none(mlp.gate.bias), WEIGHT_FORMATS[mlp.gate.fmt],
            pointers([lin.packed for lin in gate_up]), pointers([lin.packed for lin in down]),
            pointers([lin.bias for lin in gate_up]), pointers([lin.bias for lin in down]),
            WEIGHT_FORMATS[gate_up[0].fmt], WEIGHT_FORMATS[down[0].fmt],
            None if shared is None else ptr_or_none(mlp.shared_expert_gate.packed),
            0 if shared is None else WEIGHT_FORMATS[mlp.shared_expert_gate.fmt],
            0 if shared is None else cfg.shared_expert_size)

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, seq: torch.Tensor, ctx_lens: torch.Tensor,
                block_tables: torch.Tensor, sample_rows: torch.Tensor, max_ctx: int,
                num_threads: int, local: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                local_pool: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per token (N,) int64: ids, slots, seq (its row of block_tables) and ctx_lens
        (keys it attends to, itself included); cos, sin (N, D/2), and ``local`` those of
        the layers with a RoPE of their own (Gemma 3's sliding ones); ``local_pool``
        the sliding layers' slots and block tables where their blocks are a pool of their
        own (window_blocks.py); sample_rows (S,); ``lora_slots`` each token's LoRA
        adapter (N,) int64 (0: none), where any has one (after serves_lora).
        Writes the step's keys and values; returns the logits (S, V)."""
        n, num_samples = ids.shape[0], sample_rows.shape[0]
        if self._local_rope and local is None:
            raise ValueError("this model's sliding layers need their own cos and sin (local)")
        need = self._kernels._llama_scratch(ctypes.byref(self._model), n, num_samples,
                                            max_ctx, num_threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        logits = torch.empty(num_samples, self._vocab, dtype=torch.float32)
        step = _Step(n, ids.data_ptr(), slots.data_ptr(), seq.data_ptr(), ctx_lens.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), block_tables.data_ptr(),
                     block_tables.shape[1], max_ctx, num_samples, sample_rows.data_ptr(),
                     num_threads, self._scratch.data_ptr(), logits.data_ptr(),
                     ptr_or_none(self.profile), *(ptr_or_none(t) for t in (local or (None, None))),
                     *(ptr_or_none(t) for t in (local_pool or (None, None))),
                     ptr_or_none(lora_slots))
        rc = self._kernels._llama_forward(ctypes.byref(self._model), ctypes.byref(step))
        if rc == -2:
            raise ValueError("the fused forward needs head_dim a multiple of 16, <= 256")
        if rc != 0:
            raise MemoryError("the fused forward could not allocate scratch memory")
        return soft_cap(logits, self._logit_softcap)


class FusedForward:
    """A step through llama.c: its tokens as flat per-token arrays, in the scheduler's
    order (forward.py's Forward)."""

    def __init__(self, fused: FusedLlama, model: DecoderModel, block_size: int,
                 windowed: bool) -> None:
        """windowed: the sliding layers' blocks are a pool of their own (kv_cache.py)."""
        self.fused, self.model, self.block_size, self.windowed = fused, model, block_size, windowed
        self.lora: Optional[LoraContext] = None   # the adapters' (ModelRunner.use_lora)

    def serves_lora(self) -> bool:
        return self.lora is not None and self.fused.serves_lora(self.lora)

    def __call__(self, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
                 tokens: Optional[torch.Tensor], extra: Sequence[Row]
                 ) -> Optional[torch.Tensor]:
        # (the adapters' weights pointed to as they are now: after an unload too, so
        # that what it held is let go of)
        served = self.serves_lora()
        adapters = self.lora is not None and self.lora.active
        assert served or not adapters, "adapters' rows in a step the C forward cannot apply"
        return self._run(scheduled, fills, tokens, extra, adapters)

    def _run(self, scheduled: Sequence[ScheduledRequest], fills: Sequence[Fill],
             tokens: Optional[torch.Tensor], extra: Sequence[Row], adapters: bool
             ) -> Optional[torch.Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seq: list[int] = []
        sample_rows: list[int] = []
        first_rows: list[int] = []
        lora_slots: list[int] = []
        # per pool (the full layers', then the sliding layers' where windowed): the
        # tokens' slots and the sequences' block tables
        pools: list[tuple[list, list]] = [([], []) for _ in range(1 + self.windowed)]
        for s in scheduled:
            r = s.request
            first_rows.append(len(input_ids))
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            if adapters:
                lora_slots += [r.lora_slot] * s.num_tokens
            # A request checking proposed tokens: each of its rows a sequence of its
            # own, so that it attends as a decode row does (the same sums, in the same
            # order: the tokens are the ones decoding one at a time gives).
            rows, first = (s.num_tokens if r.num_draft else 1), len(pools[0][1])
            seq.extend(range(first, first + s.num_tokens) if r.num_draft
                       else [first] * s.num_tokens)
            for (slots, tables), table in zip(pools, (r.blocks, r.blocks.window)):
                block_ids = table.block_ids
                slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
                tables.extend([block_ids[:-(-end // bs)]] * rows)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        wanted = [first_rows[i] + offset for i, offset in extra]
        width = max(len(t) for t in pools[0][1])
        n, num_seqs = len(input_ids), len(pools[0][1])
        # Every int64 array of the step in one tensor (one host copy), viewed in parts.
        flat = torch.tensor(input_ids + positions + [p + 1 for p in positions] + seq
                            + [x for slots, tables in pools for x in slots
                               + [b for t in tables for b in t + [0] * (width - len(t))]]
                            + sample_rows + wanted + lora_slots, dtype=torch.int64)
        ids, positions_t, ctx_lens, seq_t = flat[:4 * n].view(4, n)
        for i, offset, source in fills:  # placeholders: the ids the last step sampled
            ids[first_rows[i] + offset] = tokens[source]
        at, views = 4 * n, []
        for _ in pools:
            views.append((flat[at:at + n], flat[at + n:at + n + num_seqs * width]
                          .view(num_seqs, width)))
            at += n + num_seqs * width
        samples = flat[at:at + len(sample_rows) + len(wanted)]
        cos, sin = self.model.rotary(positions_t, torch.float32)
        local = (None if self.model.rotary_local is None
                 else self.model.rotary_local(positions_t, torch.float32))
        return self.fused.forward(
            ids, cos, sin, views[0][0], seq_t, ctx_lens, views[0][1], samples,
            max(positions) + 1, torch.get_num_threads(), local,
            views[1] if self.windowed else None, flat[at + samples.numel():] if adapters else None)
