"""The statistics of the streaming benchmark (pure functions, unit-tested).

Definitions (the seeds'):
  TTFT     t_first_token - t_sent
  TPOT     (t_last_token - t_first_token) / (n_tokens - 1), per request (n >= 2)
  ITL      t_i - t_(i-1) between consecutive token-carrying chunks, pooled over requests
  Latency  t_last_token - t_sent
t_sent is when the request left the client, after any client-side queue (whose wait
is reported on its own line, never inside TTFT).
"""

from __future__ import annotations

import math
import random
from typing import Optional, Sequence


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100), linear interpolation between closest ranks (as
    numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def p50_95_99(values: Sequence[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    return percentile(values, 50), percentile(values, 95), percentile(values, 99)


def tpot(token_times: Sequence[float], num_tokens: int) -> Optional[float]:
    """Time per output token after the first; ``token_times`` are the arrival times of
    the chunks that carried tokens, ``num_tokens`` how many tokens they carried."""
    if num_tokens < 2 or not token_times:
        return None
    return (token_times[-1] - token_times[0]) / (num_tokens - 1)


def itls(token_times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def arrival_offsets(num_requests: int, request_rate: Optional[float], burstiness: float,
                    seed: int, interval_s: float = 0.0) -> list[float]:
    """When each request is due, in seconds from the start.

    With a request rate: a gamma process (shape ``burstiness``, mean gap 1 / rate);
    burstiness 1 is a Poisson process, lower is burstier, higher more regular.
    Without one: every ``interval_s`` (0: all at once)."""
    if request_rate is None or math.isinf(request_rate):
        return [i * interval_s for i in range(num_requests)]
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


def tokens_per_second_over_time(token_times: Sequence[float], num_tokens: Sequence[int],
                                bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens/s in consecutive bins of ``bin_s`` from time 0: (bin starts, rates)."""
    if not token_times:
        return [], []
    nbins = int(max(token_times) // bin_s) + 1
    counts = [0] * nbins
    for t, n in zip(token_times, num_tokens):
        counts[int(t // bin_s)] += n
    return [i * bin_s for i in range(nbins)], [c / bin_s for c in counts]
