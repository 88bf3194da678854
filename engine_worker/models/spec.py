"""What an architecture is to the engine: one spec each, made in its family's file
(llama.py, gemma.py, ...) and listed by the registry (registry.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    from torch import nn

    from common.gguf_reader import GgufReader
    from engine_worker.models.config import ConfigSource, ModelConfig
    from engine_worker.models.layers import Backends

# Our module's path -> where a checkpoint (or a GGUF file) keeps it: one name, or one
# per part of a fused layer (q, k, v), paths with "*" for each index ("layers.*.mlp");
# a rule names a prefix, the longest that matches wins (models/names.py)
Names = dict[str, Union[str, tuple[str, ...]]]


@dataclass(frozen=True)
class GgufSpec:
    """How llama.cpp's files of an architecture are read (models/gguf.py)."""
    # llama.cpp's name for it (a file's general.architecture)
    name: str
    # our modules' tensors in the file, where not the names all files share
    # (models/gguf.py: GGUF_NAMES)
    names: Names = field(default_factory=dict)
    # what the file's metadata says that transformers' reading of it into the
    # folder's config (common/model_files.py) leaves out: (config, the file) -> config
    read: Optional[Callable[[dict[str, Any], GgufReader], dict[str, Any]]] = None
    # the order to take q's, k's and v's rows in (per tensor; None: as they are), where
    # the file stores them otherwise than Hugging Face (llama's q and k, permuted for
    # llama.cpp's RoPE)
    qkv_orders: Optional[Callable[[ModelConfig], list]] = None
    # of the architectures llama.cpp stores under one name, whether the file's metadata
    # is this one's (Mixtral is llama with experts)
    matches: Callable[[dict[str, Any]], bool] = lambda fields: True


@dataclass(frozen=True)
class Architecture:
    # Hugging Face's name (config.json's "architectures")
    name: str
    # config.json -> ModelConfig
    read_config: Callable[[ConfigSource], ModelConfig]
    # (config, what the platform gives the layers) -> the model, built on the meta device
    model: Callable[[ModelConfig, Backends], nn.Module]
    # what it serves, in words (the docs' table of architectures)
    serves: str
    # where its checkpoints keep our modules, where not Hugging Face's Llama names
    # (models/names.py: CHECKPOINT_NAMES)
    names: Names = field(default_factory=dict)
    # modules the family reads itself: path pattern -> a function of (the module, the
    # checkpoint, its path there, the config) (gpt-oss's stacked experts)
    loaders: dict[str, Callable] = field(default_factory=dict)
    # linear layers a checkpoint stores transposed, (in, out) (GPT-2's Conv1D)
    transposed: tuple[str, ...] = ()
    # tensors its checkpoints may hold that nothing reads (name suffixes): the RoPE
    # buffers of checkpoints saved by transformers before 4.31 (Llama 2's conversions)
    unused: tuple[str, ...] = (".rotary_emb.inv_freq",)
    gguf: Optional[GgufSpec] = None


@dataclass(frozen=True)
class LanguageModel:
    """A multimodal checkpoint whose language model is served (text only)."""
    name: str
    # the language model's architecture, and the transformers config class that fills
    # in the defaults of the config's text_config
    text_architecture: str
    config_class: str
