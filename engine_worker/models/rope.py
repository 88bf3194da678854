"""RoPE as a config describes it: its base and its scaling (linear, Llama 3.1's,
YaRN, LongRoPE), read as Hugging Face reads them (models/config.py and the family files
read the rest of a config; models/layers/rotary.py turns this into frequencies)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from common.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default", "linear", "llama3", "yarn" or "longrope"
    kind: str = "default"
    factor: float = 1.0
    # llama3 and yarn
    original_max_position_embeddings: int = 8192
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn only: the band of dimensions between interpolation and extrapolation (in
    # rotations over the original context), and the factor cos and sin are multiplied
    # by (which scales every attention score by its square)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # longrope only: what divides each frequency (one per rotated pair), the long or the
    # short factors of the config, chosen once for the context served
    ext_factors: tuple[float, ...] = ()

    @property
    def context_length(self) -> Optional[int]:
        """The context the scaling extends the model to, where it says one (YaRN: the
        original context times the factor), else None."""
        if self.kind == "yarn":
            return int(self.original_max_position_embeddings * self.factor)
        return None


def rope_config(raw: dict[str, Any], rotary_dim: int = 0,
                 served: Optional[int] = None) -> RopeConfig:
    # transformers >= 5 nests everything under rope_parameters; older configs have
    # rope_theta at the top and an optional rope_scaling dict.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta),
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn":
        return _yarn_config(float(theta), merged, raw["max_position_embeddings"])
    if kind in ("longrope", "su"):   # "su": Phi-3's first configs
        return _longrope_config(float(theta), merged, raw, rotary_dim, served)
    raise ModelLoadError(f"unsupported rope type {kind!r}; supported: default, linear, "
                         f"llama3, yarn, longrope")


def _longrope_config(theta: float, params: dict[str, Any], raw: dict[str, Any],
                     rotary_dim: int, served: Optional[int]) -> RopeConfig:
    """LongRoPE (Phi-3's 128k models, Phi-3.5, Phi-4-mini): the long factors where the
    context served is longer than the original one, else the short ones, chosen once
    at start as vLLM chooses them (Hugging Face switches when a sequence grows past
    the original context, after its first positions were cached with the short
    ones); --max-model-len at or under the original context gives the short. The
    attention factor: sqrt(1 + ln(factor) / ln(original)), where the factor is the
    model's context over the original one."""
    max_positions = raw["max_position_embeddings"]
    original = int(params.get("original_max_position_embeddings")
                   or raw.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    long = min(max_positions, served or max_positions) > original
    factors = params.get("long_factor" if long else "short_factor")
    pairs = rotary_dim // 2
    if (not isinstance(factors, list) or len(factors) != pairs
            or not all(isinstance(f, (int, float)) and f > 0 for f in factors)):
        raise ModelLoadError(f"longrope's {'long' if long else 'short'}_factor must be "
                             f"{pairs} positive numbers (one per rotated pair)")
    logger.info("LongRoPE: the %s factors (context %d, original %d)",
                "long" if long else "short", min(max_positions, served or max_positions),
                original)
    return RopeConfig(theta=theta, kind="longrope", factor=factor,
                      original_max_position_embeddings=original,
                      attention_factor=float(attention_factor),
                      ext_factors=tuple(float(f) for f in factors))


def _yarn_config(theta: float, params: dict[str, Any], max_positions: int) -> RopeConfig:
    """YaRN, as Hugging Face reads it: the original context defaults to
    max_position_embeddings, the factor to max_position_embeddings over the original,
    and the attention factor to 0.1 ln(factor) + 1 (DeepSeek's mscale and
    mscale_all_dim: the ratio of two such)."""
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    if factor <= 0:
        raise ModelLoadError(f"rope scaling factor {factor} is not positive")

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return RopeConfig(
        theta=theta, kind="yarn", factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor))
