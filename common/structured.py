"""Structured output: constraining a request's tokens to a JSON schema, a regular
expression, a list of choices or a grammar.

The constraint travels on the wire as a ``StructuredOutput`` (what the client asked,
as text); both ends turn it into a grammar with llguidance. The frontend checks it
against the tokenizer before a request starts (an invalid schema is a 400, not an
error inside a stream); the engine keeps one matcher per request, asks it for the
tokens allowed next before each sample and feeds it each sampled token.

llguidance, not xgrammar or outlines-core: it has no dependencies (xgrammar pulls
triton), and it compiles nothing ahead of time (masks come from an Earley parser
over a token trie, built lazily), so a new schema costs no startup latency: the
first mask of a fresh schema takes milliseconds and later ones ~0.1 ms on this
project's default model. It reads JSON schemas, regular expressions, Lark and
llama.cpp's GBNF grammars, which covers what OpenAI and vLLM clients send.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import msgspec
import numpy as np

from common.errors import InvalidRequestError

# What a StructuredOutput's ``kind`` may be, and what its ``spec`` then holds.
KINDS = {
    "json_schema": "a JSON schema (JSON text)",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression",
    "choice": "a JSON list of strings: the output is exactly one of them",
    "grammar": "a grammar in Lark or GBNF (EBNF) syntax",
}


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    spec: str = ""
    # The request field it came from, for error messages (e.g. "response_format").
    param: str = "response_format"


def json_schema_output(schema: Any, param: str,
                       spacing: Optional[dict] = None) -> StructuredOutput:
    """A schema given as a JSON value (or as JSON text). ``spacing``: llguidance's
    whitespace options (whitespace_flexible, whitespace_pattern), carried in the
    schema's x-guidance."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param} must be a JSON schema (an object), got "
                                  f"{type(schema).__name__}", param)
    if spacing:
        schema = {} if schema is True else schema
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **spacing}}
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema), param=param)


def _closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where an object schema that lists its properties and says
    nothing of others allows no others (additionalProperties false), as OpenAI's
    strict mode requires. Without it a small model keeps inventing keys."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _invalid(output: StructuredOutput, error: str) -> InvalidRequestError:
    return InvalidRequestError(f"{output.param} is not a valid "
                               f"{output.kind.replace('_', ' ')}: {error.strip()}", output.param)


def to_grammar(output: StructuredOutput) -> str:
    """The llguidance grammar for ``output``. Raises InvalidRequestError."""
    import llguidance

    kind, param = output.kind, output.param
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                _closed_objects(json.loads(output.spec)))
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(output.spec)
        if kind == "choice":
            choices = json.loads(output.spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequestError(f"{param} must be a non-empty list of non-empty "
                                          f"strings", param)
            return llguidance.grammar_from("choice", output.spec)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", output.spec)
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, InvalidRequestError):
            raise
        raise _invalid(output, str(e)) from None
    raise InvalidRequestError(f"unknown structured output kind {kind!r}; one of "
                              f"{', '.join(KINDS)}", param)


class GrammarCompiler:
    """Grammars checked and matched against one tokenizer (a ``tokenizers.Tokenizer``).
    ``vocab_size``: the model's logits width, which may exceed the tokenizer's."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)

    def check(self, output: StructuredOutput) -> str:
        """The grammar, after checking it compiles against this tokenizer. Raises
        InvalidRequestError naming the field."""
        grammar = to_grammar(output)
        error = self._llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise _invalid(output, error)
        return grammar

    def matcher(self, output: StructuredOutput) -> "GrammarMatcher":
        """A matcher at the start of ``output``'s grammar (compiled once: a grammar that
        does not compile leaves the matcher in error). Raises InvalidRequestError."""
        matcher = self._llguidance.LLMatcher(self.tokenizer, to_grammar(output))
        if matcher.is_error():
            raise _invalid(output, matcher.get_error())
        return GrammarMatcher(matcher, self)

    def allowed(self, matchers: list["GrammarMatcher"]) -> np.ndarray:
        """(len(matchers), vocab_size) booleans: the tokens each grammar allows next.
        A matcher in error allows nothing; ``GrammarMatcher.error`` says why.

        One after the other in this thread: llguidance's parallel executor made the
        step slower (its threads wait for cores that the engine's OpenMP threads still
        spin on after the forward pass; docs/performance.md, Structured output)."""
        words = np.zeros((len(matchers), (self.vocab_size + 31) // 32), dtype=np.int32)
        row_bytes = words.shape[1] * 4
        for i, m in enumerate(matchers):
            m.matcher.unsafe_compute_mask_ptr(words.ctypes.data + i * row_bytes, row_bytes)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return bits[:, :self.vocab_size].view(bool)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler  # computes the masks (GrammarCompiler.allowed)

    @property
    def error(self) -> Optional[str]:
        return f"grammar error: {self.matcher.get_error()}" if self.matcher.is_error() else None

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; raises if the grammar did not allow it."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(self.error or f"the grammar does not allow token {token_id}")

    @property
    def done(self) -> bool:
        """No token can follow: the output is complete."""
        return self.matcher.is_stopped()

