"""Reading checkpoints: supported architectures, and clear errors for everything else."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from common.config import EngineConfig
from common.errors import ModelLoadError
from common.model_files import resolve_model_dir
from engine_worker.engine import LLMEngine
from engine_worker.models.layers.rotary import rope_inv_freq
from engine_worker.models.registry import load_model_config
from engine_worker.models.rope import RopeConfig


def copy_model(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_configs_of_supported_families(tiny_llama_dir, tiny_qwen2_dir, tiny_gpt2_dir):
    llama = load_model_config(tiny_llama_dir)
    assert (llama.architecture, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (
        "LlamaForCausalLM", 4, 2, 16)
    assert not llama.tie_word_embeddings and not llama.qkv_bias
    assert llama.eos_token_ids == (50256,)
    qwen = load_model_config(tiny_qwen2_dir)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.rope.theta == 1000000.0
    gpt2 = load_model_config(tiny_gpt2_dir)
    assert (gpt2.architecture, gpt2.max_model_len, gpt2.rope) == ("GPT2LMHeadModel", 512, None)


def test_unsupported_architecture_names_it(tiny_llama_dir, tmp_path):
    model = copy_model(tiny_llama_dir, tmp_path)
    edit_config(model, architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['BertForMaskedLM'\].*"
                                             r"supported: GPT2LMHeadModel, Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                             r"Gemma3ForConditionalGeneration, "
                                             r"GptOssForCausalLM, GraniteForCausalLM, "
                                             r"LlamaForCausalLM"):
        load_model_config(model)


def test_unsupported_rope_type_names_it(tiny_llama_dir, tmp_path):
    # dynamic NTK rescales by each sequence's length
    model = copy_model(tiny_llama_dir, tmp_path)
    edit_config(model, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                        "factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported rope type 'dynamic'; supported: "
                                             "default, linear, llama3, yarn, longrope"):
        load_model_config(model)


def test_a_partial_rotary_width_it_cannot_turn_is_refused(tiny_phi3_dir, tmp_path):
    model = copy_model(tiny_phi3_dir, tmp_path)
    edit_config(model, partial_rotary_factor=0.2, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.2 turns 3 of 16 "
                                             "dimensions a head; it must be an even"):
        load_model_config(model)


def test_longrope_takes_its_factors_by_the_context_served(tiny_phi4_mini_dir, tmp_path):
    """vLLM's choice, made once: long factors when the context served is longer than the
    original one, else short; the attention factor from the model's context over the
    original one, as transformers computes it."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(tiny_phi4_mini_dir)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=65)
    for served, want in ((None, long), (65, long), (64, short), (16, short)):
        config = load_model_config(tiny_phi4_mini_dir, max_model_len=served)
        assert config.rotary_dim == 12 and config.max_model_len == 256
        torch.testing.assert_close(rope_inv_freq(config.rope, 12), want, rtol=1e-6, atol=0)
        assert config.rope.attention_factor == pytest.approx(factor, rel=1e-12)
    model = copy_model(tiny_phi4_mini_dir, tmp_path)
    raw = json.loads((model / "config.json").read_text())
    edit_config(model, rope_parameters={**raw["rope_parameters"], "long_factor": [1.0] * 8})
    with pytest.raises(ModelLoadError, match="longrope's long_factor must be 6 positive "
                                             "numbers"):
        load_model_config(model)
    # Phi-3's first configs name it "su", under rope_scaling
    rope = raw["rope_parameters"]
    edit_config(model, rope_parameters={"rope_theta": 1e4}, rope_scaling={
        "type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]})
    assert load_model_config(model).rope.kind == "longrope"


def test_smollm3s_layers_without_rope(tiny_smollm3_dir, tmp_path):
    assert load_model_config(tiny_smollm3_dir).nope_layers == (1,)
    model = copy_model(tiny_smollm3_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    del config["no_rope_layers"], config["no_rope_layer_interval"]
    config["num_hidden_layers"] = 8           # SmolLM3-3B's rule: every fourth
    (model / "config.json").write_text(json.dumps(config))
    assert load_model_config(model).nope_layers == (3, 7)
    edit_config(model, no_rope_layers=[1, 0, 1])
    with pytest.raises(ModelLoadError, match="no_rope_layers must be 8 flags of 0 or 1"):
        load_model_config(model)


def test_gemma3s_config_in_both_spellings(tiny_gemma3_dir, tmp_path):
    """transformers 5 writes rope_parameters keyed by layer type and layer_types; the
    checkpoints published with Gemma 3 have rope_theta, rope_scaling,
    rope_local_base_freq and sliding_window_pattern: the same model either way."""
    new = load_model_config(tiny_gemma3_dir)
    assert new.windows == (9, 9, 0) and new.norm_offset and new.sandwich_norms
    assert new.qk_norm and new.hidden_act == "gelu_pytorch_tanh" and new.tie_word_embeddings
    assert (new.rope.kind, new.rope.factor, new.rope.theta) == ("linear", 8.0, 1e6)
    assert (new.rope_local.kind, new.rope_local.theta) == ("default", 1e4)
    assert new.embedding_multiplier == 8.0 and new.attention_multiplier == 24 ** -0.5
    model = copy_model(tiny_gemma3_dir, tmp_path)
    raw = json.loads((model / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "tie_word_embeddings"):
        del raw[key]
    raw.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=1e4, sliding_window_pattern=3)
    (model / "config.json").write_text(json.dumps(raw))
    assert load_model_config(model) == dataclasses.replace(new, name="model")
    edit_config(model, final_logit_softcapping=30.0)
    with pytest.raises(ModelLoadError, match="final_logit_softcapping is not supported"):
        load_model_config(model)


def test_a_multimodal_gemma3s_language_model_is_served_by_either_naming(
        tiny_gemma3_vision_dir, tmp_path):
    """Its tensors named as the published checkpoints name them (language_model.model.*,
    vision_tower.*) or as transformers names them in memory (model.language_model.*,
    model.vision_tower.*): the same model, the vision tower not read."""
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_gemma3_vision_dir, tmp_path)
    weights = load_file(model / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in weights)
    renamed = {("model.language_model." + k.removeprefix("language_model.model.")
                if k.startswith("language_model.model.") else "model." + k): v
               for k, v in weights.items()}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in renamed
    assert "model.vision_tower.embeddings.patch_embedding.weight" in renamed
    save_file(renamed, model / "model.safetensors")
    prompts = [[1, 2, 3], list(range(100, 130))]
    from helpers import greedy
    ours = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    reference = LLMEngine(EngineConfig(model=str(tiny_gemma3_vision_dir), device="cpu"))
    assert ours.generate(prompts, greedy(6)) == reference.generate(prompts, greedy(6))


def test_mixtures_of_experts_configs(tiny_mixtral_dir, tiny_qwen3_moe_dir, tiny_qwen2_moe_dir,
                                     tmp_path):
    from transformers import AutoModelForCausalLM

    mixtral = load_model_config(tiny_mixtral_dir)
    assert (mixtral.moe_layers, mixtral.num_experts, mixtral.experts_per_token,
            mixtral.expert_intermediate_size, mixtral.norm_topk) == ((0, 1), 4, 2, 128, True)
    qwen = load_model_config(tiny_qwen3_moe_dir)
    assert (qwen.moe_layers, qwen.num_experts, qwen.experts_per_token, qwen.norm_topk,
            qwen.qk_norm) == ((0, 2), 8, 2, False, True)
    # parameters as transformers counts them, less the norms and biases; per token, the
    # k experts
    qwen2 = load_model_config(tiny_qwen2_moe_dir)
    assert (qwen2.shared_expert_size, qwen2.qkv_bias, qwen2.norm_topk) == (48, True, False)
    for config, folder in ((mixtral, tiny_mixtral_dir), (qwen, tiny_qwen3_moe_dir),
                           (qwen2, tiny_qwen2_moe_dir)):
        model = AutoModelForCausalLM.from_pretrained(folder)
        norms = sum(p.numel() for n, p in model.named_parameters()
                    if "norm" in n or n.endswith("bias"))
        assert config.num_params == sum(p.numel() for p in model.parameters()) - norms
        assert config.flops_per_token < 2 * config.num_params
    # quantized, the experts are int8 and the routers stay float32
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_moe_dir), device="cpu",
                                    quantization="int8"))
    moe = engine.runner.model.layers[0].mlp
    assert (moe.gate.fmt, moe.experts[5].gate_up_proj.fmt) == ("float32", "int8")
    model = copy_model(tiny_qwen3_moe_dir, tmp_path)
    edit_config(model, num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9 must be from 1 to the 8"):
        load_model_config(model)


@pytest.mark.parametrize("change, error", [
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types must name each of the 3 layers"),
], ids=["activation", "bidirectional", "softcapping", "layer-types"])
def test_what_the_new_architectures_do_not_serve_is_refused_by_name(
        tiny_gemma3_dir, tmp_path, change, error):
    model = copy_model(tiny_gemma3_dir, tmp_path)
    raw = json.loads((model / "config.json").read_text())
    if "hidden_act" in change:   # Gemma's config names it hidden_activation
        del raw["hidden_activation"]
    raw.update(change)
    (model / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=error):
        load_model_config(model)


def test_gemma2s_config_is_read_as_transformers_reads_it(tiny_gemma2_dir, tmp_path):
    """Its two soft caps; every other layer sliding (layer_types, or in older configs
    none: every second layer full); the one RoPE; a cap that is not a positive number
    is refused."""
    config = load_model_config(tiny_gemma2_dir)
    assert (config.attn_softcap, config.logit_softcap) == (1.5, 2.5)
    assert config.windows == (9, 0, 9, 0) and config.rope_local is None
    assert not config.qk_norm and config.norm_offset and config.sandwich_norms
    model = copy_model(tiny_gemma2_dir, tmp_path)
    edit_config(model, layer_types=None)
    assert load_model_config(model).windows == (9, 0, 9, 0)
    edit_config(model, attn_logit_softcapping=-1.0)
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping must be a positive "
                                             "number, not -1.0"):
        load_model_config(model)


def test_a_multimodal_config_without_text_config_is_refused(tiny_gemma3_vision_dir, tmp_path):
    model = copy_model(tiny_gemma3_vision_dir, tmp_path)
    raw = json.loads((model / "config.json").read_text())
    del raw["text_config"]
    (model / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration's config has "
                                             "no text_config"):
        load_model_config(model)


def test_configs_of_granite_and_phi3(tiny_granite_dir, tiny_phi3_dir, tmp_path):
    granite = load_model_config(tiny_granite_dir)
    assert (granite.embedding_multiplier, granite.attention_multiplier,
            granite.residual_multiplier, granite.logits_scaling) == (12.0, 0.09, 0.22, 16.0)
    assert granite.architecture == "GraniteForCausalLM" and granite.tie_word_embeddings
    phi3 = load_model_config(tiny_phi3_dir)
    assert phi3.architecture == "Phi3ForCausalLM" and phi3.attention_multiplier is None
    assert phi3.max_model_len == 512 and phi3.windows == (255, 255)
    model = copy_model(tiny_granite_dir, tmp_path)
    edit_config(model, logits_scaling=0)
    with pytest.raises(ModelLoadError, match="logits_scaling must be a positive number, not 0"):
        load_model_config(model)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 32768},          # Qwen2.5/3's docs
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},          # DeepSeek's
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},                               # gpt-oss's
    {"factor": 2.0, "attention_factor": 1.25},
], ids=["qwen", "deepseek", "untruncated", "attention-factor"])
def test_yarn_matches_transformers(params):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine_worker.models.rope import rope_config

    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, **params}
    hf_config = Qwen2Config(hidden_size=1024, num_attention_heads=8, rope_parameters=rope,
                            max_position_embeddings=32768)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    ours = rope_config({"rope_parameters": rope, "max_position_embeddings": 32768})
    torch.testing.assert_close(rope_inv_freq(ours, 128), want.float(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(want_factor, rel=1e-12)
    assert ours.attention_factor != 1.0


def test_yarn_extends_the_context(tiny_yarn_dir, tmp_path):
    # the original context times the factor, as vLLM reads it: Qwen3's 40,960 positions
    # with the factor 4 over 32,768 that its docs give are 131,072
    assert load_model_config(tiny_yarn_dir).max_model_len == 4 * 128
    model = copy_model(tiny_yarn_dir, tmp_path)
    edit_config(model, max_position_embeddings=40960, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 32768})
    assert load_model_config(model).max_model_len == 131072
    edit_config(model, max_position_embeddings=40960, rope_parameters={"rope_theta": 1e6},
                rope_scaling={"type": "yarn", "factor": 2.0})    # the old spelling
    config = load_model_config(model)
    assert (config.rope.kind, config.max_model_len) == ("yarn", 81920)


def test_missing_files_are_named(tiny_llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match=r"'llama-3-9b' does not exist \(nor is it a "
                       r"model shape shipped for --load-format dummy: .*llama-3-8b"):
        resolve_model_dir("llama-3-9b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))
    model = copy_model(tiny_llama_dir, tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no model.safetensors"):
        LLMEngine(EngineConfig(model=str(model), device="cpu"))


def test_missing_config_field_is_named(tiny_llama_dir, tmp_path):
    model = copy_model(tiny_llama_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="lacks the field 'num_hidden_layers'"):
        load_model_config(model)


def test_missing_and_misshapen_tensors_are_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_llama_dir, tmp_path)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks tensor 'layers.1.mlp.up_proj.weight'"):
        LLMEngine(EngineConfig(model=str(model), device="cpu"))
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'layers.1.mlp.up_proj.weight' has shape \(3, 3\)"):
        LLMEngine(EngineConfig(model=str(model), device="cpu"))


def test_sharded_checkpoint_loads(tiny_gpt2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_gpt2_dir, tmp_path)
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"a.safetensors": names[:len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, model / shard)
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    reference = LLMEngine(EngineConfig(model=str(tiny_gpt2_dir), device="cpu"))
    from helpers import greedy

    assert engine.generate([[1, 2, 3]], greedy(5)) == reference.generate([[1, 2, 3]], greedy(5))


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=params,
                            max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(RopeConfig(theta=500000.0, kind="llama3", factor=8.0,
                                    original_max_position_embeddings=8192), 64)
    assert torch.allclose(ours, want.float(), rtol=1e-6)


def test_sliding_windows_per_layer(tiny_llama_dir, tiny_qwen2_sliding_dir, tmp_path):
    """Mistral slides in every layer; Qwen2 only with use_sliding_window, in the layers
    layer_types names (or from max_window_layers on); a window as long as the context is
    none; the context is the model's, not the window's."""
    model = copy_model(tiny_llama_dir, tmp_path)
    edit_config(model, architectures=["MistralForCausalLM"], model_type="mistral",
                sliding_window=128)
    config = load_model_config(model)
    assert (config.windows, config.max_model_len) == ((128, 128), 512)
    edit_config(model, sliding_window=512)
    assert load_model_config(model).windows == ()
    edit_config(model, sliding_window=-3)
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer"):
        load_model_config(model)
    assert load_model_config(tiny_qwen2_sliding_dir).windows == (0, 11)
    qwen = copy_model(tiny_qwen2_sliding_dir, tmp_path / "q")
    raw = json.loads((qwen / "config.json").read_text())
    del raw["layer_types"]
    raw["max_window_layers"] = 0
    (qwen / "config.json").write_text(json.dumps(raw))
    assert load_model_config(qwen).windows == (11, 11)
    edit_config(qwen, use_sliding_window=False)
    assert load_model_config(qwen).windows == ()


@pytest.mark.parametrize("folder", ["tiny_llama_dir", "default_model_dir", "gguf"])
def test_the_frontends_tokenizer_is_the_one_transformers_wraps(request, folder):
    """The frontend reads tokenizer.json and the chat templates without transformers:
    the same Rust tokenizer (every setting, every added token) and the same template
    text as transformers' fast tokenizer, which the tokenizer pool encodes with."""
    from common.model_files import _find_gguf, materialize_gguf_folder
    from common.tokenizer import chat_template_text, load_decoder, load_tokenizer

    d = (materialize_gguf_folder(_find_gguf()) if folder == "gguf"
         else request.getfixturevalue(folder))
    hf = load_tokenizer(d)
    assert load_decoder(d).to_str() == hf.backend_tokenizer.to_str()
    assert chat_template_text(d) == hf.chat_template and hf.chat_template


def test_chat_templates_are_read_from_everywhere_transformers_keeps_them(tmp_path):
    from common.tokenizer import chat_template_text

    assert chat_template_text(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]}))
    assert chat_template_text(tmp_path) == "A\nB"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("C")
    (tmp_path / "chat_template.jinja").write_text("D")
    assert chat_template_text(tmp_path) == "D\nC\nA\nB"
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json is not a JSON object"):
        chat_template_text(tmp_path)


def test_a_folder_without_tokenizer_json_is_named(tmp_path):
    from common.tokenizer import load_decoder

    with pytest.raises(ModelLoadError, match="no fast tokenizer"):
        load_decoder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_decoder(tmp_path)


def test_a_generic_fast_tokenizer_loads_without_torch_and_others_through_autotokenizer(
        tiny_llama_dir, tmp_path):
    """The tiny models' tokenizer is saved as transformers' generic fast class: the
    tokenizer workers load it without importing torch (2 s of their start). A folder
    naming a class of its own gets that class, as AutoTokenizer picks it."""
    import subprocess
    import sys

    from common.tokenizer import load_tokenizer

    assert json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())[
        "tokenizer_class"] == "TokenizersBackend"
    code = ("import sys; from pathlib import Path; from common.tokenizer import load_tokenizer; "
            f"t = load_tokenizer(Path({str(tiny_llama_dir)!r})); "
            "print(type(t).__name__, t.encode('hello world'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")[-2]
    assert out == "TokenizersBackend [31373, 995] False"
    qwen = tmp_path / "qwen"
    shutil.copytree(tiny_llama_dir, qwen)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps(
        {**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(qwen)).__name__ == "Qwen2Tokenizer"


def test_building_an_engine_imports_neither_torchs_compiler_nor_sympy(tiny_llama_dir):
    """Building a model on the meta device and giving it memory through torch's Python
    reference ops (nn.Embedding's random init, nn.Module.to_empty) imported
    torch._dynamo, torch.fx and sympy: 1.5 s of every engine start."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); from pathlib import Path; "
            "from helpers import make_engine; "
            f"make_engine(Path({str(tiny_llama_dir)!r})); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'torch.fx.experimental."
            "symbolic_shapes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")[-2]
    assert out == "[]"


def test_each_layer_is_packed_before_the_next_is_read(tiny_qwen3_moe_dir, monkeypatch):
    """On the CPU a layer's linear layers are packed as soon as its weights are in, so
    a checkpoint's float32 weights never stand whole in memory (a 30B mixture's would
    take 120 GB): when any tensor of layer i is read, every layer before it computes
    from packed weights, and none of its own or later ones do yet."""
    from engine_worker.models.checkpoint import Checkpoint
    from engine_worker.models.layers.decoder import DecoderModel
    from engine_worker.models.layers.linear import Linear

    built, seen = [], []
    build, take = DecoderModel.__init__, Checkpoint.take

    def remember(self, *args, **kwargs):
        build(self, *args, **kwargs)
        built.append(self)

    def watched(self, name, shape=None):
        if name.startswith("layers."):
            index, layers = int(name.split(".")[1]), built[0].layers
            packed = [all(hasattr(m, "packed") for m in layer.modules()
                          if isinstance(m, Linear)) for layer in layers]
            seen.append(packed == [i < index for i in range(len(layers))])
        return take(self, name, shape)

    monkeypatch.setattr(DecoderModel, "__init__", remember)
    monkeypatch.setattr(Checkpoint, "take", watched)
    LLMEngine(EngineConfig(model=str(tiny_qwen3_moe_dir), device="cpu", quantization="int8"))
    assert len(seen) > 50 and all(seen)


def test_a_checkpoint_with_ropes_buffers_loads_and_reads_none_of_them(tiny_llama_dir, tmp_path):
    """Checkpoints saved by transformers before 4.31 (Llama 2's conversions) hold each
    layer's self_attn.rotary_emb.inv_freq: nothing reads it (the frequencies come from
    the config), and the checkpoint is served as without it."""
    from safetensors.torch import load_file, save_file

    from helpers import greedy

    model = copy_model(tiny_llama_dir, tmp_path)
    weights = load_file(model / "model.safetensors")
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, model / "model.safetensors")
    prompts = [[1, 2, 3], list(range(100, 120))]
    ours = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    reference = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu"))
    assert ours.generate(prompts, greedy(6)) == reference.generate(prompts, greedy(6))


def test_a_mixtral_checkpoint_is_served_by_either_naming_of_its_experts(tiny_mixtral_dir,
                                                                          tmp_path):
    """Mixtral's experts as its checkpoints name them (block_sparse_moe.experts.N.w1, w3,
    w2) or as Hugging Face's Llama-style ones do (mlp.experts.N.gate_proj, up_proj,
    down_proj; the router mlp.gate): the same model."""
    from safetensors.torch import load_file, save_file

    from helpers import greedy

    model = copy_model(tiny_mixtral_dir, tmp_path)
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    renamed = {}
    for name, tensor in load_file(model / "model.safetensors").items():
        parts = name.replace("block_sparse_moe", "mlp").split(".")
        renamed[".".join(names.get(p, p) for p in parts)] = tensor
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in renamed
    save_file(renamed, model / "model.safetensors")
    prompts = [[1, 2, 3], list(range(100, 130))]
    ours = LLMEngine(EngineConfig(model=str(model), device="cpu"))
    reference = LLMEngine(EngineConfig(model=str(tiny_mixtral_dir), device="cpu"))
    assert ours.generate(prompts, greedy(6)) == reference.generate(prompts, greedy(6))
