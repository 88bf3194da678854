"""How one request is decoded: the sampling parameters every engine request carries
(common/protocol.py's AddRequest), their bounds and their validation, shared by the
frontend and the engine."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

import msgspec

from common.errors import InvalidRequestError
from common.structured import StructuredOutput

logger = logging.getLogger(__name__)

# Logprobs are returned for at most this many alternatives per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# A temperature below this is greedy decoding: dividing logits by it would overflow
# float32 (the threshold vLLM uses too).
GREEDY_TEMPERATURE = 1e-5
# Repetition penalties outside this range are refused: they only push logits toward
# overflow, and 1.0-2.0 is what anyone uses.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# logit_bias values are clamped to this range by OpenAI; roseserve refuses others.
MAX_LOGIT_BIAS = 100.0
# A cache salt is a secret (e.g. 43 base64 characters for 256 bits); past this it is
# not one.
MAX_CACHE_SALT_CHARS = 1024
# A predicted output longer than this many tokens is refused (no context holds it).
MAX_PREDICTION_TOKENS = 1 << 17


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How one request is decoded. Defaults follow OpenAI's API where it has one."""

    # Most tokens to generate; None: until EOS or the model's context is full.
    max_tokens: Optional[int] = None
    # EOS and stop token ids are ignored until this many tokens are generated.
    min_tokens: int = 0
    # 0 (or anything below GREEDY_TEMPERATURE) means greedy (argmax); otherwise
    # logits are divided by it before sampling.
    temperature: float = 1.0
    # Keep only the k most likely tokens; None keeps all.
    top_k: Optional[int] = None
    # Keep the smallest set of tokens whose probability sums to at least top_p.
    top_p: float = 1.0
    # Drop tokens less likely than min_p times the most likely one.
    min_p: float = 0.0
    # CTRL-style: logits of tokens seen in prompt or output are divided (if > 0)
    # or multiplied (if < 0) by it.
    repetition_penalty: float = 1.0
    # OpenAI-style, over generated tokens only: subtract presence_penalty once per
    # distinct token and frequency_penalty once per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Same seed, same prompt, same params: same output, whatever else is batched.
    seed: Optional[int] = None
    # Generation stops (finish reason "stop") when one of these is sampled.
    stop_token_ids: list[int] = []
    # Keep generating past the model's EOS token(s).
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the chosen token's logprob plus the N most likely.
    logprobs: Optional[int] = None
    # Keep only the last N prompt tokens (explicit truncation); None: never truncate.
    truncate_prompt_tokens: Optional[int] = None
    # Added to the logits of these token ids before sampling (-100 bans, 100 forces).
    logit_bias: dict[int, float] = {}
    # Only these token ids may be generated; None: any.
    allowed_token_ids: Optional[list[int]] = None
    # Token sequences never generated: the last token of each is banned whenever the
    # tokens before it are the sequence's other tokens.
    bad_words_ids: list[list[int]] = []
    # Constrain the output to a JSON schema, regex, choice or grammar.
    structured: Optional[StructuredOutput] = None
    # With structured: the grammar applies only once these token ids have been
    # generated in a row (a reasoning model's end of thinking: </think>, or harmony's
    # <|channel|>final<|message|>, frontend/reasoning.py); they and the tokens before
    # them are free.
    structured_after: Optional[list[int]] = None
    # Like logprobs, for every prompt token after the first (returned with the first
    # output). The prompt is then computed, not read from the prefix cache.
    prompt_logprobs: Optional[int] = None
    # vLLM's: lower values are served first (waiting requests are admitted in order
    # of it, then of arrival), and a request of a higher value is preempted first.
    priority: int = 0
    # vLLM's: the prefix cache serves this request only blocks computed for requests
    # with the same salt (common/prefix_hash.py); None: the unsalted cache.
    cache_salt: Optional[str] = None
    # The LoRA adapter the request runs with (engine_worker/lora.py: loaded by this
    # name), as the OpenAI API's ``model`` names it; None: the base model.
    adapter: Optional[str] = None
    # An embedding, not a generation (/v1/embeddings): the prompt's final hidden
    # states pooled as the engine's --pooling says, normalized; nothing is sampled.
    embed: bool = False
    # OpenAI's predicted output, as token ids: where the engine speculates
    # (--speculative-tokens), its proposals come from here; the output is the same.
    prediction: list[int] = []

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first invalid field."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})", "min_tokens")
        _check_finite(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be non-negative, got {self.temperature}", "temperature")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(
                f"top_k must be at least 1 (or omitted), got {self.top_k}", "top_k")
        _check_finite(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(
                f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_finite(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(
                f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check_finite(self.repetition_penalty, "repetition_penalty")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
                "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(value, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError("seed must fit in 64 bits", "seed")
        if not -(2**31) < self.priority < 2**31:
            raise InvalidRequestError(f"priority must fit in 32 bits, got {self.priority}",
                                      "priority")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}", name)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be at least 1, got "
                f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        for token_id, bias in self.logit_bias.items():
            _check_finite(bias, "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token_id}", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.structured_after is not None and self.structured is None:
            raise InvalidRequestError("structured_after needs a structured output",
                                      "structured_after")
        if self.structured_after is not None and not 0 < len(self.structured_after) <= 16:
            raise InvalidRequestError("structured_after must be 1 to 16 token ids",
                                      "structured_after")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                f"characters, got {len(self.cache_salt)}", "cache_salt")
        if self.adapter is not None and not 0 < len(self.adapter) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError("adapter must be a non-empty name", "adapter")
        if len(self.prediction) > MAX_PREDICTION_TOKENS:
            raise InvalidRequestError(
                f"prediction has {len(self.prediction)} tokens, more than the "
                f"{MAX_PREDICTION_TOKENS} allowed", "prediction")
        if any(not word for word in self.bad_words_ids):
            raise InvalidRequestError("bad_words must not hold an empty word", "bad_words")

    def token_id_fields(self) -> list[tuple[str, list[int]]]:
        """Every token id the params name, by field, to check against the vocabulary."""
        return [("stop_token_ids", self.stop_token_ids),
                ("logit_bias", list(self.logit_bias)),
                ("allowed_token_ids", self.allowed_token_ids or []),
                ("bad_words", [t for word in self.bad_words_ids for t in word]),
                ("structured_after", self.structured_after or []),
                ("prediction", self.prediction)]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check_finite(value: float, name: str) -> None:
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}", name)


# The sampling settings of a model's generation_config.json that become the defaults of
# requests not setting them (vLLM's --generation-config auto).
RECOMMENDED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def recommended_sampling(model_dir: Path) -> dict[str, float | int]:
    """RECOMMENDED_FIELDS as the model's generation_config.json gives them (none where
    it has none). Hugging Face's top_k 0 (no cut) is no default; a value out of bounds
    or of the wrong type is left out, with a warning."""
    path = model_dir / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("%s cannot be read (%s): requests get no defaults from it", path, e)
        return {}
    found = {}
    for key in RECOMMENDED_FIELDS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None or (key == "top_k" and value == 0):
            continue
        try:
            if isinstance(value, bool) or not isinstance(
                    value, int if key == "top_k" else (int, float)):
                raise InvalidRequestError(f"{value!r} is not a number", key)
            SamplingParams(**{key: value}).validate()
        except InvalidRequestError as e:
            logger.warning("%s: %s is left out of requests' defaults: %s", path, key, e)
            continue
        found[key] = value
    return found
