"""gpt-oss: its config read, its MXFP4 experts dequantized as transformers does, and a
checkpoint of MXFP4 experts served as its dequantized copy is (token for token against
Hugging Face: tests/models/test_engine_hf_parity.py)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from common.config import EngineConfig
from common.errors import ModelLoadError
from engine_worker.engine import LLMEngine
from engine_worker.models.registry import load_model_config
from engine_worker.models.checkpoint import mxfp4_to_float
from helpers import greedy, random_prompts, run_to_end
from hf_reference import assert_matches, hf_greedy
from moe_models import to_mxfp4


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # (3, 128, 10)
    assert torch.equal(mxfp4_to_float(blocks, scales), theirs.transpose(1, 2))
    w = torch.randn(5, 64, generator=g)
    rounded = mxfp4_to_float(*to_mxfp4(w))
    assert torch.equal(mxfp4_to_float(*to_mxfp4(rounded)), rounded)   # a fixed point
    assert 0 < float((rounded - w).abs().max()) < 0.5


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_mxfp4_experts_serve_as_their_dequantized_copy(tiny_gpt_oss_mxfp4_dirs, quantization,
                                                      caplog):
    """On the CPU kernels the checkpoint's MXFP4 experts stay MXFP4 whatever the other
    weights are packed as (their values exactly, 5 bits a weight), x multiplied as int8
    as it is for the integer formats: HF's greedy tokens on the dequantized copy (the
    other weights float32), but where that rounding makes a near tie. The log names
    the layers packed otherwise."""
    from engine_worker.cpu.build import cpu_kernels

    packed, plain = tiny_gpt_oss_mxfp4_dirs
    prompts = random_prompts([6, 19], seed=4)
    caplog.set_level(logging.INFO, logger="engine_worker.model_runner")
    engine = LLMEngine(EngineConfig(model=str(packed), device="cpu", quantization=quantization))
    # 2 layers: qkv, o, the router and 4 experts' gate_up and down each, and lm_head;
    # the routers float32 under int8
    others = ("2 in float32, 16 in mxfp4 of 23" if quantization else "16 in mxfp4 of 23")
    assert f"weights: {quantization or 'float32'} ({others} linear layers)" in caplog.text
    if quantization is None:
        assert_matches(engine.generate(prompts, greedy(8)), hf_greedy(plain, prompts, 8),
                       "mxfp4", near_tie=2e-3)
    moe = engine.runner.model.layers[1].mlp
    assert (moe.gate.fmt, moe.experts[0].down_proj.fmt) == ("float32", "mxfp4")
    assert engine.runner.model.layers[1].self_attn.o_proj.fmt == quantization or "float32"
    weights = load_file(plain / "model.safetensors")
    down = weights["model.layers.1.mlp.experts.down_proj"]
    for k, expert in enumerate(moe.experts):
        lin = expert.down_proj
        assert torch.equal(cpu_kernels().unpack(lin.packed, lin.out_features,
                                                lin.in_features, "mxfp4"), down[k].T)


def test_a_gguf_file_serves_what_its_checkpoint_does(tiny_gpt_oss_mxfp4_dirs, tmp_path,
                                                    monkeypatch):
    """llama.cpp's gpt-oss files: gate and up split apart, biases F32, the sinks a
    tensor of their own, the norm before the MLP named post_attention_norm, YaRN and
    the sliding window in the metadata. An F32 file gives Hugging Face's greedy tokens
    (the checkpoint's SwiGLU limit gpt-oss's 7, which llama.cpp takes as given and no
    file holds); in a file of MXFP4 experts, as the published ones are, every expert is
    packed as MXFP4 (0.56 of int8's bytes) and computes with exactly the checkpoint's
    weights (its experts MXFP4 values already), the same floats as those experts
    re-stored as Q8_0 (int8 levels of half the scale, exactly): the same integer
    products."""
    from common.model_files import resolve_model_dir
    from engine_worker.models import gguf, gguf_types
    from engine_worker.cpu.build import cpu_kernels
    from gguf_files import gguf_from_hf

    plain = tmp_path / "plain"
    shutil.copytree(tiny_gpt_oss_mxfp4_dirs[1], plain)
    raw = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**raw, "swiglu_limit": 7.0}))
    f32 = resolve_model_dir(str(gguf_from_hf(plain, tmp_path / "f32.gguf", "gpt-oss")))
    config = load_model_config(f32)
    assert (config.windows, config.attn_sinks, config.expert_intermediate_size,
            config.rope.truncate, config.rope.factor) == ((8, 0), True, 32, False, 4.0)
    prompts = random_prompts([6, 19], seed=4)
    engine = LLMEngine(EngineConfig(model=str(f32), device="cpu"))
    assert_matches(engine.generate(prompts, greedy(8)), hf_greedy(plain, prompts, 8),
                   "gpt-oss gguf")
    mxfp4 = gguf_from_hf(plain, tmp_path / "mxfp4.gguf", "gpt-oss", experts_type="MXFP4")
    mxfp4_dir = resolve_model_dir(str(mxfp4))
    engine = LLMEngine(EngineConfig(model=str(mxfp4_dir), device="cpu"))
    with monkeypatch.context() as m:   # as the file was served before MXFP4 panels
        m.delitem(gguf_types.GGUF_FORMATS, gguf_types.MXFP4)
        m.setattr(gguf, "restored_types", lambda: {gguf_types.MXFP4: (
            gguf_types.Q8_0, gguf_types.mxfp4_as_q8_0, "Q8_0, exactly")})
        as_q8_0 = LLMEngine(EngineConfig(model=str(mxfp4_dir), device="cpu"))
    assert as_q8_0.runner.model.layers[0].mlp.experts[0].down_proj.fmt == "int8"

    def outputs(e: LLMEngine) -> dict:
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, greedy(8, logprobs=3))
        return {r: [(o.new_token_ids, o.logprobs) for o in outs]
                for r, outs in run_to_end(e).items()}
    assert outputs(engine) == outputs(as_q8_0)
    model = engine.runner.model
    weights = load_file(plain / "model.safetensors")
    kernels = cpu_kernels()
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = weights[p + "gate_up_proj"], weights[p + "down_proj"]
        for k, expert in enumerate(model.layers[layer].mlp.experts):
            lin = expert.gate_up_proj
            # 320 bytes a panel's block of 32 inputs: 16 x 32 nibbles, 16 float scales
            assert lin.fmt == "mxfp4" and \
                lin.packed.numel() == lin.out_features // 16 * lin.in_features // 32 * 320
            got = kernels.unpack(lin.packed, lin.out_features, lin.in_features, lin.fmt)
            assert torch.equal(got, torch.cat([gate_up[k, :, 0::2].T, gate_up[k, :, 1::2].T]))
            lin = expert.down_proj
            got = kernels.unpack(lin.packed, lin.out_features, lin.in_features, lin.fmt)
            assert torch.equal(got, down[k].T)
            assert torch.equal(lin.bias, weights[p + "down_proj_bias"][k])


def test_gpt_oss_config(tiny_gpt_oss_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = load_model_config(tiny_gpt_oss_dir)
    assert (config.attn_sinks, config.expert_bias, config.swiglu_limit, config.windows,
            config.moe_layers, config.intermediate_size, config.architecture) == (
        True, True, 0.5, (8, 0), (0, 1), 0, "GptOssForCausalLM")
    # parameters as transformers counts them, less the norms, biases and sinks
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss_dir)
    small = sum(p.numel() for n, p in model.named_parameters()
                if "norm" in n or n.endswith(("bias", "sinks")))
    assert config.num_params == sum(p.numel() for p in model.parameters()) - small
    # the published configs: experts_per_token, no layer_types (alternating, sliding
    # first); a quantization other than MXFP4 is refused
    raw = json.loads((tiny_gpt_oss_dir / "config.json").read_text())
    shutil.copytree(tiny_gpt_oss_dir, tmp_path / "m")
    del raw["num_experts_per_tok"], raw["layer_types"]
    raw["experts_per_token"] = 2
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    assert load_model_config(tmp_path / "m").windows == (8, 0)
    raw["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="MXFP4, not 'bitsandbytes'"):
        load_model_config(tmp_path / "m")


def test_gpt_oss_int8_experts_keep_biases_and_a_float32_router(tiny_gpt_oss_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_gpt_oss_dir), device="cpu",
                                    quantization="int8"))
    moe = engine.runner.model.layers[0].mlp
    assert (moe.gate.fmt, moe.experts[3].down_proj.fmt) == ("float32", "int8")
    assert moe.gate.bias is not None and moe.experts[3].down_proj.bias is not None
    assert len(engine.generate(random_prompts([7], seed=2), greedy(5))[0]) == 5
