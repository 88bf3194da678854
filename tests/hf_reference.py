"""Greedy reference outputs from Hugging Face transformers, and the comparison rule.

Each prompt runs alone (batch 1, no padding) through ``generate``. Our output must
equal it token for token; a divergence is accepted only where the reference's top-2
logits are within ``NEAR_TIE`` of each other, where fp32 summation order alone can flip
the argmax. Such a case is reported (a warning naming the position), never silently
skipped.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

NEAR_TIE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    # top-2 logit gap at each generated position
    gaps: list[float]


_models: dict[str, object] = {}


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _models:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        except ValueError:   # a multimodal model transformers maps only so (Mistral 3)
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
        _models[key] = model.eval()
    return _models[key]


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              round_inputs: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
              ) -> list[Reference]:
    """round_inputs: every linear layer's input goes through it first, as the engine's
    kernels take it (quantize_blocks: int8 with a scale per 32 inputs, as in llama.cpp's
    Q8_0; or rounded to bfloat16 for bf16 products). Each step then recomputes the whole
    sequence (no KV cache): HF's cached attention sums in another order, and an
    activation an ulp away can round to the next int8 step, so the cached path drifted
    from HF's own full forward by 4e-3 in a logit gap (a q4 run on an Intel Xeon) where
    the engine agreed with the full forward to 2e-6."""
    model = hf_model(model_dir)
    hooks = [m.register_forward_pre_hook(lambda _m, args: (round_inputs(args[0]),))
             for m in model.modules() if round_inputs and isinstance(m, torch.nn.Linear)]
    try:
        return _greedy(model, prompts, max_new_tokens, use_cache=round_inputs is None)
    finally:
        for hook in hooks:
            hook.remove()


def quantize_blocks(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded to int8 steps of its blocks' amax / 127 along the last dimension."""
    blocks = x.reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0.0)  # as gemm.c: x * (127 / amax), rounded
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def _greedy(model, prompts: list[list[int]], max_new_tokens: int,
            use_cache: bool = True) -> list[Reference]:
    refs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, use_cache=use_cache)
        tokens = out.sequences[0, len(prompt):].tolist()
        gaps = []
        for step_logits in out.logits:
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        refs.append(Reference(tokens, gaps))
    return refs


def assert_matches(outputs: list[list[int]], refs: list[Reference], label: str = "",
                   near_tie: float = NEAR_TIE) -> int:
    """Assert each output equals its reference up to a genuine near-tie (a top-2 gap
    under ``near_tie``); returns the number of near-tie divergences (reported as
    warnings)."""
    assert len(outputs) == len(refs)
    near_ties = 0
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert len(got) == len(ref.token_ids), (
            f"{label} prompt {i}: {len(got)} tokens, reference has {len(ref.token_ids)}")
        for pos, (a, b) in enumerate(zip(got, ref.token_ids)):
            if a == b:
                continue
            if ref.gaps[pos] < near_tie:
                near_ties += 1
                warnings.warn(f"{label} prompt {i} diverges at token {pos} on a near-tie "
                              f"(top-2 gap {ref.gaps[pos]:.2e}): ours {a}, reference {b}")
                break
            raise AssertionError(
                f"{label} prompt {i} diverges at token {pos}: ours {got}, "
                f"reference {ref.token_ids} (top-2 gap {ref.gaps[pos]:.3g})")
    return near_ties
