"""Prometheus metrics of one frontend (a registry per app, so tests can build many).

Named and shaped like vLLM's (``vllm:`` prefix, ``model_name`` and ``engine``
labels), so that dashboards and alerts built for vLLM work unchanged: request and
token counters, latency histograms (TTFT, inter-token, end to end, queue, prefill),
running and waiting requests, KV cache usage, prefix-cache queries and hits, and
preemptions. Prefill/decode disaggregation adds each engine's role and its KV
transfers (roseserve_kv_*: blocks and bytes received, sent and skipped, time,
fallbacks by reason, leases held). ``engine`` is the engine's index in the frontend's list (``--engine``
order). What only roseserve has keeps a ``roseserve_`` prefix: tokenize time,
per-engine health, load and routing (labelled by address), admission, rejections
and the tokenizer queue.

Counters and histograms are updated as jobs close (frontend/job.py); gauges and the
engines' own counters (prefix cache, preemptions) are read at scrape time from the
router, the admission counters and the last heartbeat of each engine and of the
tokenizer pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from frontend.job import Job
    from frontend.serving import PipelineSnapshot

# vLLM's buckets, so that histogram_quantile over both gives comparable numbers.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKENIZE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_N_BUCKETS = (1, 2, 5, 10, 20)
_LABELS = ["model_name", "engine"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name = ""
        self.engine_index: dict[str, str] = {}

        def counter(name, doc, extra=()):
            return Counter(name, doc, _LABELS + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)

        self.success = counter("vllm:request_success", "Finished requests (choices), by why",
                               ["finished_reason"])
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Request received to its first token", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a choice", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Request received to response complete", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Time a request waited in the engine before it ran",
                               _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "First step that ran the request to its first token",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "A choice's first token to its last", _REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "A choice's time running: its prefill and its decode",
                                   _REQUEST_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter",
                                  _N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "The max_tokens request parameter, where given",
                                           _TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per request", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request", _TOKEN_BUCKETS)
        self.tokenize = Histogram("roseserve_tokenize_time_seconds",
                                  "Time in the tokenizer pool's worker per request (rendering "
                                  "and encoding)", ["model_name"],
                                  buckets=_TOKENIZE_BUCKETS, registry=self.registry)
        self.rejected = Counter("roseserve_rejected_requests",
                                "Requests answered with an HTTP error, by status",
                                ["status"], registry=self.registry)

    def watch(self, model_name: str, snapshot: Callable[[], "PipelineSnapshot"]) -> None:
        """Export the pipeline's state, as ``snapshot()`` publishes it, at every scrape."""
        self.model_name = model_name
        self.registry.register(_StateCollector(snapshot, model_name, self.index))

    def index(self, address: str) -> str:
        """The engine's ``engine`` label: its number in order of first sight (engines
        join and leave; an address keeps its number)."""
        return self.engine_index.setdefault(address, str(len(self.engine_index)))

    def record(self, job: "Job") -> None:
        """A finished job's counts and latencies."""
        labels = (self.model_name, self.index(job.engine_address))
        self.e2e.labels(*labels).observe(job.finished - job.received)
        if job.first_token_time is not None:
            self.ttft.labels(*labels).observe(job.first_token_time - job.received)
        if job.tokenize_ms:
            self.tokenize.labels(self.model_name).observe(job.tokenize_ms / 1e3)
        prompt_tokens = sum(len(p) for p in job.prompts)
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.params_n.labels(*labels).observe(job.keep or job.n)
        if job.params and job.params[0].max_tokens is not None:
            self.params_max_tokens.labels(*labels).observe(job.params[0].max_tokens)
        for i, choice in enumerate(job.choices):
            generated = len(choice.token_ids)
            self.generation_tokens.labels(*labels).inc(generated)
            self.request_generation_tokens.labels(*labels).observe(generated)
            self.request_prompt_tokens.labels(*labels).observe(len(choice.prompt_token_ids))
            self.success.labels(*labels, choice.finish_reason or "abort").inc()
            if choice.queue_ms is not None:
                self.queue.labels(*labels).observe(choice.queue_ms / 1e3)
            decode = sum(choice.intervals)
            if generated:
                self.decode.labels(*labels).observe(decode)
            if choice.prefill_ms is not None:
                self.prefill.labels(*labels).observe(choice.prefill_ms / 1e3)
                self.inference.labels(*labels).observe(choice.prefill_ms / 1e3 + decode)
            itl = self.itl.labels(*labels)
            for interval in choice.intervals:
                itl.observe(interval)


class _StateCollector:
    def __init__(self, snapshot: Callable[[], "PipelineSnapshot"], model_name: str,
                 index: Callable[[str], str]) -> None:
        self.snapshot = snapshot
        self.model_name = model_name
        self.index = index

    def describe(self):
        return []

    def collect(self):
        snap = self.snapshot()
        yield from _engine_families(snap, self.model_name, self.index)
        yield from _kv_transfer_families(snap)
        yield from _kv_offload_families(snap)
        yield GaugeMetricFamily("roseserve_requests_in_progress",
                                "HTTP completion requests being served (admitted, not ended)",
                                value=snap.num_jobs)
        yield GaugeMetricFamily("roseserve_admitted_requests",
                                "Engine requests admitted here and not yet producing tokens",
                                value=snap.admitted_requests)
        yield GaugeMetricFamily("roseserve_admitted_prompt_tokens",
                                "Their prompt tokens (estimated until tokenized)",
                                value=snap.admitted_tokens)
        yield GaugeMetricFamily("roseserve_engines_healthy", "Engines answering",
                                value=sum(e.healthy for e in snap.engines))
        yield CounterMetricFamily("roseserve_request_retries",
                                  "Requests sent to another engine: theirs refused them "
                                  "(draining) or failed before any output",
                                  value=snap.num_retries)
        yield CounterMetricFamily("roseserve_request_failovers",
                                  "Requests continued on another engine (or the same one "
                                  "restarted) after theirs failed mid-stream",
                                  value=snap.num_failovers)
        yield GaugeMetricFamily("roseserve_kv_store_blocks_known",
                                "KV blocks the shared store is thought to hold (as the "
                                "engines report their puts): routed as held by every engine "
                                "that uses it", value=snap.store_blocks_known)
        yield GaugeMetricFamily("roseserve_tokenizer_queue",
                                "Tokenize jobs waiting or running in the pool",
                                value=snap.tokenizer_queue)


def _engine_families(snap: "PipelineSnapshot", model: str, index: Callable[[str], str]) -> list:
    """Per-engine gauges and counters: vLLM's names with (model_name, engine), and
    roseserve's by address."""
    def family(kind, name, doc, labels=_LABELS):
        return kind(name, doc, labels=labels)

    running = family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Requests in the engine's batch (last heartbeat)")
    waiting = family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Requests queued in the engine (last heartbeat)")
    kv = family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                "Fraction of the engine's KV blocks in use by requests (0-1; with a pool "
                "for sliding-window layers, the fuller pool's)")
    queries = family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prompt tokens looked up in the engine's prefix cache")
    hits = family(CounterMetricFamily, "vllm:prefix_cache_hits", "Of those, tokens served from it")
    preemptions = family(CounterMetricFamily, "vllm:num_preemptions",
                         "Requests the engine preempted (recomputed later)")
    drafted = family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens",
                     "Tokens proposed by the engine's n-gram speculation")
    accepted = family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens",
                      "Of those, tokens kept (the model generated them)")
    healthy = GaugeMetricFamily("roseserve_engine_healthy",
                                "1 when the engine is ready and answering", labels=["engine"])
    draining = GaugeMetricFamily("roseserve_engine_draining",
                                 "1 while the engine finishes its requests before stopping "
                                 "(it is sent no new ones)", labels=["engine"])
    load = GaugeMetricFamily("roseserve_engine_load",
                             "Requests assigned to the engine and not finished", labels=["engine"])
    routed = CounterMetricFamily("roseserve_engine_routed_requests",
                                 "Requests routed to the engine, by why: for a prefix it held, "
                                 "or by load", labels=["engine", "reason"])
    blocks = GaugeMetricFamily("roseserve_engine_kv_blocks",
                               "The engine's KV blocks (last heartbeat): used by requests, "
                               "cached (free, holding a reusable prefix), free in all",
                               labels=["engine", "state"])
    window_blocks = GaugeMetricFamily(
        "roseserve_engine_window_kv_blocks", "The KV blocks of the engine's sliding-window "
        "layers where they are a pool of their own (last heartbeat): used, cached, free in "
        "all", labels=["engine", "state"])
    known = GaugeMetricFamily("roseserve_engine_cached_blocks_known",
                              "Blocks this frontend knows the engine's prefix cache holds "
                              "(from the engine's cache events; routing uses them)",
                              labels=["engine"])
    resyncs = CounterMetricFamily("roseserve_engine_cache_resyncs",
                                  "Snapshots of the engine's prefix cache asked for after "
                                  "missing some of its events", labels=["engine"])
    for e in snap.engines:
        known.add_metric([e.address], e.num_blocks_known)
        resyncs.add_metric([e.address], e.num_cache_resyncs)
        healthy.add_metric([e.address], float(e.healthy))
        draining.add_metric([e.address], float(e.draining))
        load.add_metric([e.address], e.load)
        routed.add_metric([e.address, "prefix"], e.num_prefix_routed)
        routed.add_metric([e.address, "load"], e.num_routed - e.num_prefix_routed)
        if e.stats is None:
            continue
        s, labels = e.stats, [model, index(e.address)]
        running.add_metric(labels, s.num_running if e.healthy else 0)  # a gone engine runs nothing
        waiting.add_metric(labels, s.num_waiting if e.healthy else 0)
        usage = max(s.num_blocks_used / max(1, s.num_blocks_total),
                    s.num_window_blocks_used / max(1, s.num_window_blocks_total))
        kv.add_metric(labels, usage if e.healthy else 0.0)
        queries.add_metric(labels, s.prefix_cache_query_tokens)
        hits.add_metric(labels, s.prefix_cache_hit_tokens)
        preemptions.add_metric(labels, s.num_preemptions)
        drafted.add_metric(labels, s.num_draft_tokens)
        accepted.add_metric(labels, s.num_accepted_tokens)
        blocks.add_metric([e.address, "used"], s.num_blocks_used)
        blocks.add_metric([e.address, "cached"], s.num_blocks_cached)
        blocks.add_metric([e.address, "free"], s.num_blocks_free)
        if s.num_window_blocks_total:
            window_blocks.add_metric([e.address, "used"], s.num_window_blocks_used)
            window_blocks.add_metric([e.address, "cached"], s.num_window_blocks_cached)
            window_blocks.add_metric([e.address, "free"],
                                     s.num_window_blocks_total - s.num_window_blocks_used)
    return [running, waiting, kv, queries, hits, preemptions, drafted, accepted, healthy,
            draining, load, routed, blocks, window_blocks, known, resyncs]


def _kv_transfer_families(snap: "PipelineSnapshot") -> list:
    """Prefill/decode disaggregation, by engine address: each engine's role, and the
    KV blocks decode engines pulled from prefill engines (engine_worker/kv_transfer.py)."""
    role = GaugeMetricFamily("roseserve_engine_role", "1 for the engine's role: mixed, "
                             "prefill or decode", labels=["engine", "role"])
    transfers = CounterMetricFamily("roseserve_kv_transfers", "Prompts whose KV blocks the "
                                    "engine pulled from a prefill engine", labels=["engine"])
    blocks = CounterMetricFamily("roseserve_kv_transfer_blocks", "KV blocks received (verified "
                                 "and used) or sent, and those not pulled because the engine "
                                 "held them already", labels=["engine", "direction"])
    data = CounterMetricFamily("roseserve_kv_transfer_bytes", "KV bytes received or sent",
                               labels=["engine", "direction"])
    seconds = CounterMetricFamily("roseserve_kv_transfer_seconds", "Time from a transfer's "
                                  "start to its end, summed", labels=["engine"])
    fallbacks = CounterMetricFamily("roseserve_kv_transfer_fallbacks", "Transfers that ended "
                                    "early, the rest of the prompt computed by the decode "
                                    "engine, by why", labels=["engine", "reason"])
    leases = GaugeMetricFamily("roseserve_kv_leases", "Prompts whose blocks a prefill engine "
                               "holds for a decode engine", labels=["engine"])
    for e in snap.engines:
        role.add_metric([e.address, e.role], 1.0)
        s = e.stats
        if s is None:
            continue
        transfers.add_metric([e.address], s.kv_transfers)
        for direction, n in (("received", s.kv_blocks_received), ("sent", s.kv_blocks_sent),
                             ("skipped", s.kv_blocks_skipped)):
            blocks.add_metric([e.address, direction], n)
        data.add_metric([e.address, "received"], s.kv_bytes_received)
        data.add_metric([e.address, "sent"], s.kv_bytes_sent)
        seconds.add_metric([e.address], s.kv_transfer_seconds)
        for reason, n in sorted(s.kv_fallbacks.items()):
            fallbacks.add_metric([e.address, reason], n)
        leases.add_metric([e.address], s.kv_leases)
    return [role, transfers, blocks, data, seconds, fallbacks, leases]


def _kv_offload_families(snap: "PipelineSnapshot") -> list:
    """The tiers below each engine's KV pool (engine_worker/kv_offload.py), by tier."""
    labels = ["engine", "tier"]
    held = GaugeMetricFamily("roseserve_kv_offload_blocks", "KV blocks a tier below the "
                             "pool holds", labels=labels)
    data = GaugeMetricFamily("roseserve_kv_offload_bytes", "Bytes of KV blocks a tier below "
                             "the pool holds", labels=labels)
    stored = CounterMetricFamily("roseserve_kv_offload_stored_blocks", "KV blocks copied into "
                                 "a tier as the pool evicted them", labels=labels)
    loaded = CounterMetricFamily("roseserve_kv_offload_loaded_blocks", "KV blocks copied back "
                                 "from a tier instead of computed", labels=labels)
    missed = CounterMetricFamily("roseserve_kv_offload_missed_blocks", "Prompt blocks looked "
                                 "up below the pool and found in no tier", labels=["engine"])
    errors = CounterMetricFamily("roseserve_kv_offload_errors", "KV blocks a tier refused or "
                                 "lost (computed instead), by why", labels=["engine", "reason"])
    store_families = _kv_store_families(snap)
    for e in snap.engines:
        s = e.stats
        if s is None or not s.kv_offload_blocks:
            continue
        for family, counts in ((held, s.kv_offload_blocks), (data, s.kv_offload_bytes),
                               (stored, s.kv_offload_stored), (loaded, s.kv_offload_loaded)):
            for tier in sorted(s.kv_offload_blocks):
                family.add_metric([e.address, tier], counts.get(tier, 0))
        missed.add_metric([e.address], s.kv_offload_missed)
        for reason, n in sorted(s.kv_offload_errors.items()):
            errors.add_metric([e.address, reason], n)
    return [held, data, stored, loaded, missed, errors, *store_families]


def _kv_store_families(snap: "PipelineSnapshot") -> list:
    """Each engine's use of the shared KV store (engine_worker/kv_store_link.py)."""
    up = GaugeMetricFamily("roseserve_kv_store_up", "1 while the engine uses the KV store, 0 "
                           "while it backs off after a failure", labels=["engine"])
    put = CounterMetricFamily("roseserve_kv_store_put_blocks", "KV blocks the engine put to "
                              "the store", labels=["engine"])
    hits = CounterMetricFamily("roseserve_kv_store_hits", "Prompt blocks the engine pulled "
                               "from the store (checked) instead of computing them",
                               labels=["engine"])
    misses = CounterMetricFamily("roseserve_kv_store_misses", "Prompt blocks the engine asked "
                                 "the store for that it did not hold", labels=["engine"])
    errors = CounterMetricFamily("roseserve_kv_store_errors", "Pulls from the store that "
                                 "failed (the rest computed), by why", labels=["engine", "reason"])
    held = GaugeMetricFamily("roseserve_kv_store_blocks", "KV blocks the store holds, by tier, "
                             "as it last told the engine", labels=["engine", "tier"])
    data = GaugeMetricFamily("roseserve_kv_store_bytes", "Bytes of KV blocks the store holds, "
                             "by tier, as it last told the engine", labels=["engine", "tier"])
    for e in snap.engines:
        s = e.stats
        if s is None or s.kv_store_up is None:
            continue
        up.add_metric([e.address], float(s.kv_store_up))
        put.add_metric([e.address], s.kv_store_put_blocks)
        hits.add_metric([e.address], s.kv_store_hits)
        misses.add_metric([e.address], s.kv_store_misses)
        for reason, n in sorted(s.kv_store_errors.items()):
            errors.add_metric([e.address, reason], n)
        for tier in sorted(s.kv_store_blocks):
            held.add_metric([e.address, tier], s.kv_store_blocks[tier])
            data.add_metric([e.address, tier], s.kv_store_bytes.get(tier, 0))
    return [up, put, hits, misses, errors, held, data]
