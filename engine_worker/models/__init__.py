"""The engine's own model implementations, and building one from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from engine_worker.model_config import ModelConfig
from engine_worker.models.gpt2 import GPT2Model
from engine_worker.models.llama import LlamaModel
from engine_worker.weights import Checkpoint

Model = Union[LlamaModel, GPT2Model]


def load_model(cfg: ModelConfig, model_dir: Path, device: torch.device,
               dtype: torch.dtype) -> Model:
    """Build the model for ``cfg`` on ``device`` and copy the checkpoint in."""
    # Built on the meta device, then given uninitialized memory: random init of
    # weights that are overwritten next would be wasted work.
    with torch.device("meta"):
        model: Model = LlamaModel(cfg) if cfg.family == "llama" else GPT2Model(cfg)
    model = model.to(dtype).to_empty(device=device)
    prefix = ("model.",) if cfg.family == "llama" else ("transformer.",)
    ckpt = Checkpoint(model_dir, strip_prefixes=prefix)
    with torch.no_grad():
        model.load_weights(ckpt)
    ckpt.finish()
    return model.eval()
