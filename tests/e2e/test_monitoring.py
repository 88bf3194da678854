"""Monitoring as users run it: a real Prometheus (Debian's package) scrapes a running
`roseserve serve`; after a known load, PromQL through Prometheus's HTTP API finds
the request counts and a plausible TTFT quantile, and every query of the Grafana
dashboard in monitoring/ evaluates."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

import processes

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "roseserve.json"
# vLLM's TTFT buckets (frontend/metrics.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs Prometheus (Debian: apt-get install prometheus; scripts/setup.sh does "
           "it when run as root)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("monitoring")
    serve = processes.Serve(tiny_llama_dir, d / "serve.log")
    prom_port = processes.free_port()
    config = d / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "roseserve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{serve.port}"]}]}]}))
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={d / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=open(d / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    try:
        serve.wait_ready()
        yield {"url": serve.url, "prom": f"http://127.0.0.1:{prom_port}",
               "prom_log": d / "prometheus.log"}
    finally:
        prom.terminate()
        prom.wait(30)
        serve.stop()


def query(prom: str, expr: str) -> list:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for(prom: str, expr: str, want: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        try:
            result = query(prom, expr)
        except (httpx.HTTPError, AssertionError):
            result = []  # Prometheus still starting
        if result:
            value = float(result[0]["value"][1])
            if value >= want:
                return value
        time.sleep(0.5)
    raise AssertionError(f"{expr} = {value}, wanted {want} within {timeout_s} s")


def test_prometheus_sees_requests_and_ttft(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack["url"] + "/v1", api_key="unused")
    ttfts = []
    for i in range(10):
        start = time.monotonic()
        stream = client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=6,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 0:
                ttfts.append(time.monotonic() - start)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=4, n=2, extra_body={"ignore_eos": True})
    # 10 completions + 2 chat choices, all ended by max_tokens.
    done = 'sum(vllm:request_success_total{model_name="tiny",finished_reason="length"})'
    assert wait_for(stack["prom"], done, 12) == 12
    assert wait_for(stack["prom"], 'sum(vllm:generation_tokens_total{model_name="tiny"})',
                    68) == 10 * 6 + 2 * 4
    q50 = query(stack["prom"], 'histogram_quantile(0.5, sum by (le) '
                               '(vllm:time_to_first_token_seconds_bucket{model_name="tiny"}))')
    value = float(q50[0]["value"][1])
    # The server's TTFT is within the client's (which adds HTTP), up to the bucket
    # that holds the slowest one client-side.
    ceiling = next(b for b in TTFT_BUCKETS if b >= max(ttfts))
    assert 0 < value <= ceiling, (value, sorted(ttfts))
    up = query(stack["prom"], 'up{job="roseserve"}')
    assert [float(r["value"][1]) for r in up] == [1.0]


def test_every_dashboard_query_evaluates(stack):
    """The Grafana dashboard's queries, with its variables filled in as Grafana would,
    are valid PromQL over metrics that exist; the main panels have data."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {panel["title"]: [t["expr"] for t in panel["targets"]]
             for panel in dashboard["panels"]}
    assert len(exprs) >= 12
    time.sleep(3)  # a few more scrapes after the load, for rate() windows
    empty = []
    for title, targets in exprs.items():
        for expr in targets:
            filled = expr.replace("$model_name", "tiny").replace("$__rate_interval", "5m")
            if not query(stack["prom"], filled):
                empty.append(title)
    # Data exists for everything that the previous test's load produced. (Preemptions
    # and HTTP errors have no samples until one happens; their metrics are checked
    # by name in /metrics.)
    for title in ("Requests finished / s", "Time to first token", "Inter-token latency",
                  "End-to-end latency", "Requests running / waiting", "KV cache usage",
                  "Tokens / s", "Tokenize time (roseserve)", "Engines healthy (roseserve)"):
        assert title not in empty, (title, empty)
