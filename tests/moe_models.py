"""The tiny mixtures of experts (Mixtral, Qwen2/3-MoE, gpt-oss, gpt-oss's MXFP4
checkpoints) as session fixtures, and MXFP4 rounding; imported by tests/conftest.py,
whose builders they use (_tiny, _save)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_worker.models.checkpoint import FP4_E2M1, mxfp4_to_float


def _random_routers(model_dir: Path) -> Path:
    """The routers' weights drawn at random (Qwen3-MoE's start at 0: every expert tied)."""
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(18)
    for name, tensor in weights.items():
        if name.endswith(".gate.weight"):
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> Path:
    """Mixtral: every layer's MLP 4 experts, 2 of them a token."""
    from conftest import _tiny

    return _random_routers(_tiny(
        tmp_path_factory, "tiny-mixtral", 19, "MixtralConfig", "MixtralForCausalLM",
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    """Qwen3-MoE: q and k normed per head; 3 layers, the second dense (mlp_only_layers);
    8 experts of 32, 2 a token, their weights not renormalized (norm_topk_prob false,
    as Qwen1.5-MoE's)."""
    from conftest import _tiny

    return _random_routers(_tiny(
        tmp_path_factory, "tiny-qwen3-moe", 20, "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory) -> Path:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, 4 experts of 32 (2 a
    token, not renormalized) and a shared expert of 48 gated by a sigmoid."""
    from conftest import _tiny

    return _random_routers(_tiny(
        tmp_path_factory, "tiny-qwen2-moe", 23, "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False))


@pytest.fixture(scope="session")
def tiny_qwen3_30b_a3b_dir(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's kind of mixture (every layer's MLP experts, the chosen ones'
    weights renormalized), as llama.cpp's qwen3moe files hold it: 8 experts, 2 a token."""
    from conftest import _tiny

    return _random_routers(_tiny(
        tmp_path_factory, "tiny-qwen3-30b-a3b", 22, "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False))


GPT_OSS_TINY = dict(
    head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    swiglu_limit=0.5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "original_max_position_embeddings": 128, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False})


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory) -> Path:
    """gpt-oss: a sliding layer (8 keys) then a full one, each head's sink logit, YaRN
    (unclamped ramp), q/k/v/o biases; 4 experts of 32 with biases, 2 a token, the
    router's softmax over the chosen logits; the clamped SwiGLU at a limit of 0.5 (7
    in the published models: random weights would never reach it). Sinks, routers and
    biases drawn at random (transformers starts biases at 0)."""
    from conftest import _tiny

    model_dir = _tiny(tmp_path_factory, "tiny-gpt-oss", 24, "GptOssConfig",
                      "GptOssForCausalLM", **GPT_OSS_TINY)
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(25)
    for name, tensor in weights.items():
        if name.endswith(("sinks", "bias", "router.weight")):
            weights[name] = torch.randn(tensor.shape, generator=generator) * (
                1.0 if name.endswith(("sinks", "router.weight")) else 0.1)
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) float -> MXFP4 blocks (..., K / 32, 16) uint8 and scales (..., K / 32)
    uint8: each block of 32 scaled by the power of two that brings its largest
    magnitude within 6, each element rounded to the nearest FP4 value."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    x = blocks / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_E2M1[:8])
    code = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) + 8 * (x < 0)
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exponent[..., 0] + 127).to(torch.uint8)


@pytest.fixture(scope="session")
def tiny_gpt_oss_chat_dir(tmp_path_factory) -> Path:
    """The tiny gpt-oss's shape with harmony's tags as special tokens, a template that
    writes harmony and <|return|> and <|call|> among its stop tokens: gpt-oss as its
    chat is served."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from conftest import EOS, HARMONY_TAGS, HARMONY_TEMPLATE, TINY, _save

    torch.manual_seed(27)
    config = GptOssConfig(**{**TINY, **GPT_OSS_TINY, "vocab_size": 50257 + len(HARMONY_TAGS)})
    model_dir = _save(GptOssForCausalLM(config).eval(), tmp_path_factory.mktemp("oss-chat"),
                      template=HARMONY_TEMPLATE, special=HARMONY_TAGS)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [EOS, 50261, 50262]}))
    return model_dir


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4_dirs(tiny_gpt_oss_dir, tmp_path_factory):
    """The tiny gpt-oss with its experts rounded to MXFP4: as the published checkpoints
    hold them (blocks and scales of (E, out, in), quantization_config mxfp4), and
    dequantized as transformers holds them ((E, in, out) float32)."""
    packed, plain = tmp_path_factory.mktemp("oss-mxfp4"), tmp_path_factory.mktemp("oss-plain")
    for folder in (packed, plain):
        shutil.copytree(tiny_gpt_oss_dir, folder, dirs_exist_ok=True)
    weights = load_file(tiny_gpt_oss_dir / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = to_mxfp4(tensor.transpose(1, 2))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = mxfp4_to_float(blocks, scales).transpose(1, 2).contiguous()
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    return packed, plain
