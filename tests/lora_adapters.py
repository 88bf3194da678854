"""LoRA adapters made with peft on the tests' tiny models, and Hugging Face's greedy
tokens with an adapter merged by peft (tests/unit/test_lora.py, tests/e2e)."""

from __future__ import annotations

import torch

from hf_reference import Reference, _greedy, hf_model


def make_adapter(model_dir, out, seed: int, rank: int, alpha: int, modules, rslora: bool,
                 **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = hf_model(model_dir)
    model = get_peft_model(base, LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
        init_lora_weights=False, **extra))
    with torch.no_grad():   # B made large enough to change the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    model.unload()   # (the cached base model is left as it was)
    return out


@torch.inference_mode()
def merged_greedy(model_dir, adapter_dir, prompts, n: int) -> list[Reference]:
    """With adapter_dir None: the base model's, from a model of its own (not the
    shared one, whose RoPE tables another test may have left as inference tensors)."""
    from peft import PeftModel

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    if adapter_dir is None:
        return _greedy(base.eval(), prompts, n)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    return _greedy(merged, prompts, n)
