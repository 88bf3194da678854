"""From a parsed HTTP request to validated engine requests: admission, the
constraints the frontend works out (structured output, tool calls, bad words),
tokenization through the pool, routing, and validation against the chosen engine's
limits with the validator the engine runs too (common/validation.py).

Admission (frontend/admission.py) is decided before any tokenizing, for everything
the request will cost: a request for more choices (n x prompts) than one request may
have is refused at once (400), as is one that could never be admitted (413), and one
that finds the server full is told to retry (429). Everything the engine would refuse
is checked here too, so that a streaming request fails with a 400 before its stream
starts rather than inside it. Tokenization that takes longer than tokenize_timeout_s
(or than what is left of the request's deadline) ends with 504.

What a step takes (the admission share, the engine) is recorded on the Job as it is
taken, so that Job.close gives it back wherever preparing stops.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import msgspec

from common.config import FrontendConfig
from common.errors import InvalidRequestError
from common.ngram import Prediction
from common.protocol import ChatMessage, Ready, SamplingParams
from common.tokenizer import TokenStrings, fill_in_the_middle
from common.validation import ContextLengthError, checked_prompt
from frontend.admission import Admission, Ticket, estimate_tokens
from frontend.choice import Choice
from frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import APIError
from frontend.formatters import ChatFormatter, CompletionFormatter, Formatter
from frontend.grammar_cache import CheckedGrammars
from frontend.job import Job
from frontend.openai_protocol import ChatCompletionRequest, ChatMessageParam, ToolParam
from frontend.reasoning import ReasoningFormat
from frontend.router import EngineRouter
from frontend.tools import ToolPlan, plan_tools
from tokenizer_worker.client import TokenizeFailed, TokenizerClient, TokenizerDeadError

Prompt = Union[str, list[int]]


@dataclass
class Inputs:
    """What an endpoint's body asks the engines for."""

    prompts: Sequence[Prompt]  # completions; empty for chat
    messages: Optional[list[ChatMessage]]  # chat
    max_tokens: Optional[int]
    num_logprobs: Optional[int]
    template: dict = field(default_factory=dict)  # chat: template_options
    tools: Optional[list[dict]] = None
    # max_tokens is the endpoint's default (completions: 16), not the client's: where
    # the prompt leaves less room in the context, it is that room rather than a 400.
    default_max_tokens: bool = False
    # Texts are tokenized with the tokenizer's special tokens (e.g. BOS).
    add_special_tokens: bool = True
    # Completions: the text after each prompt's completion (fill in the middle).
    suffix: Optional[str] = None

    @classmethod
    def of(cls, body) -> "Inputs":
        if isinstance(body, ChatCompletionRequest):
            return cls([], [chat_message(m) for m in body.messages], body.max_new_tokens(),
                       body.num_logprobs(), template_options(body), tool_dicts(body.tools),
                       add_special_tokens=body.add_special_tokens)
        return cls(body.prompts(), None, body.max_tokens, body.logprobs,
                   default_max_tokens="max_tokens" not in body.model_fields_set,
                   add_special_tokens=body.add_special_tokens, suffix=body.suffix or None)

    def max_tokens_for(self, prompt_ids: list[int], truncate: Optional[int],
                       max_model_len: int) -> Optional[int]:
        """max_tokens for one prompt (as the engine will see it: truncated if asked)."""
        if not self.default_max_tokens or self.max_tokens is None:
            return self.max_tokens
        n = len(prompt_ids) if truncate is None else min(len(prompt_ids), truncate)
        room = max_model_len - n
        return room if 0 < room < self.max_tokens else self.max_tokens


def template_options(body) -> dict:
    """How the chat template ends a chat or /tokenize body's messages: with the
    assistant's turn header (add_generation_prompt), or inside the last message, an
    assistant's, left open (continue_final_message); and the request's own template
    variables (chat_template_kwargs, and reasoning_effort as one). Raises APIError
    (400)."""
    kwargs = body.chat_template_kwargs
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        if (kwargs or {}).get("reasoning_effort", effort) != effort:
            raise APIError(400, f"reasoning_effort {effort!r} and chat_template_kwargs' "
                                f"reasoning_effort {kwargs['reasoning_effort']!r} disagree",
                           param="reasoning_effort")
        kwargs = {**(kwargs or {}), "reasoning_effort": effort}
    if not body.continue_final_message:
        return {"add_generation_prompt": body.add_generation_prompt, "template_kwargs": kwargs}
    if "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt:
        raise APIError(400, "continue_final_message goes on with the last message; it "
                            "cannot be combined with add_generation_prompt true",
                       param="continue_final_message")
    role = body.messages[-1].role
    if role != "assistant":
        raise APIError(400, f"continue_final_message needs the last message to be the "
                            f"assistant's; it is a {role} message",
                       param="continue_final_message")
    return {"add_generation_prompt": False, "continue_final_message": True,
            "template_kwargs": kwargs}


def chat_message(m: ChatMessageParam) -> ChatMessage:
    return ChatMessage(role=m.role, content=m.text(), name=m.name, tool_call_id=m.tool_call_id,
                       reasoning_content=m.thinking(),
                       tool_calls=None if m.tool_calls is None else
                       [c.model_dump() for c in m.tool_calls])


def tool_dicts(tools: Optional[list[ToolParam]]) -> Optional[list[dict]]:
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


class InputProcessor:
    def __init__(self, engines: EngineRouter, tokenizer_client: TokenizerClient, tokenizer,
                 admission: Admission, config: FrontendConfig,
                 chat_template: Optional[str], grammars: Optional[CheckedGrammars],
                 reasoning: Optional[ReasoningFormat] = None) -> None:
        """``tokenizer``: the model's Rust tokenizer (bad words, echo, detokenizers);
        ``grammars``: None when structured output is unavailable; ``reasoning``: the
        --reasoning-parser's tags, for chat."""
        self.engines = engines
        self.tokenizer_client = tokenizer_client
        self.tokenizer = tokenizer
        self.strings = TokenStrings(tokenizer)
        self.fim = fill_in_the_middle(tokenizer)
        self.admission = admission
        self.config = config
        self.chat_template = chat_template
        self.grammars = grammars
        self.reasoning = reasoning

    async def prepare(self, job: Job, body,
                      formatter: Optional[Callable[[Job, TokenStrings], Formatter]] = None
                      ) -> None:
        """Fill ``job`` with its engine requests, admitted, tokenized, routed and
        validated; its formatter is chosen (``formatter``'s, else the endpoint's).
        Raises APIError."""
        inputs = Inputs.of(body)
        if inputs.suffix is not None:
            self._check_suffix(inputs, body)
        constraints, job.tool_plan = await self._constraints(body)
        job.n = body.num_generated()
        job.ticket = self._admit(body, job.n, inputs)
        job.prompts, job.tokenize_ms = await self._tokenize(inputs, job.deadline)
        predicted = "" if body.prediction is None else body.prediction.text()
        if predicted:
            constraints["prediction"] = await self._predicted_ids(predicted, job.deadline)
        job.ticket.resize(job.n * sum(len(p) for p in job.prompts))
        job.engine, job.prefill = self.engines.route(job.prompts[0], body.cache_salt,
                                                     job.adapter)
        job.prefill_held = job.prefill is not None
        job.engine_address = job.engine.address
        job.num_logprobs = inputs.num_logprobs
        options = body.stream_options
        job.include_usage = bool(options and options.include_usage)
        job.continuous_usage = bool(options and options.continuous_usage_stats)
        job.return_token_ids = body.return_token_ids
        as_ids = body.return_tokens_as_token_ids
        job.tokens_as_ids = self.config.return_tokens_as_token_ids if as_ids is None else as_ids
        job.keep = body.n if job.n > body.n else None
        job.prompt_logprobs = body.prompt_logprobs is not None
        if inputs.messages is not None and self.reasoning is not None:
            job.reasoning, job.include_reasoning = self.reasoning, body.include_reasoning
        self._add_choices(job, body, inputs, constraints)
        if getattr(body, "echo", False):
            job.echo = [p if isinstance(p, str) and body.truncate_prompt_tokens is None
                        else self.tokenizer.decode(ids, skip_special_tokens=False)
                        for p, ids in zip(inputs.prompts, job.prompts)]
        if constraints.get("prediction"):
            job.predictions = [Prediction(constraints["prediction"]) for _ in job.choices]
        if formatter is None:
            formatter = ChatFormatter if inputs.messages is not None else CompletionFormatter
        job.formatter = formatter(job, self.strings)

    def _check_suffix(self, inputs: Inputs, body) -> None:
        """A suffix is served for text prompts, without echo, by a model with
        fill-in-the-middle tokens. Raises APIError (400)."""
        why = None
        if self.fim is None:
            why = ("this model's tokenizer has no fill-in-the-middle tokens (as code models' "
                   "<|fim_prefix|>, <fim_prefix> or [SUFFIX]), so it cannot complete "
                   "between a prompt and a suffix")
        elif any(not isinstance(p, str) for p in inputs.prompts):
            why = ("a suffix goes with text prompts; a prompt of token ids carries its own "
                   "fill-in-the-middle tokens")
        elif body.echo:
            why = "echo cannot be combined with a suffix (the completion goes between them)"
        elif body.truncate_prompt_tokens is not None:
            why = ("truncate_prompt_tokens cannot be combined with a suffix (it would cut "
                   "the start of the fill-in-the-middle prompt)")
        if why is not None:
            raise APIError(400, why, param="suffix", code="invalid_value")

    def _admit(self, body, n: int, inputs: Inputs) -> Ticket:
        """The request's admission share: n x prompts engine requests, and their prompt
        tokens as estimated before tokenizing. Raises APIError (400, 413, 429)."""
        num_prompts = 1 if inputs.messages is not None else len(inputs.prompts)
        num_choices = num_prompts * n
        limit = self.config.max_choices_per_request
        if num_choices > limit:
            per = f"n={n}" if n == body.n else f"best_of={n}"
            raise APIError(400, f"this request asks for {num_choices} completions "
                                f"({num_prompts} prompt(s) x {per}); at most {limit} are "
                                f"allowed per request", param="n" if num_prompts == 1 else "prompt",
                           code="too_many_choices")
        if inputs.messages is not None:
            estimate = estimate_tokens("".join(m.content for m in inputs.messages))
        else:
            estimate = sum(estimate_tokens(p) + estimate_tokens(inputs.suffix or [])
                           for p in inputs.prompts)
        return self.admission.admit(num_choices, n * estimate)

    def _add_choices(self, job: Job, body, inputs: Inputs, constraints: dict) -> None:
        """n choices per prompt, each checked against the engine's limits (engines
        may differ)."""
        ready = job.engine.ready
        assert ready is not None
        # best_of ranks choices by their log probability: the engine must report it.
        num_logprobs = inputs.num_logprobs
        engine_logprobs = num_logprobs if job.n == body.n else (num_logprobs or 0)
        skip_special = body.skip_special_tokens and not (
            job.tool_plan is not None and job.tool_plan.keeps_special_tokens) and not (
            job.reasoning is not None and job.reasoning.keeps_special_tokens)
        for p, prompt_ids in enumerate(job.prompts):
            max_tokens = inputs.max_tokens_for(prompt_ids, body.truncate_prompt_tokens,
                                               ready.max_model_len)
            for j in range(job.n):
                index = p * job.n + j
                params = body.sampling_params(1 if max_tokens == 0 else max_tokens,
                                              engine_logprobs, j, **constraints)
                if job.adapter is not None:
                    params = msgspec.structs.replace(params, adapter=job.adapter)
                if job.reasoning is not None:
                    job.thinks_first.append(job.reasoning.thinking_at_start(prompt_ids))
                    if params.structured is not None and job.thinks_first[-1]:
                        # The model thinks first: its grammar starts with the answer.
                        params = msgspec.structs.replace(
                            params, structured_after=list(job.reasoning.answer_after))
                prompt_ids = self._validate(prompt_ids, params, ready,
                                            inputs.messages is not None)
                job.params.append(params)
                job.choices.append(Choice(
                    index=index, request_id=f"{job.request_id}-{index}",
                    prompt_token_ids=prompt_ids,
                    detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                       skip_special),
                    stops=StopStringMatcher(body.stop_strings(), body.include_stop_str_in_output),
                    eos_token_ids=frozenset(ready.eos_token_ids), generates=max_tokens != 0))
                job.prompts[p] = prompt_ids

    async def _constraints(self, body) -> tuple[dict, Optional[ToolPlan]]:
        """The sampling fields the frontend works out (structured output, bad words'
        token ids) and the request's tool plan. Raises APIError (400) for a schema,
        grammar or tool choice that cannot be served."""
        try:
            structured = body.structured_output()
            plan = None
            if isinstance(body, ChatCompletionRequest):
                plan = plan_tools(body, self.chat_template)
                if plan is not None and plan.structured is not None:
                    if structured is not None:
                        raise InvalidRequestError(
                            f"tool_choice forces a tool call and {structured.param} "
                            f"constrains the output too; give one of them", "tool_choice")
                    structured = plan.structured
            extra: dict = {}
            if structured is not None:
                if self.grammars is None:
                    raise InvalidRequestError("structured output is unavailable for this "
                                              "model's tokenizer", structured.param)
                await self.grammars.check(structured)
                extra["structured"] = structured
            if body.bad_words:
                extra["bad_words_ids"] = self._bad_words_ids(body.bad_words)
            if getattr(body, "echo", False) and body.logprobs is not None:
                # echo with logprobs shows the prompt's tokens' logprobs too.
                extra["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.param, code="invalid_value") from None
        return extra, plan

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as it tokenizes alone and after a space (mid-sentence)."""
        out: list[list[int]] = []
        for word in words:
            if not word:
                raise InvalidRequestError("bad_words must not hold an empty string", "bad_words")
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    async def _tokenize(self, inputs: Inputs, deadline: Optional[float]
                        ) -> tuple[list[list[int]], float]:
        if inputs.messages is None and all(isinstance(p, list) for p in inputs.prompts):
            return [list(p) for p in inputs.prompts], 0.0  # token ids: no pool involved
        return await self.within_tokenize_timeout(self._tokenize_texts(inputs), deadline)

    async def _predicted_ids(self, text: str, deadline: Optional[float]) -> list[int]:
        """A predicted output's token ids, as the reply would hold them."""
        result = await self.within_tokenize_timeout(self.call_tokenizer(
            prompt=text, add_special_tokens=False, param="prediction"), deadline)
        return list(result.prompt_token_ids)

    async def within_tokenize_timeout(self, work, deadline: Optional[float] = None):
        """``work``'s result; a 504 when the pool takes longer than the tokenize
        timeout (or than what is left until ``deadline``)."""
        timeout = self.config.tokenize_timeout_s
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            raise APIError(504, f"tokenization did not finish within {timeout:.1f} s",
                           code="tokenize_timeout") from None

    async def _tokenize_texts(self, inputs: Inputs) -> tuple[list[list[int]], float]:
        if inputs.messages is not None:
            result = await self.call_tokenizer(messages=inputs.messages, tools=inputs.tools,
                                               add_special_tokens=inputs.add_special_tokens,
                                               **inputs.template)
            return [list(result.prompt_token_ids)], result.tokenize_ms
        texts = [p for p in inputs.prompts if isinstance(p, str)]
        results = await asyncio.gather(*[
            self.call_tokenizer(prompt=t, suffix=inputs.suffix,
                                add_special_tokens=inputs.add_special_tokens)
            for t in texts])
        by_text = iter(results)
        token_prompts = [list(p) if isinstance(p, list) else list(next(by_text).prompt_token_ids)
                         for p in inputs.prompts]
        return token_prompts, max((r.tokenize_ms for r in results), default=0.0)

    async def call_tokenizer(self, param: Optional[str] = None, **kw):
        """The pool's tokens for ``kw``; its failure an APIError naming ``param``
        (else messages or prompt)."""
        try:
            return await self.tokenizer_client.tokenize(**kw)
        except TokenizeFailed as e:
            status = 400 if e.kind.value == "invalid_request" else 500
            raise APIError(status, e.message, param=param or (
                "messages" if "messages" in kw else "prompt"))
        except TokenizerDeadError as e:
            raise APIError(503, f"the tokenizer pool is unavailable: {e}",
                           code="tokenizer_unavailable", headers={"Retry-After": "1"})

    @staticmethod
    def _validate(prompt_ids: list[int], params: SamplingParams, ready: Ready,
                  chat: bool) -> list[int]:
        """What the engine would refuse, refused here (400; common/validation.py, which
        the engine runs too); returns the prompt as the engine will see it. A chat's
        prompt is its messages."""
        try:
            return checked_prompt(prompt_ids, params, ready.vocab_size, ready.max_model_len)
        except InvalidRequestError as e:
            param = "messages" if chat and e.param == "prompt" else e.param
            code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
            raise APIError(400, e.message, param=param, code=code)
