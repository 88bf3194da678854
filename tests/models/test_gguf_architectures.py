"""GGUF files of each architecture served, as llama.cpp's converter lays them out
(tests/gguf_files.py writes them from the tiny Hugging Face models): the same greedy
tokens as the checkpoint (or Hugging Face), what each file's metadata says or leaves
out read as llama.cpp reads it, its RoPE scaling, and what is refused, by name. The
default model's own file and the formats: tests/models/test_gguf.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.errors import ModelLoadError
from common.model_files import resolve_model_dir
from common.tokenizer import context_length
from engine_worker.models.registry import read_config
from engine_worker.cpu import build
from gguf_files import gguf_from_hf
from helpers import greedy, make_engine
from hf_reference import assert_matches, hf_greedy


@pytest.mark.parametrize("arch, model, name", [
    ("llama", "tiny_llama_dir", ""), ("qwen2", "tiny_qwen2_dir", ""),
    ("qwen3", "tiny_qwen3_dir", ""),
    ("llama", "tiny_llama_dir", "mistral")])   # which transformers makes a Mistral config
def test_a_file_as_llama_cpp_converts_a_checkpoint_serves_what_the_checkpoint_does(
        arch, model, name, request, tmp_path):
    """A tiny Llama, a tiny Qwen2 (q/k/v biases, tied embeddings) and a tiny Qwen3 (q and
    k norms, head_dim 32 with 4 heads of a 64-wide model) written as llama.cpp's
    converter writes them (q and k rows in its RoPE order for llama only): the same
    weights, biases and norms included, and the same greedy tokens as the checkpoint's
    engine."""
    model_dir = request.getfixturevalue(model)
    path = gguf_from_hf(model_dir, tmp_path / f"{arch}.gguf", arch, name=name)
    folder = resolve_model_dir(str(path))
    served, config, _ = read_config(folder)
    assert config["model_type"] == (name or arch)
    assert served.name == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]
    ours, theirs = make_engine(folder), make_engine(model_dir)
    k = build.cpu_kernels()
    for a, b in zip(ours.runner.model.layers, theirs.runner.model.layers):
        qkv_a, qkv_b = a.self_attn.qkv_proj, b.self_attn.qkv_proj
        assert torch.equal(k.unpack(qkv_a.packed, qkv_a.out_features, qkv_a.in_features, "float32"),
                           k.unpack(qkv_b.packed, qkv_b.out_features, qkv_b.in_features, "float32"))
        assert (qkv_a.bias is None) == (arch != "qwen2")
        if arch == "qwen2":
            assert torch.equal(qkv_a.bias, qkv_b.bias)
        if arch == "qwen3":
            assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight)
            assert torch.equal(a.self_attn.k_norm.weight, b.self_attn.k_norm.weight)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_qwen3moe_file_serves_its_experts_as_they_are(tiny_qwen3_30b_a3b_dir, tmp_path):
    """llama.cpp's qwen3moe (Qwen3-30B-A3B): each layer's experts in three tensors of all
    of them (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router ffn_gate_inp F32.
    Each expert is read as its rows: an F32 file gives the checkpoint's tokens; a Q8_0
    file's experts are int8 weights equal to the file's own dequantization of their
    rows, and its router stays float32."""
    from gguf import quants

    from common.gguf_reader import GgufReader

    f32 = gguf_from_hf(tiny_qwen3_30b_a3b_dir, tmp_path / "moe.f32.gguf", "qwen3moe")
    folder = resolve_model_dir(str(f32))
    served, config, _ = read_config(folder)
    assert served.name == "Qwen3MoeForCausalLM"
    assert (config["moe_intermediate_size"], config["norm_topk_prob"]) == (32, True)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert make_engine(folder).generate(prompts, greedy(12)) == \
        make_engine(tiny_qwen3_30b_a3b_dir).generate(prompts, greedy(12))

    q8 = gguf_from_hf(tiny_qwen3_30b_a3b_dir, tmp_path / "moe.q8_0.gguf", "qwen3moe", "Q8_0")
    engine = make_engine(resolve_model_dir(str(q8)))
    tensors = {t.name: t for t in GgufReader(q8).tensors}
    k = build.cpu_kernels()

    def rows(name: str, expert: int) -> torch.Tensor:
        t = tensors[name]
        values = quants.dequantize(t.data, t.ggml_type).reshape(t.shape[::-1])[expert]
        return torch.from_numpy(np.array(values, dtype=np.float32))

    for i, layer in enumerate(engine.runner.model.layers):
        moe = layer.mlp
        assert moe.gate.fmt == "float32" and len(moe.experts) == 8
        for e, expert in enumerate(moe.experts):
            gate_up, down = expert.gate_up_proj, expert.down_proj
            assert (gate_up.fmt, down.fmt) == ("int8", "int8")
            assert torch.equal(k.unpack(gate_up.packed, 64, 64, "int8"), torch.cat([
                rows(f"blk.{i}.ffn_gate_exps.weight", e),
                rows(f"blk.{i}.ffn_up_exps.weight", e)]))
            assert torch.equal(k.unpack(down.packed, 64, 32, "int8"),
                               rows(f"blk.{i}.ffn_down_exps.weight", e))
    assert len(engine.generate(prompts, greedy(12))[1]) == 12


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("rope, arch, model_fixture", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64},   # long wavelengths at head_dim 16: scaled
     "llama", "tiny_llama_dir"),
    ({"rope_type": "linear", "factor": 4.0}, "llama", "tiny_llama_dir"),
    (YARN, "llama", "tiny_llama_dir"), (YARN, "qwen3moe", "tiny_qwen3_30b_a3b_dir")],
    ids=["llama3", "linear", "yarn", "yarn-qwen3moe"])
def test_a_files_rope_scaling_is_served_as_the_checkpoints(rope, arch, model_fixture, request,
                                                           tmp_path):
    """llama.cpp's converter stores Llama 3.1's RoPE scaling (Llama 3.2, 3.3) as a
    tensor of factors, rope_freqs.weight, and a linear one and YaRN (Qwen's long
    contexts) in the metadata; none reaches the config transformers reads from the file
    (they were left out: another frequency for most dimensions, at every position). A
    qwen3moe file's was looked up under transformers' name for it, qwen3_moe, and not
    found."""
    import shutil

    source = request.getfixturevalue(model_fixture)
    model = tmp_path / "scaled"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    path = gguf_from_hf(model, tmp_path / "scaled.gguf", arch)
    ours, theirs = make_engine(resolve_model_dir(str(path))), make_engine(model)
    inv_freq = theirs.runner.model.rotary.inv_freq
    plain = make_engine(source).runner.model.rotary.inv_freq
    assert not torch.allclose(inv_freq, plain)   # the scaling changes the frequencies
    torch.testing.assert_close(ours.runner.model.rotary.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.runner.model.rotary.scale == theirs.runner.model.rotary.scale
    assert ours.model_config.max_model_len == theirs.model_config.max_model_len
    # the tokenizer pool reads the context from the folder's config: YaRN's too
    assert context_length(resolve_model_dir(str(path))) == context_length(model)
    prompts = [[1, 2, 3, 4], list(range(100, 180))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_rope_scaling_not_served_is_refused_by_name(tiny_llama_dir, tmp_path):
    import shutil

    # Phi-3's LongRoPE picks its frequencies by the sequence's length
    model = tmp_path / "longrope"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    path = gguf_from_hf(model, tmp_path / "longrope.gguf", "llama")
    with pytest.raises(ModelLoadError, match="longrope.gguf: unsupported rope scaling "
                                             "'longrope'; supported: linear, yarn"):
        make_engine(resolve_model_dir(str(path)))


def test_a_yarn_file_with_fields_not_served_is_refused_by_name(tiny_llama_dir, tmp_path):
    """A YaRN file that sets its own attention factor: refused, not served with the
    factor the scaling implies."""
    from common.model_files import _yarn_parameters

    fields = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 256,
              "llama.rope.scaling.yarn_beta_fast": 16.0}
    assert _yarn_parameters("f.gguf", fields, "llama") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 16.0}
    with pytest.raises(ModelLoadError, match="f.gguf: YaRN scaling with attn_factor, "
                                             "yarn_log_multiplier is not served"):
        _yarn_parameters("f.gguf", {**fields, "llama.rope.scaling.attn_factor": 1.2,
                                    "llama.rope.scaling.yarn_log_multiplier": 0.1}, "llama")


def test_a_gemma3_file_serves_what_its_checkpoint_does(tiny_gemma3_six_dir, tmp_path):
    """llama.cpp's gemma3 (Gemma 3 270M to 27B, the language model): four norms a layer,
    stored as the 1 + weight they scale by; q and k normed per head; five sliding layers
    of six with a RoPE of their own, the full one's linearly scaled by the file's
    rope.scaling; tied embeddings scaled by sqrt(hidden); no query scale in the
    metadata (head_dim's, as llama.cpp takes it). An F32 file gives Hugging Face's
    greedy tokens for the checkpoint, past the window of 9; a Q8_0 file's matrices are
    int8 weights, its norms the file's."""
    from gguf import GGMLQuantizationType as T

    from common.gguf_reader import GgufReader

    f32 = gguf_from_hf(tiny_gemma3_six_dir, tmp_path / "gemma3.f32.gguf", "gemma3")
    folder = resolve_model_dir(str(f32))
    served, config, _ = read_config(folder)
    assert served.name == "Gemma3ForCausalLM"
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (16, 9)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_gemma3_six_dir, prompts, 12), "gemma3 gguf")

    q8 = gguf_from_hf(tiny_gemma3_six_dir, tmp_path / "gemma3.q8_0.gguf", "gemma3", "Q8_0")
    model = make_engine(resolve_model_dir(str(q8))).runner.model
    tensors = {t.name: t for t in GgufReader(q8).tensors}
    assert tensors["blk.0.attn_q.weight"].ggml_type == T.Q8_0
    for i, layer in enumerate(model.layers):
        assert (layer.self_attn.qkv_proj.fmt, layer.mlp.down_proj.fmt) == ("int8", "int8")
        for norm, name in ((layer.input_layernorm, "attn_norm"),
                           (layer.attn_out_norm, "post_attention_norm"),
                           (layer.post_attention_layernorm, "ffn_norm"),
                           (layer.mlp_out_norm, "post_ffw_norm")):
            stored = np.array(tensors[f"blk.{i}.{name}.weight"].data).view(np.float32)
            assert torch.equal(norm.weight, torch.from_numpy(stored.reshape(-1))), name


@pytest.mark.parametrize("model_fixture", ["tiny_phi3_dir", "tiny_phi4_mini_dir"])
def test_a_phi3_file_serves_what_its_checkpoint_does(model_fixture, request, tmp_path):
    """llama.cpp's phi3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): q/k/v and gate/up stored
    fused, as in the checkpoints; the sliding window (Phi-3-mini-4k's); LongRoPE's
    factors, tensors of their own, with the original context; RoPE over 3/4 of each
    head (Phi-4-mini's: q's and k's rows reordered at load as from a checkpoint). The
    engine serving the file gives the checkpoint's greedy tokens (a prompt of 70
    tokens, past LongRoPE's original 64)."""
    model_dir = request.getfixturevalue(model_fixture)
    path = gguf_from_hf(model_dir, tmp_path / "phi3.gguf", "phi3")
    folder = resolve_model_dir(str(path))
    ours, theirs = make_engine(folder), make_engine(model_dir)
    assert read_config(folder)[0].name == "Phi3ForCausalLM"
    for field in ("windows", "rotary_dim", "max_model_len", "tie_word_embeddings"):
        assert getattr(ours.model_config, field) == getattr(theirs.model_config, field), field
    # LongRoPE's factors and attention factor as the file holds them: float32
    mine, checkpoint = ours.model_config.rope, theirs.model_config.rope
    assert (mine.kind, mine.theta) == (checkpoint.kind, checkpoint.theta)
    assert mine.ext_factors == pytest.approx(checkpoint.ext_factors, rel=1e-7)
    assert mine.attention_factor == pytest.approx(checkpoint.attention_factor, rel=1e-7)
    if model_fixture == "tiny_phi3_dir":
        assert set(ours.model_config.windows) == {255}
    else:
        assert ours.model_config.rope.kind == "longrope" and ours.model_config.rotary_dim == 12
    prompts = [[1, 2, 3, 4], list(range(100, 170))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_gemma2_file_serves_what_its_checkpoint_does(tiny_gemma2_dir, tmp_path):
    """llama.cpp's gemma2 (Gemma 2 2B, 9B, 27B): Gemma 3's norms and scales without its q
    and k norms, every other layer sliding, and the soft caps of the scores and the
    logits, which its metadata holds: an F32 file gives Hugging Face's greedy tokens."""
    path = gguf_from_hf(tiny_gemma2_dir, tmp_path / "gemma2.gguf", "gemma2")
    folder = resolve_model_dir(str(path))
    served, config, _ = read_config(folder)
    assert served.name == "Gemma2ForCausalLM"
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (1.5, 2.5)
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (16, 9)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_gemma2_dir, prompts, 12), "gemma2 gguf")


def test_what_a_gemma_files_metadata_leaves_out_is_read_as_llama_cpp_reads_it():
    """The 27B models' query scale is hidden / heads, not head_dim (Gemma 3's 62 layers:
    168, not 128; Gemma 2's 46: 144); a file without a sliding window has none; a final
    logit soft cap in a gemma3 file is carried to the config, where it is refused."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, Gemma3TextConfig

    from engine_worker.models.config import ConfigSource
    from engine_worker.models.gemma import gguf_reading, read_gemma3

    def reading(config, arch: str, fields: dict) -> dict:
        return gguf_reading(arch)(config.to_dict(), SimpleNamespace(fields=fields))

    big = reading(Gemma3TextConfig(num_hidden_layers=62, hidden_size=5376,
                                   num_attention_heads=32, head_dim=128, sliding_window=1024),
                  "gemma3", {"gemma3.attention.sliding_window": 1024})
    assert (big["query_pre_attn_scalar"], big["sliding_window"]) == (168, 1024)
    big2 = reading(Gemma2Config(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32,
                                head_dim=128), "gemma2", {"gemma2.attention.sliding_window": 4096})
    assert big2["query_pre_attn_scalar"] == 144
    small = reading(Gemma3TextConfig(num_hidden_layers=26, hidden_size=1152,
                                     num_attention_heads=4, head_dim=256, sliding_window=512),
                    "gemma3", {"gemma3.final_logit_softcapping": 30.0})
    assert (small["query_pre_attn_scalar"], small["sliding_window"]) == (256, None)
    with pytest.raises(ModelLoadError, match="final_logit_softcapping is not supported for "
                                             "Gemma 3"):
        read_gemma3(ConfigSource(small, "small", ()))


def test_a_mixtral_file_serves_what_its_checkpoint_does(tiny_mixtral_dir, tmp_path):
    """llama.cpp stores Mixtral as llama with experts: q and k rows in its RoPE order,
    each layer's experts in three tensors of all of them, the router F32. It is read as
    Mixtral, and it gives the checkpoint's greedy tokens."""
    path = gguf_from_hf(tiny_mixtral_dir, tmp_path / "mixtral.gguf", "llama")
    folder = resolve_model_dir(str(path))
    served, config, _ = read_config(folder)
    assert served.name == "MixtralForCausalLM"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    engine = make_engine(folder)
    assert all(len(layer.mlp.experts) == 4 for layer in engine.runner.model.layers)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(engine.generate(prompts, greedy(12)),
                   hf_greedy(tiny_mixtral_dir, prompts, 12), "mixtral gguf")


def test_a_qwen2moe_file_serves_what_its_checkpoint_does(tiny_qwen2_moe_dir, tmp_path):
    """llama.cpp's qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, the experts
    in tensors of all of them, the shared expert and its sigmoid gate in tensors of
    their own, the experts' weights not renormalized: an F32 file gives Hugging Face's
    greedy tokens; a Q8_0 one packs the shared expert as int8, its gate float32."""
    path = gguf_from_hf(tiny_qwen2_moe_dir, tmp_path / "qwen2moe.gguf", "qwen2moe")
    folder = resolve_model_dir(str(path))
    served, config, _ = read_config(folder)
    assert served.name == "Qwen2MoeForCausalLM"
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
            config["norm_topk_prob"]) == (32, 48, False)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_qwen2_moe_dir, prompts, 12), "qwen2moe gguf")
    q8 = gguf_from_hf(tiny_qwen2_moe_dir, tmp_path / "qwen2moe.q8.gguf", "qwen2moe", "Q8_0")
    moe = make_engine(resolve_model_dir(str(q8))).runner.model.layers[0].mlp
    assert (moe.shared_expert.gate_up_proj.fmt, moe.shared_expert_gate.fmt,
            moe.gate.fmt) == ("int8", "float32", "float32")


def test_a_mixture_stored_an_expert_a_tensor_is_refused_by_name(tmp_path):
    """llama.cpp's first Mixtral files stored each expert's projections as tensors of
    their own (blk.N.ffn_gate.E.weight): refused as such, saying what to do, not as a
    file that lacks blk.0.ffn_gate_exps.weight."""
    from gguf import GGUFWriter

    from engine_worker.models.gguf import GgufWeights

    path = tmp_path / "mixtral.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mixtral.gguf is a mixture of experts \(8 "
                                             r"experts a layer\) that stores each expert as "
                                             r"tensors of its own .* convert its checkpoint "
                                             r"again"):
        GgufWeights(path, build.cpu_kernels())
