"""GGUF files made from the tiny Hugging Face models, as llama.cpp's converter
(convert_hf_to_gguf.py) lays them out: its tensor names, q and k rows (weights and
biases) permuted into its RoPE order for the llama architecture and not for qwen2 and
qwen3,
Gemma's norms stored as the 1 + weight they scale by,
1-D tensors in F32, the tokenizer and chat template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",   # Phi-3's fused
         # Qwen2-MoE's shared expert and its gate
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# Mixtral's experts' projections
MIXTRAL_EXPERTS = {"w1": "gate", "w3": "up", "w2": "down"}
# gpt-oss's: its norm before the MLP, its router (weight and bias)
GPT_OSS_NAMES = {**NAMES, "post_attention_layernorm": "post_attention_norm",
                 "mlp.router": "ffn_gate_inp"}


def llama_cpp_rope_order(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Each head's halves (Hugging Face) as interleaved pairs (llama.cpp's llama)."""
    head_dim = len(rows) // num_heads
    return (rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:]).swapaxes(1, 2)
            .reshape(rows.shape))


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's RoPE scaling as llama.cpp's converter stores it (rope_freqs.weight):
    per frequency, what it is divided by: 1 for short wavelengths, ``factor`` for long
    ones, and between them the inverse of the interpolated rescale."""
    theta, factor = rope.get("rope_theta", 10000.0), rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope.get("original_max_position_embeddings", 8192)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for wavelen in 2 * np.pi / inv_freq:
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# Gemma's four norms a layer: its post_attention_layernorm normalizes the attention's
# output, its pre_feedforward_layernorm is the others' post_attention_layernorm
GEMMA_NAMES = {**NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensor_name(name: str, arch: str = "llama") -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)   # model.layers.N.<module>.<weight|bias>
    if rest == "self_attn.sinks":   # gpt-oss's
        return f"blk.{layer}.attn_sinks.weight"
    module, kind = rest.rsplit(".", 1)
    names = (GEMMA_NAMES if arch in ("gemma2", "gemma3")
             else GPT_OSS_NAMES if arch == "gpt-oss" else NAMES)
    return f"blk.{layer}.{names[module]}.{kind}"


def _gpt_oss_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: gate_up's
    interleaved columns split into gate and up, each projection (E, out, in), each
    bias (E, out)."""
    layer, kind = name.split(".")[2], name.split(".experts.")[1]
    p = f"blk.{layer}.ffn_"
    if kind == "gate_up_proj":   # (E, C, 2 I)
        return {p + "gate_exps.weight": array[:, :, 0::2].transpose(0, 2, 1),
                p + "up_exps.weight": array[:, :, 1::2].transpose(0, 2, 1)}
    if kind == "gate_up_proj_bias":
        return {p + "gate_exps.bias": array[:, 0::2], p + "up_exps.bias": array[:, 1::2]}
    if kind == "down_proj":   # (E, I, C)
        return {p + "down_exps.weight": array.transpose(0, 2, 1)}
    return {p + "down_exps.bias": array}


def _phi3_hparams(w, config: dict, rope: dict, head_dim: int) -> None:
    """As llama.cpp's converter writes Phi-3's: the dimensions RoPE turns, the sliding
    window, and LongRoPE as its original context, attention factor and two tensors
    of factors."""
    import math

    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(partial * config["hidden_size"])
                               // config["num_attention_heads"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") != "longrope":
        return
    original = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def gguf_from_hf(model_dir: Path, out: Path, arch: str, matrix_type: str = "F32",
                 name: str = "", experts_type: str = "") -> Path:
    """``model_dir`` (a tiny Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2 or 3, Phi-3,
    gpt-oss) as a GGUF file of ``arch`` (Mixtral's: llama);
    its matrices in ``matrix_type`` (F32, or a block type the gguf package quantizes:
    Q8_0...), but a mixture's routers F32, as llama.cpp's converter keeps them, and its
    experts in ``experts_type`` where given (gpt-oss's files: MXFP4);
    ``name``: general.name (the folder's, unless given)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = GGUFWriter(str(out), arch)
    w.add_name(name or model_dir.name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)   # Gemma 3's: by layer type
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "phi3":
        _phi3_hparams(w, config, rope, head_dim)
    elif rope.get("rope_type") in ("linear", "yarn", "longrope"):
        w.add_rope_scaling_type(RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope.get("rope_type") == "llama3":   # a tensor of its own
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    if arch == "llama":
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch in ("llama", "qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch in ("qwen2moe", "qwen3moe") or "num_local_experts" in config:   # Mixtral: llama
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "gpt-oss":
        w.add_expert_feed_forward_length(config["intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])   # control / normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tok_config["bos_token"]])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_unk_token_id(vocab[tok_config["unk_token"]])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
    matrix = GGMLQuantizationType[matrix_type]
    # a mixture's experts: each layer's gate, up and down of every expert in one tensor
    experts: dict[str, list] = {}
    tensors = {}
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        if arch == "gpt-oss" and ".experts." in name:
            tensors.update({k: ("", v) for k, v in _gpt_oss_experts(name, array).items()})
        elif ".experts." in name:   # Qwen's mlp.experts.E.gate_proj, Mixtral's w1...
            layer, rest = name.split(".")[2], name.split(".experts.")[1]
            index, kind = rest.split(".")[0], rest.split(".")[1].removesuffix("_proj")
            kind = MIXTRAL_EXPERTS.get(kind, kind)
            experts.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", []).append(
                (int(index), array))
        else:
            tensors[gguf_tensor_name(name, arch)] = (name, array)
    for gguf_name, parts in experts.items():
        tensors[gguf_name] = ("", np.stack([a for _, a in sorted(parts, key=lambda p: p[0])]))
    for gguf_name, (name, array) in tensors.items():
        array = array.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_rope_order(array, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_rope_order(array, config["num_key_value_heads"])
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            array = array + 1   # llama.cpp's converter stores Gemma's norms as 1 + weight
        # (rows whose length is not whole blocks stay F32, as llama.cpp's converter keeps
        # them in a type that takes them)
        kind = (GGMLQuantizationType[experts_type] if experts_type and "_exps." in gguf_name
                 else matrix)
        if (array.ndim >= 2 and kind != GGMLQuantizationType.F32
                and "ffn_gate_inp" not in gguf_name and not gguf_name.endswith(".bias")
                and array.shape[-1] % GGML_QUANT_SIZES[kind][0] == 0):
            w.add_tensor(gguf_name, quants.quantize(np.ascontiguousarray(array), kind),
                         raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
