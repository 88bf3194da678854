"""Request traces (--otlp-traces-endpoint, frontend/tracing.py): a span per request,
sent over OTLP/HTTP to a collector, here a stand-in that decodes what it receives;
the span is a child of the caller's trace context and carries the request's numbers."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import processes

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector():
    """Every span an OTLP/HTTP client sends to /v1/traces, decoded."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    spans: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    spans.extend(scope.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", spans
    finally:
        server.shutdown()


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([v.string_value for v in value.array_value.values]
                       if kind == "array_value" else getattr(value, kind))
    return out


def wait_for(spans: list, request_id: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for span in spans:
            if attributes(span).get("gen_ai.request.id") == request_id:
                return span
        time.sleep(0.1)
    raise AssertionError(f"no span for {request_id}; got {len(spans)} spans")


def test_each_request_is_a_span_in_its_callers_trace(tmp_path, tiny_llama_dir, collector):
    endpoint, spans = collector
    with processes.local_stack(tiny_llama_dir, tmp_path, "--served-model-name", "t",
                               "--otlp-traces-endpoint", endpoint) as front:
        r = httpx.post(front.url + "/v1/completions", timeout=60, headers={
            "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, json={
            "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True, "n": 2,
            "temperature": 0.5})
        assert r.status_code == 200
        body = r.json()
        span = wait_for(spans, body["id"])
        assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
        got = attributes(span)
        assert got["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
        assert got["gen_ai.usage.completion_tokens"] == 10
        assert got["gen_ai.response.finish_reasons"] == ["length", "length"]
        assert got["gen_ai.response.model"] == "t" and got["gen_ai.request.n"] == 2
        assert got["gen_ai.request.max_tokens"] == 5 and got["gen_ai.request.temperature"] == 0.5
        e2e = got["gen_ai.latency.e2e"]
        assert 0 < got["gen_ai.latency.time_to_first_token"] <= e2e
        assert 0 <= got["gen_ai.latency.time_in_queue"] and 0 < got["gen_ai.latency.time_in_model_prefill"]
        assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-3
        assert abs(span.end_time_unix_nano / 1e9 - time.time()) < 60   # wall-clock times

        # Without a trace context, a trace of its own; a streamed chat the same way.
        r = httpx.post(front.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "stream": True})
        first = next(line for line in r.text.splitlines() if line.startswith("data: {"))
        chat_id = first.split('"id":"')[1].split('"')[0]
        span = wait_for(spans, chat_id)
        assert span.trace_id.hex() != TRACE_ID and not span.parent_span_id
        assert attributes(span)["roseserve.stream"] is True


def test_a_request_that_fails_is_a_span_in_error(tmp_path, tiny_llama_dir, collector):
    """A request the server's timeout ends (an engine slowed to 0.2 s a step)."""
    endpoint, spans = collector
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock",
                              env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.2"})
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", workers=1)
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--request-timeout", "0.5", "--otlp-traces-endpoint", endpoint)
    try:
        processes.wait_healthy(front)
        r = httpx.post(front.url + "/v1/completions", timeout=60, json={
            "prompt": "Hello", "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 504
        deadline = time.monotonic() + 15
        while not [s for s in spans if s.status.code == s.status.STATUS_CODE_ERROR]:
            assert time.monotonic() < deadline, "no span in error"
            time.sleep(0.1)
        span = next(s for s in spans if s.status.code == s.status.STATUS_CODE_ERROR)
        assert "request timeout" in span.status.message
        assert attributes(span)["http.response.status_code"] == 504
        assert attributes(span)["gen_ai.request.id"].startswith("cmpl-")
    finally:
        for p in (front, pool, engine):
            p.stop()


def test_an_endpoint_that_is_not_an_http_url_is_refused(tiny_llama_dir):
    proc = processes.Proc(["frontend", "--model", str(tiny_llama_dir),
                           "--otlp-traces-endpoint", "collector:4317"])
    assert proc.proc.wait(60) == 2
    assert "must be an http:// or https:// URL (OTLP/HTTP), got 'collector:4317'" in proc.output()


def test_tracing_without_opentelemetry_stops_the_frontend_with_how_to_install_it(
        tmp_path, tiny_llama_dir):
    """The frontend, with OpenTelemetry's SDK hidden from it (its API stays: FastAPI
    imports it): one clear line."""
    hide = tmp_path / "hide"
    (hide / "opentelemetry" / "sdk").mkdir(parents=True)   # in its namespace package
    (hide / "opentelemetry" / "sdk" / "__init__.py").write_text("raise ImportError('hidden')")
    proc = processes.Proc(["frontend", "--model", str(tiny_llama_dir),
                           "--otlp-traces-endpoint", "http://127.0.0.1:1/v1/traces"],
                          {"PYTHONPATH": str(hide)})
    assert proc.proc.wait(120) == 2
    assert "pip install 'roseserve[tracing]'" in proc.output()
