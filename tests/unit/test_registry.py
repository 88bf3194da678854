"""The registry of architectures: what docs/architecture.md lists is what it serves,
each name is one spec, and our modules' names map to a checkpoint's and a GGUF file's
as the families say (models/names.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ModelLoadError
from engine_worker.models import registry
from engine_worker.models.gguf import GGUF_NAMES
from engine_worker.models.names import SPLIT, TensorNames

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_list_the_architectures_the_registry_serves():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert registry.table() in doc, ("docs/architecture.md's table of architectures differs "
                                     "from `python -m engine_worker.models.registry`'s")
    assert len(registry.supported()) == len(registry.ARCHITECTURES) + len(
        registry.LANGUAGE_MODELS)


def test_a_gguf_file_is_read_as_the_architecture_its_metadata_names():
    assert registry.gguf_architecture("a.gguf", {
        "general.architecture": "llama"}).name == "LlamaForCausalLM"
    assert registry.gguf_architecture("m.gguf", {
        "general.architecture": "llama", "llama.expert_count": 8}).name == "MixtralForCausalLM"
    assert registry.gguf_architecture("q.gguf", {
        "general.architecture": "qwen3moe"}).name == "Qwen3MoeForCausalLM"
    with pytest.raises(ModelLoadError, match=r"x\.gguf: roseserve serves GGUF files of the "
                                             r"llama, .* and gpt-oss architectures .*, not "
                                             r"'mamba'"):
        registry.gguf_architecture("x.gguf", {"general.architecture": "mamba"})


def test_checkpoint_names_follow_the_longest_rule_and_split_fused_layers():
    names = TensorNames(registry.architecture("MixtralForCausalLM").names, SPLIT)
    assert names("layers.3.self_attn.qkv_proj") == (
        ("layers.3.self_attn.q_proj", "layers.3.self_attn.k_proj",
         "layers.3.self_attn.v_proj"), ())
    assert names("layers.3.mlp.gate") == (("layers.3.block_sparse_moe.gate",), ())
    assert names("layers.3.mlp.experts.5.gate_up_proj") == (
        ("layers.3.block_sparse_moe.experts.5.w1",
         "layers.3.block_sparse_moe.experts.5.w3"), ())
    assert names("layers.0.input_layernorm.weight") == (("layers.0.input_layernorm.weight",), ())
    # Phi-3 keeps q/k/v fused, as we do
    phi3 = TensorNames(registry.architecture("Phi3ForCausalLM").names, SPLIT)
    assert phi3("layers.1.self_attn.qkv_proj") == (("layers.1.self_attn.qkv_proj",), ())


def test_gguf_names_leave_an_experts_index_over_for_its_rows():
    names = TensorNames(GGUF_NAMES, {})
    assert names("layers.2.mlp.experts.7.gate_up_proj") == (
        ("blk.2.ffn_gate_exps", "blk.2.ffn_up_exps"), (7,))
    assert names("layers.2.input_layernorm.weight") == (("blk.2.attn_norm.weight",), ())
    assert names("layers.2.self_attn.sinks") == (("blk.2.attn_sinks.weight",), ())
    assert names("embed_tokens.weight") == (("token_embd.weight",), ())
