"""Prometheus metrics of one frontend (a registry per app, so tests can build many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("roseserve_requests", "Finished choices by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("roseserve_rejected_requests",
                                "Requests refused before running, by HTTP status",
                                ["status"], registry=r)
        self.ttft = Histogram("roseserve_time_to_first_token_seconds",
                              "Request received to first token available",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("roseserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a choice",
                             buckets=_ITL_BUCKETS, registry=r)
        self.queue = Histogram("roseserve_queue_time_seconds",
                               "Time a request waited in the engine before it ran",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("roseserve_e2e_request_latency_seconds",
                             "Request received to response complete",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("roseserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("roseserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.running = Gauge("roseserve_num_requests_running", "Requests running in engines",
                             registry=r)
        self.waiting = Gauge("roseserve_num_requests_waiting",
                             "Requests waiting in engines, plus admitted here but not started",
                             registry=r)
        self.kv_usage = Gauge("roseserve_kv_cache_usage_ratio",
                              "Fraction of KV blocks in use by requests", registry=r)
        self.prefix_hit_rate = Gauge("roseserve_prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / looked up",
                                     registry=r)
        self.tokenizer_queue = Gauge("roseserve_tokenizer_queue",
                                     "Tokenize jobs waiting or running in the pool", registry=r)
        self.engines_healthy = Gauge("roseserve_engines_healthy", "Engines answering",
                                     registry=r)
