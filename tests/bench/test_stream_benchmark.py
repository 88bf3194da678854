"""benchmarks/stream.py: its statistics, and one short run against a real stack."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
from fastapi import Request  # resolved by FastAPI from this module's globals

import processes
from benchmarks.stream_stats import (arrival_offsets, itls, percentile, p50_95_99,
                                     tokens_per_second_over_time, tpot)


def test_percentiles_interpolate_like_numpy():
    values = [7.0, 1.0, 3.0, 10.0, 4.0, 2.5]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert p50_95_99([1, 2, 3, 4]) == (2.5, 3.85, 3.97)


def test_tpot_and_itl_definitions():
    times = [10.0, 10.1, 10.3, 10.6]
    assert itls(times) == pytest.approx([0.1, 0.2, 0.3])
    # 4 tokens: 3 gaps after the first token over 0.6 s.
    assert tpot(times, 4) == pytest.approx(0.2)
    # A chunk may carry several tokens: TPOT divides by tokens, not chunks.
    assert tpot([0.0, 0.5], 6) == pytest.approx(0.1)
    assert tpot([1.0], 1) is None


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    a = arrival_offsets(4000, request_rate=20.0, burstiness=1.0, seed=3)
    assert a == arrival_offsets(4000, request_rate=20.0, burstiness=1.0, seed=3)
    assert a != arrival_offsets(4000, request_rate=20.0, burstiness=1.0, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps > 0).all()
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    # Exponential gaps: coefficient of variation 1. Burstiness 4: 1 / sqrt(4).
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.08)
    regular = np.diff(arrival_offsets(4000, request_rate=20.0, burstiness=4.0, seed=3))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, rel=0.08)


def test_without_a_rate_arrivals_follow_the_interval():
    assert arrival_offsets(4, None, 1.0, 0, interval_s=0.02) == pytest.approx([0, 0.02, 0.04, 0.06])
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 5.0, 0.0, 0)


def test_tokens_per_second_bins():
    starts, rates = tokens_per_second_over_time([0.1, 0.2, 1.5, 2.9], [1, 2, 1, 4], bin_s=1.0)
    assert starts == [0.0, 1.0, 2.0] and rates == [3.0, 1.0, 4.0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    with processes.local_stack(tiny_llama_dir, tmp_path_factory.mktemp("bench-stack"),
                               "--served-model-name", "tiny") as front:
        yield front.url


def bench(url, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "benchmarks/stream.py", "--url", url, "--json",
                           str(out), "--no-progress", "--label", name, *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_a_short_run_writes_every_request(stack, tmp_path, tiny_llama_dir):
    stdout, summary = bench(stack, tmp_path, "text", "--num-requests", "12",
                            "--max-new-tokens", "8", "--no-stop-on-eos", "--unique-prompts",
                            "--warmup-runs", "0", "--plot", str(tmp_path / "run.png"))
    for line in ("Model: tiny", "Pretok: False", "Requests: 12 (failed: 0)",
                 "Completion tokens (total): 96", "Submit wall:", "add_request latency",
                 "Tokenize p50/p95/p99", "Queue wait", "Prefill->first token", "TTFT",
                 "TPOT", "ITL", "Latency", "Throughput (completion,total)"):
        assert line in stdout
    assert [r["index"] for r in summary["requests"]] == list(range(12))
    for r in summary["requests"]:
        assert r["error"] is None and r["completion_tokens"] == 8
        assert r["finish_reason"] == "length" and len(r["itl_ms"]) == 7
        assert r["ttft_ms"] > 0 and r["latency_ms"] >= r["ttft_ms"]
        assert set(r["server_timing"]) == {"tokenize_ms", "queue_ms", "prefill_ms", "ttft_ms",
                                           "engine"}
    assert (tmp_path / "run.png").stat().st_size > 10_000

    stdout, pretok = bench(stack, tmp_path, "pretok", "--num-requests", "12",
                           "--max-new-tokens", "8", "--no-stop-on-eos", "--unique-prompts",
                           "--pretok", "--pretok-base-token-ids", "--tokenizer",
                           str(tiny_llama_dir), "--warmup-runs", "0", "--max-concurrency", "4",
                           "--request-rate", "50", "--repeat-runs", "2")
    assert "Pretok: True" in stdout and "median of 2 runs" in stdout
    assert "Client queue wait (max concurrency 4)" in stdout
    assert all(r["server_timing"]["tokenize_ms"] == 0 for r in pretok["requests"])
    assert len(pretok["runs"]) == 2

    compare = subprocess.run([sys.executable, "benchmarks/compare.py",
                              str(tmp_path / "text.json"), str(tmp_path / "pretok.json")],
                             capture_output=True, text=True, timeout=60)
    assert compare.returncode == 0
    assert "TTFT p99 (ms)" in compare.stdout and "text" in compare.stdout
    assert "pretok" in compare.stdout


def test_failed_requests_are_reported_with_their_errors(stack, tmp_path):
    out = tmp_path / "bad.json"
    proc = subprocess.run([sys.executable, "benchmarks/stream.py", "--url", stack, "--json",
                           str(out), "--no-progress", "--num-requests", "3",
                           "--max-new-tokens", "100000", "--warmup-runs", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Requests: 3 (failed: 3)" in proc.stdout
    assert "3 x HTTP 400" in proc.stdout and "maximum context length" in proc.stdout
    assert json.loads(out.read_text())["num_failed"] == 3


class PlainOpenAIServer:
    """A minimal OpenAI-compatible server that is not roseserve (as llama.cpp's
    server answers): one text chunk per token, no token ids, no usage chunk. It
    records the bodies it received."""

    def __init__(self) -> None:
        import threading

        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        app = FastAPI()
        self.bodies: list[dict] = []

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "plain", "owned_by": "someone"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)

            async def events():
                for i in range(body["max_tokens"]):
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason":
                                          "length" if i == body["max_tokens"] - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        self.port = processes.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_peers_compares_roseserve_with_any_openai_server(stack, tmp_path, tiny_llama_dir):
    peer = PlainOpenAIServer()
    try:
        out = tmp_path / "peers.json"
        proc = subprocess.run(
            [sys.executable, "benchmarks/peers.py", "--url", stack, "--peer-url", peer.url,
             "--peer-name", "plain", "--streams", "1,4", "--input-len", "8", "--output-len",
             "6", "--min-requests", "2", "--rounds", "2", "--tokenizer", str(tiny_llama_dir),
             "--json", str(out)], capture_output=True, text=True, timeout=300)
    finally:
        peer.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [row["streams"] for row in report["results"]] == [1, 4]
    for row in report["results"]:
        n = max(2, 2 * row["streams"])
        for name in ("roseserve", "plain"):
            assert len(row[name]["runs"]) == 2
            assert all(r["completion_tokens"] == 6 * n for r in row[name]["runs"]), row[name]
        assert row["ratio_tokens_per_s"] > 0
    # Every round's prompts are new: a repeated one would be served from a prompt cache.
    prompts = [tuple(b["prompt"]) for b in peer.bodies]
    assert len(prompts) == 2 * (2 + 8) and len(set(prompts)) == len(prompts)
    # Nothing roseserve-specific was asked of the peer; ignore_eos is everyone's.
    assert peer.bodies and all("return_token_ids" not in b and b["ignore_eos"]
                               for b in peer.bodies)
    assert "=== roseserve vs plain" in proc.stdout


def test_peers_records_a_failing_peer_and_keeps_what_it_measured(stack, tmp_path,
                                                                  tiny_llama_dir):
    out = tmp_path / "peers.json"
    nothing = f"http://127.0.0.1:{processes.free_port()}"  # no server: every request fails
    proc = subprocess.run(
        [sys.executable, "benchmarks/peers.py", "--url", stack, "--peer-url", nothing,
         "--peer-name", "gone", "--streams", "1,2", "--input-len", "8", "--output-len", "4",
         "--min-requests", "2", "--rounds", "2", "--tokenizer", str(tiny_llama_dir),
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [row["streams"] for row in report["results"]] == [1, 2]
    for row in report["results"]:
        n = max(2, 2 * row["streams"])
        mine = row["roseserve"]
        assert [r["completion_tokens"] for r in mine["runs"]] == [4 * n, 4 * n]
        assert mine["tokens_per_s"] > 0
        assert [r["failed"] for r in row["gone"]["runs"]] == [n, n]
        assert row["gone"]["tokens_per_s"] is None and row["ratio_tokens_per_s"] is None
    assert "12 requests failed" in proc.stdout  # 2 rounds x (2 + 4) requests
