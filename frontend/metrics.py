"""Prometheus metrics of one frontend (a registry per app, so tests can build many).

Counters and histograms are updated as requests end (serving.py); the gauges of the
system's state (requests running and waiting, KV usage, prefix-cache hits, engines
and their load, the tokenizer queue) are read at scrape time from the router, the
admission counters and the last heartbeat of each engine and of the tokenizer pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from frontend.serving import Pipeline

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
                                "Requests answered with an HTTP error, by status",
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

    def watch(self, pipe: "Pipeline") -> None:
        """Export the live state of ``pipe`` at every scrape."""
        self.registry.register(_StateCollector(pipe))


class _StateCollector:
    def __init__(self, pipe: "Pipeline") -> None:
        self.pipe = pipe

    def describe(self):
        return []

    def collect(self):
        pipe = self.pipe
        running = waiting = used = total = hits = queries = 0
        healthy = GaugeMetricFamily("roseserve_engine_healthy",
                                    "1 when the engine is ready and answering", labels=["engine"])
        load = GaugeMetricFamily("roseserve_engine_load",
                                 "Requests assigned to the engine and not finished",
                                 labels=["engine"])
        routed = CounterMetricFamily("roseserve_engine_routed_requests",
                                     "Requests routed to the engine, by why: for a prefix it "
                                     "held, or by load", labels=["engine", "reason"])
        hit_rate = GaugeMetricFamily("roseserve_engine_prefix_cache_hit_rate",
                                     "The engine's prompt tokens served from its prefix cache "
                                     "/ looked up", labels=["engine"])
        requests = GaugeMetricFamily("roseserve_engine_requests",
                                     "Requests in the engine (last heartbeat), by state",
                                     labels=["engine", "state"])
        blocks = GaugeMetricFamily("roseserve_engine_kv_blocks",
                                   "The engine's KV blocks (last heartbeat): used by requests, "
                                   "cached (free, holding a reusable prefix), free in all",
                                   labels=["engine", "state"])
        for e in pipe.engines.engines:
            healthy.add_metric([e.address], float(e.client.healthy))
            load.add_metric([e.address], e.load)
            routed.add_metric([e.address, "prefix"], e.num_prefix_routed)
            routed.add_metric([e.address, "load"], e.num_routed - e.num_prefix_routed)
            pong = e.client.last_pong
            if pong is None:
                continue
            s = pong.stats
            requests.add_metric([e.address, "running"], s.num_running)
            requests.add_metric([e.address, "waiting"], s.num_waiting)
            blocks.add_metric([e.address, "used"], s.num_blocks_used)
            blocks.add_metric([e.address, "cached"], s.num_blocks_cached)
            blocks.add_metric([e.address, "free"], s.num_blocks_free)
            if e.client.healthy:
                running += s.num_running
                waiting += s.num_waiting
                used += s.num_blocks_used
                total += s.num_blocks_total
            hits += s.prefix_cache_hit_tokens
            queries += s.prefix_cache_query_tokens
            hit_rate.add_metric([e.address], s.prefix_cache_hit_tokens / max(
                1, s.prefix_cache_query_tokens))
        yield healthy
        yield load
        yield routed
        yield hit_rate
        yield requests
        yield blocks
        yield GaugeMetricFamily("roseserve_requests_in_progress",
                                "HTTP completion requests being served (admitted, not ended)",
                                value=pipe.num_jobs)
        yield GaugeMetricFamily("roseserve_admitted_requests",
                                "Engine requests admitted and not yet producing tokens",
                                value=pipe.admission.requests)
        yield GaugeMetricFamily("roseserve_admitted_prompt_tokens",
                                "Their prompt tokens (estimated until tokenized)",
                                value=pipe.admission.tokens)
        yield GaugeMetricFamily("roseserve_engines_healthy", "Engines answering",
                                value=sum(e.client.healthy for e in pipe.engines.engines))
        yield GaugeMetricFamily("roseserve_num_requests_running", "Requests running in engines",
                                value=running)
        yield GaugeMetricFamily("roseserve_num_requests_waiting",
                                "Requests waiting in engines, plus admitted here but not "
                                "started", value=waiting + pipe.admission.requests)
        yield GaugeMetricFamily("roseserve_kv_cache_usage_ratio",
                                "Fraction of KV blocks in use by requests",
                                value=used / total if total else 0.0)
        yield GaugeMetricFamily("roseserve_prefix_cache_hit_rate",
                                "Prompt tokens served from the prefix cache / looked up",
                                value=hits / queries if queries else 0.0)
        pool = pipe.tokenizer_client.last_pong
        yield GaugeMetricFamily("roseserve_tokenizer_queue",
                                "Tokenize jobs waiting or running in the pool",
                                value=(pool.num_pending if pool else 0)
                                + pipe.tokenizer_client.num_pending)
