"""fp8 checkpoints (compressed-tensors, FBGEMM) on the CPU: converted at load to the C
kernels' int8 (the packed panels are those of the same weights dequantized and
packed), or dequantized into float32 without the kernels, where the output is Hugging
Face's on the dequantized checkpoint token for token. (On CUDA they load as they are:
tests/gpu/test_fp8.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ModelLoadError
from engine_worker.models.layers.linear import Linear
from fp8_checkpoints import dequantized, fp8_checkpoint
from helpers import greedy, make_engine, random_prompts
from hf_reference import assert_matches, hf_greedy

STYLES = [("compressed-tensors", False), ("compressed-tensors", True), ("fbgemm", False)]


@pytest.fixture(scope="module", params=STYLES, ids=["channel", "tensor", "fbgemm"])
def fp8_llama(request, tiny_llama_dir, tmp_path_factory):
    style, per_tensor = request.param
    fp8 = fp8_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("fp8"), style, per_tensor)
    return fp8, dequantized(fp8, tmp_path_factory.mktemp("dequantized"))


def _packed(engine) -> list[torch.Tensor]:
    return [m.packed for m in engine.runner.model.modules() if isinstance(m, Linear)]


def test_an_fp8_checkpoint_serves_on_the_cpu_as_int8_of_its_weights(fp8_llama):
    fp8, plain = fp8_llama
    engine, reference = make_engine(fp8), make_engine(plain, quantization="int8")
    assert engine.runner.weight_format == "int8"
    for ours, theirs in zip(_packed(engine), _packed(reference), strict=True):
        assert torch.equal(ours, theirs)
    prompts = random_prompts([5, 11, 3], seed=4)
    assert engine.generate(prompts, greedy(6)) == reference.generate(prompts, greedy(6))


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_phi3_dir", "tiny_qwen2_dir",
                                   "tiny_mixtral_dir"])
def test_without_the_kernels_an_fp8_checkpoint_is_hfs_dequantized_one(model, request,
                                                                        tmp_path):
    """Fused q/k/v in the file (Phi-3), biases beside fp8 weights (Qwen2), experts
    (Mixtral)."""
    fp8 = fp8_checkpoint(request.getfixturevalue(model), tmp_path / "fp8")
    plain = dequantized(fp8, tmp_path / "plain")
    engine = make_engine(fp8, cpu_kernels=False)
    assert engine.runner.weight_format == "float32"
    prompts = random_prompts([6, 9], seed=5)
    assert_matches(engine.generate(prompts, greedy(6)), hf_greedy(plain, prompts, 6), "fp8")


def test_an_fp8_weight_without_its_scale_is_refused(tiny_llama_dir, tmp_path):
    fp8 = fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8")
    tensors = load_file(fp8 / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight is fp8 but the "
                                             r"checkpoint has no .*up_proj\.weight_scale"):
        make_engine(fp8)


def test_torchs_path_runs_fp8_products_on_the_cpu(tiny_llama_dir, tmp_path):
    """--quantization fp8 --no-cpu-kernels: W8A8 through torch's own fp8 products, the
    same arithmetic as CUDA's (for accuracy, not speed): the same tokens as an fp8
    checkpoint made by the tools' rule."""
    at_load = make_engine(tiny_llama_dir, cpu_kernels=False, quantization="fp8")
    saved = make_engine(fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8"), cpu_kernels=False,
                        quantization="fp8")
    assert at_load.runner.weight_format == "fp8"
    assert at_load.runner.model.lm_head.fmt == "float32"
    prompts = random_prompts([7, 12], seed=9)
    assert at_load.generate(prompts, greedy(5)) == saved.generate(prompts, greedy(5))
