"""Request traces in OpenTelemetry (``--otlp-traces-endpoint``): one span per completion,
chat or Responses request that reached an engine, sent over OTLP/HTTP to a collector
(Jaeger, Tempo, an OpenTelemetry Collector...).

The span is made when the request ends, from the times its job recorded, so tracing
costs a request nothing while it runs. Its parent is the caller's span where the
request carries W3C trace context (``traceparent``, ``tracestate``), so the server's
part shows inside the caller's trace. Names follow OpenTelemetry's generative-AI
conventions as vLLM's spans do (``llm_request``, ``gen_ai.*`` attributes), with the
engine-side times as ``gen_ai.latency.*``.

The OpenTelemetry SDK and exporter are the optional ``tracing`` extra
(``pip install 'roseserve[tracing]'``); they are imported only when tracing is on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from frontend.job import Job

# The incoming headers that carry a caller's trace context (W3C Trace Context).
TRACE_HEADERS = ("traceparent", "tracestate")
# Spans wait at most this long before they are sent, in batches.
EXPORT_DELAY_MS = 1000


def trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context a request carries, if any."""
    return {k: headers[k] for k in TRACE_HEADERS if k in headers}


def require() -> None:
    """Raises ValueError, saying how to install it, when OpenTelemetry is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry ({e}); install it "
                         f"with: pip install 'roseserve[tracing]'") from None


class Tracer:
    def __init__(self, endpoint: str, service_name: str = "roseserve") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("roseserve.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        self.failed = lambda message: Status(StatusCode.ERROR, message)

    def record(self, job: "Job") -> None:
        """The span of a finished job that reached an engine."""
        # The job's times are monotonic; spans take wall-clock nanoseconds.
        to_wall = time.time() - time.monotonic()

        def ns(t: float) -> int:
            return int((t + to_wall) * 1e9)

        span = self.tracer.start_span(
            "llm_request", context=self.propagator.extract(carrier=job.trace),
            kind=self.kind, start_time=ns(job.received), attributes=_attributes(job))
        if job.error is not None:   # what ended it, where not every choice finishing
            span.set_status(self.failed(job.error.message))
            span.set_attribute("http.response.status_code", job.error.status)
        span.end(end_time=ns(job.finished))

    def shutdown(self) -> None:
        """Send what is waiting, then stop."""
        self.provider.shutdown()


def _attributes(job: "Job") -> dict:
    usage = job.usage()
    params = job.params[0] if job.params else None
    out: dict = {
        "gen_ai.request.id": job.request_id,
        "gen_ai.response.model": job.model,
        "gen_ai.request.n": job.keep or job.n,
        "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": usage["completion_tokens"],
        "gen_ai.usage.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in job.choices],
        "gen_ai.latency.e2e": job.finished - job.received,
        "roseserve.engine": job.engine_address or "",
        "roseserve.stream": job.stream,
    }
    if params is not None:
        out["gen_ai.request.temperature"] = params.temperature
        out["gen_ai.request.top_p"] = params.top_p
        if params.max_tokens is not None:
            out["gen_ai.request.max_tokens"] = params.max_tokens
    if job.first_token_time is not None:
        out["gen_ai.latency.time_to_first_token"] = job.first_token_time - job.received
    first = job.choices[0] if job.choices else None
    if first is not None and first.queue_ms is not None:
        out["gen_ai.latency.time_in_queue"] = first.queue_ms / 1e3
    if first is not None and first.prefill_ms is not None:
        out["gen_ai.latency.time_in_model_prefill"] = first.prefill_ms / 1e3
    if job.tokenize_ms:
        out["roseserve.latency.tokenize"] = job.tokenize_ms / 1e3
    return out
