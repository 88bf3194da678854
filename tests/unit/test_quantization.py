"""A checkpoint's own quantization read from its config (models/quantization.py), and
the formats each platform makes of it and of --quantization fp8."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import EngineConfig
from common.errors import ModelLoadError
from common.model_files import resolve_model_dir
from engine_worker.cpu.platform import CpuPlatform
from engine_worker.models.layers.linear import Role
from engine_worker.models.quantization import checkpoint_format
from engine_worker.models.registry import load_model_config
from fp8_checkpoints import _config


@pytest.mark.parametrize("style,per_tensor", [("compressed-tensors", False),
                                              ("compressed-tensors", True),
                                              ("fbgemm", False)])
def test_fp8_checkpoints_configs_read_as_fp8(style, per_tensor):
    assert checkpoint_format({"quantization_config": _config(style, per_tensor)}) == "fp8"


def test_no_quantization_or_gpt_oss_mxfp4_is_no_format_of_its_own():
    assert checkpoint_format({}) == ""
    assert checkpoint_format({"quantization_config": {"quant_method": "mxfp4"}}) == ""


def _compressed(**weights) -> dict:
    config = _config("compressed-tensors", False)
    config["config_groups"]["group_0"]["weights"].update(weights)
    return {"quantization_config": config}


@pytest.mark.parametrize("raw,message", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quant_method 'awq' is not served"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quant_method 'fp8' is not served"),
    ({"quantization_config": {**_config("compressed-tensors", False),
                              "format": "pack-quantized"}},
     r"compressed-tensors format 'pack-quantized' is not served"),
    (_compressed(type="int", num_bits=8), r"group 'group_0' quantizes weights as \('int', 8, "
                                          r"'channel'\)"),
    (_compressed(strategy="block", block_structure=[128, 128]),
     r"\('float', 8, 'block'\)"),
    (_compressed(symmetric=False), r"asymmetric or dynamic weight scales"),
])
def test_other_quantizations_are_refused_by_name(raw, message):
    with pytest.raises(ModelLoadError, match=message):
        checkpoint_format(raw)


def test_the_model_config_carries_the_checkpoints_format(tmp_path):
    shape = resolve_model_dir("smollm2-135m")
    assert load_model_config(shape).weight_format == ""
    config = (shape / "config.json").read_text()
    (tmp_path / "config.json").write_text(config[:config.rindex("}")] + ', "quantization_'
                                          'config": {"quant_method": "fbgemm_fp8"}}')
    assert load_model_config(tmp_path).weight_format == "fp8"


def test_the_cpu_kernels_refuse_quantization_fp8_and_name_what_they_serve():
    cfg = load_model_config(resolve_model_dir("smollm2-135m"))
    cpu = CpuPlatform(torch.device("cpu"), torch.float32, None)
    kernels = CpuPlatform(torch.device("cpu"), torch.float32, object())
    with pytest.raises(ValueError, match=r"--quantization fp8 is a CUDA format .* use "
                                         r"--quantization int8 .* or --no-cpu-kernels"):
        kernels.formats(EngineConfig(quantization="fp8"), cfg, None)
    # torch's path: torch's own fp8 products (for accuracy), the lm_head dense
    formats, _, _ = cpu.formats(EngineConfig(quantization="fp8"), cfg, None)
    assert formats.method.name == "fp8" and formats(Role.LM_HEAD).name == "float32"
    # an fp8 checkpoint without the C kernels: its weights dequantized, in float32
    formats, dtype, _ = cpu.formats(EngineConfig(), dataclasses.replace(
        cfg, weight_format="fp8"), None)
    assert (formats.method.name, dtype) == ("float32", torch.float32)
