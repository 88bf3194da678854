"""Admission control: how much work the frontend has taken on and not yet started.

Model: what a burst can exhaust is the engines' queues, so that is what is bounded. A
request is admitted as it arrives, before any tokenizing, for what it will cost: the
engine requests it becomes (n x its prompts) and their prompt tokens (n x each
prompt's tokens; text is estimated at 4 characters per token until it is tokenized,
then counted exactly). Each choice gives back its share when its first token arrives
(from then on it runs, which the engines bound themselves) or when it ends, however
it ends. Past either limit a new request gets 429 with Retry-After; one that could
not fit even into an idle server gets 413. Nothing else is done for a refused request.
"""

from __future__ import annotations

from frontend.errors import APIError

# Characters per token assumed when estimating a text prompt's size.
EST_CHARS_PER_TOKEN = 4


def estimate_tokens(prompt) -> int:
    """A prompt's tokens: exact for token ids, estimated for text."""
    return len(prompt) if isinstance(prompt, list) else len(prompt) // EST_CHARS_PER_TOKEN + 1


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        # Engine requests admitted and not yet producing tokens, and their prompt tokens.
        self.requests = 0
        self.tokens = 0

    def admit(self, num_requests: int, num_tokens: int) -> "Ticket":
        if num_requests > self.max_requests or num_tokens > self.max_tokens:
            raise APIError(413, f"this request needs {num_requests} engine requests (n x "
                                f"prompts) and about {num_tokens} prompt tokens; the server "
                                f"admits at most {self.max_requests} and {self.max_tokens} "
                                f"at a time", code="request_too_large")
        if (self.requests + num_requests > self.max_requests
                or self.tokens + num_tokens > self.max_tokens):
            raise APIError(429, f"the server is at its limit of {self.max_requests} waiting "
                                f"requests or {self.max_tokens} waiting prompt tokens; retry "
                                f"shortly", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.requests += num_requests
        self.tokens += num_tokens
        return Ticket(self, num_requests, num_tokens)


class Ticket:
    """One request's share of the admission budget, given back in parts."""

    def __init__(self, admission: Admission, requests: int, tokens: int) -> None:
        self.admission = admission
        self.requests = requests
        self.tokens = tokens

    def resize(self, tokens: int) -> None:
        """The exact prompt tokens, once known (tokenized)."""
        self.admission.tokens += tokens - self.tokens
        self.tokens = tokens

    def release_one(self, tokens: int) -> None:
        """One engine request started running (or ended): give back its share."""
        if self.requests:
            tokens = min(tokens, self.tokens)
            self.requests -= 1
            self.tokens -= tokens
            self.admission.requests -= 1
            self.admission.tokens -= tokens

    def release(self) -> None:
        """Give back whatever is left (the request ended). Idempotent."""
        self.admission.requests -= self.requests
        self.admission.tokens -= self.tokens
        self.requests = self.tokens = 0
