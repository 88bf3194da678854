"""fp8 weights on the CUDA path (W8A8, e4m3; models/layers/fp8.py): the product
against its definition, an fp8 checkpoint's weights loaded as they are, --quantization
fp8 at load, and the engine's output against Hugging Face on the dequantized weights.
Without a GPU, through Triton's interpreter (torch's own _scaled_mm on the CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.kv_accuracy import teacher_forced
from common.config import CacheConfig, EngineConfig
from engine_worker.engine import LLMEngine
from engine_worker.models.layers.fp8 import Fp8Method, quantize_rows
from engine_worker.models.layers.linear import Linear
from fp8_checkpoints import dequantized, fp8_checkpoint
from helpers import greedy, random_prompts
from hf_reference import hf_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The model's dtype: on a GPU the products come out in bfloat16, as served
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"


def fp8_engine(model_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), device=DEVICE, dtype=DTYPE, attention_backend="triton",
        enforce_eager=True, cache=CacheConfig(block_size=4, num_blocks=128), **config))


def test_the_product_is_the_dequantized_one_of_tokens_quantized_per_row():
    torch.manual_seed(0)
    layer = Linear(64, (48, 16), True, Fp8Method())
    layer.weight = torch.nn.Parameter(torch.empty(64, 64, dtype=torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    w = torch.randn(64, 64)
    w[5] = 0.0   # a row of zeros keeps a finite scale
    layer.load(w)
    x = torch.randn(3, 7, 64) * torch.logspace(-3, 3, 7).view(1, 7, 1)
    y = layer(x)
    q, s = quantize_rows(x.reshape(-1, 64))
    weight = layer.weight.double() * layer.weight_scale.double().view(-1, 1)
    want = (q.double() * s.double()) @ weight.T + layer.bias.double()
    assert y.shape == (3, 7, 64)
    torch.testing.assert_close(y.reshape(-1, 64).double(), want, rtol=1e-4, atol=1e-5)
    assert torch.all(y[..., 5] == layer.bias[5])
    # the weight as quantized: within half of fp8's spacing of w (2^-4 of it; of the
    # smallest, subnormal spacing 2^-9 times the row's scale)
    scale = w.abs().amax(1, keepdim=True) / 448
    assert ((weight.float() - w).abs() <= w.abs() / 16 + scale * 2 ** -10 + 1e-7).all()


@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_an_fp8_checkpoints_weights_load_as_they_are(tiny_llama_dir, tmp_path, per_tensor):
    fp8 = fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", per_tensor=per_tensor)
    engine = fp8_engine(fp8)
    assert engine.runner.weight_format == "fp8"
    file = load_file(fp8 / "model.safetensors")
    qkv = engine.runner.model.layers[1].self_attn.qkv_proj
    parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    want = torch.cat([file[f"{p}.weight"] for p in parts])
    assert torch.equal(qkv.weight.cpu().view(torch.uint8), want.view(torch.uint8))
    scales = torch.cat([file[f"{p}.weight_scale"].float().reshape(-1).expand(
        file[f"{p}.weight"].shape[0]) for p in parts])
    assert torch.equal(qkv.weight_scale.cpu(), scales)
    assert engine.runner.model.lm_head.fmt == DTYPE   # (the checkpoint keeps it so)


def test_layers_an_fp8_checkpoint_left_unquantized_stay_dense(tiny_llama_dir, tmp_path):
    """FBGEMM's modules_to_not_convert, compressed-tensors' ignore list: a layer the
    checkpoint keeps in bf16 is served so, not quantized at load."""
    fp8 = fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", style="fbgemm")
    plain = load_file(tiny_llama_dir / "model.safetensors")
    tensors = load_file(fp8 / "model.safetensors")
    for name in [n for n in tensors if ".self_attn.o_proj." in n]:
        del tensors[name]
    for i in range(2):
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        tensors[name] = plain[name]
    save_file(tensors, fp8 / "model.safetensors")
    engine = fp8_engine(fp8)
    layer = engine.runner.model.layers[0].self_attn
    assert (layer.o_proj.fmt, layer.qkv_proj.fmt) == (DTYPE, "fp8")
    assert torch.equal(layer.o_proj.weight.cpu().float(),
                       plain["model.layers.0.self_attn.o_proj.weight"].float())
    assert len(engine.generate(random_prompts([5], seed=3), greedy(3))[0]) == 3


def test_dummy_weights_are_made_in_fp8(tiny_llama_dir):
    """--load-format dummy --quantization fp8 (a 70B shape on one GPU): each layer's
    random weight quantized as it is made, never whole in the model's dtype."""
    engine = fp8_engine(tiny_llama_dir, quantization="fp8", load_format="dummy")
    layer = engine.runner.model.layers[1].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    weight = layer.weight.float() * layer.weight_scale.view(-1, 1)
    assert 0.018 < float(weight.std()) < 0.022   # N(0, 0.02), as the dense dummy weights
    got = engine.generate(random_prompts([6], seed=1), greedy(4))
    assert len(got[0]) == 4


def test_quantization_fp8_at_load_makes_the_checkpoint_the_tools_make(tiny_llama_dir,
                                                                      tmp_path):
    """A row's scale its largest magnitude over 448, as llm-compressor's FP8-dynamic:
    the same weights, so the same tokens."""
    at_load = fp8_engine(tiny_llama_dir, quantization="fp8")
    saved = fp8_engine(fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8"))
    assert at_load.runner.weight_format == "fp8"
    prompts = random_prompts([9, 4, 13], seed=2)
    assert at_load.generate(prompts, greedy(5)) == saved.generate(prompts, greedy(5))


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_granite_dir", "tiny_phi4_mini_dir",
                                   "tiny_qwen2_dir", "tiny_mixtral_dir"])
def test_fp8_logits_are_hfs_with_the_same_roundings(model, request, tmp_path):
    """The engine on an fp8 checkpoint against HF float32 on the same weights
    dequantized, each quantized layer's input rounded to fp8 per token as ours are:
    the same numbers, but for the order of sums (and a rounding they tip). Granite's
    residual multiplier goes into the row scales, Phi-4-mini's partial RoPE reorders
    the rows of q and k with theirs, Qwen2's biases are added after the product.
    Mixtral's experts are fp8 in the grouped GEMM, widened there (weights only: their
    inputs are not rounded)."""
    fp8 = fp8_checkpoint(request.getfixturevalue(model), tmp_path / "fp8")
    plain = dequantized(fp8, tmp_path / "plain")
    prompts = random_prompts([24, 17], seed=6)
    # (a context of 64: Phi-4-mini's LongRoPE takes its short factors, as HF's does on
    # prompts this short)
    engine = fp8_engine(fp8, max_model_len=64)
    if model == "tiny_mixtral_dir":   # its experts fp8 in the grouped GEMM
        grouped = engine.runner.model.layers[0].mlp.grouped
        assert grouped.gate_up.dtype == torch.float8_e4m3fn
    ours = teacher_forced(engine, prompts)
    hf = hf_model(plain)
    quantized = {n.removesuffix(".weight_scale") for n in load_file(fp8 / "model.safetensors")
                 if n.endswith(".weight_scale") and ".experts." not in n}
    hooks = [m.register_forward_pre_hook(_round_input) for n, m in hf.named_modules()
             if n in quantized]
    try:
        with torch.no_grad():
            theirs = torch.cat([hf(torch.tensor([p])).logits[0, :-1].float() for p in prompts])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(hooks) == len(quantized)
    rel = float((ours - theirs).norm() / theirs.norm())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    # (HF unrounded is 0.06-0.19 away: tests/gpu/test_fp8.py's history)
    assert rel < 1e-2 and agree >= 0.97, (rel, agree)


def _round_input(module, args):
    x = args[0]
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
    return ((q.float() * s).view(x.shape).to(x.dtype),)
