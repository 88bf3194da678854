"""The compose cluster, checked from the host through its published port with the
official openai client (run by scripts/compose-test once the cluster is up).

    python tests/compose_check.py --url http://127.0.0.1:8000 --project roseserve-ci

Checks: both engines healthy; a completion and a streamed chat; then
``docker compose kill engine-0`` during streams: the streams on it fail over to
engine-1 and every stream completes, new requests are served by engine-1 meanwhile; ``docker compose start engine-0`` and it rejoins (requests are
routed to it again). Docker counts a kill through its API as a manual stop, to which
restart policies do not apply, so the restart policy is checked with a crash: the
engine process of engine-1 is SIGKILLed from the host, and the container must be
restarted by its policy and rejoin. Prints each phase's duration.

    python tests/compose_check.py --prometheus http://127.0.0.1:9090

checks the monitoring profile instead: its Prometheus scrapes the frontend and has
the requests the checks above made.

    python tests/compose_check.py --disagg http://127.0.0.1:8001 --url http://127.0.0.1:8000

checks the disagg profile: its frontend's greedy completions equal the mixed
engines', each computed by the prefill engine and decoded by the decode engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.stack import metric as parse_metric, scrape  # noqa: E402


def metric(url: str, name: str, **labels) -> float:
    return parse_metric(scrape(url), name, **labels)


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return time.monotonic() - start
        except (httpx.HTTPError, OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAILED: {what} not within {timeout_s:.0f} s")


class Phases:
    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []
        self.start = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.rows.append((name, now - self.start))
        print(f"[compose-check] {name}: {now - self.start:.1f} s", flush=True)
        self.start = now


def docker_inspect(container: str, template: str) -> str:
    return subprocess.run(["docker", "inspect", "-f", template, container], capture_output=True,
                          text=True, check=True).stdout.strip()


def engine_address(compose: list[str], service: str) -> str:
    """The engine's address as the frontend names it: the frontend resolves the
    service's DNS name (frontend/membership.py) to its container's address."""
    container = subprocess.run(compose + ["ps", "-q", service], capture_output=True, text=True,
                               check=True).stdout.strip()
    ip = docker_inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    return f"tcp://{ip}:5557"


def routed_again(url: str, client, model: str, engine: str) -> None:
    """Requests reach ``engine`` again (distinct one-token prompts at once: spread by
    load; one after another, each would go to the engine routed the fewest so far,
    which the one that took over the other's streams is not)."""
    before = metric(url, "roseserve_engine_routed_requests_total", engine=engine)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.completions.create(model=model, prompt=[100 + i],
                                                          max_tokens=16), range(8)))
    after = metric(url, "roseserve_engine_routed_requests_total", engine=engine)
    assert after > before, f"nothing routed to {engine}: {before} -> {after}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--project", default="roseserve-ci")
    p.add_argument("--compose", default="docker compose")
    p.add_argument("--prometheus", default=None,
                   help="check the monitoring profile's Prometheus at this URL instead")
    p.add_argument("--disagg", default=None,
                   help="check the disagg profile's frontend at this URL (against --url's "
                        "output) instead")
    args = p.parse_args()
    if args.prometheus:
        return check_prometheus(args.prometheus)
    if args.disagg:
        return check_disagg(args.disagg, args.url, args.compose.split() + ["-p", args.project])
    url = args.url
    phases = Phases()
    compose = args.compose.split() + ["-p", args.project]

    wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 600,
             "the frontend's /health 200")
    wait_for(lambda: metric(url, "roseserve_engines_healthy") == 2, 300, "both engines healthy")
    phases.done("cluster healthy (2 engines)")
    # The engines run as an unprivileged user: their kernel cache volume must be
    # writable by it, or they fall back to torch's slower ops with only a warning. The
    # file looked for is the one this image's source builds (a volume kept from an
    # earlier image may hold others).
    built = subprocess.run(compose + ["exec", "-T", "engine-0", "python", "-c",
                                      "from engine_worker.cpu.build import cached_path; "
                                      "p = cached_path(); print(p); assert p.is_file()"],
                           capture_output=True, text=True)
    assert built.returncode == 0 and built.stdout.strip(), (
        f"this image's compiled kernels are not in the kernel-cache volume: "
        f"{built.stdout}{built.stderr}")
    phases.done(f"compiled kernels cached in the volume ({built.stdout.split()[0]})")
    check_curve(compose)
    phases.done("the engines and the tokenizer pool serve only holders of the cluster key")

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens >= 1, completion
    text, usage = "", None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
            stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text and usage is not None and usage.completion_tokens >= 1, (text, usage)
    response = client.responses.create(model=model, input="Say hello.", max_output_tokens=8,
                                       temperature=0)
    assert response.output_text and response.usage.output_tokens >= 1, response
    phases.done(f"completion, streamed chat and a response served ({model})")

    # A prompt for the KV store: its blocks are put there as it ends; asked again once
    # both engines have restarted (below), it is pulled from there.
    store_prompt = list(range(1000, 1256))   # 15 full blocks of 16 before its last token
    stored = client.completions.create(model=model, prompt=store_prompt, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    wait_for(lambda: metric(url, "roseserve_kv_store_put_blocks_total") >= 15, 30,
             "the prompt's blocks put to the KV store")
    assert metric(url, "roseserve_kv_store_up") == 2

    # Streams on both engines (distinct short prompts spread by load), then a crash.
    results: list[dict] = [{} for _ in range(8)]

    def run_stream(i: int) -> None:
        r = results[i]
        try:
            stream = client.completions.create(
                model=model, prompt=f"Count to one hundred, {i}:", max_tokens=400,
                stream=True, extra_body={"ignore_eos": True})
            n, last = 0, None
            for chunk in stream:
                n += 1
                now = time.monotonic()
                r["first"] = r.get("first") or now
                if last is not None:   # (the longest wait between two chunks)
                    r["gap"] = max(r.get("gap", 0.0), now - last)
                last = now
                if chunk.choices and chunk.choices[0].finish_reason:
                    r["finish"] = chunk.choices[0].finish_reason
            r["chunks"] = n
        except openai.APIError as e:
            r["error"] = str(e)
        finally:
            r["ended"] = time.monotonic()

    threads = [threading.Thread(target=run_stream, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    wait_for(lambda: all(r.get("first") for r in results), 120, "every stream started")
    killed = time.monotonic()
    subprocess.run(compose + ["kill", "-s", "SIGKILL", "engine-0"], check=True,
                   capture_output=True)
    # New requests meanwhile: engine-1 serves them.
    for _ in range(3):
        c = client.completions.create(model=model, prompt="Hi", max_tokens=4)
        assert c.usage.completion_tokens >= 1
    served_after = time.monotonic() - killed
    for t in threads:
        t.join(300)
    failed = [r for r in results if "error" in r or r.get("finish") != "length"]
    assert not failed, failed
    moved = metric(url, "roseserve_request_failovers_total")
    assert 0 < moved < len(results), f"{moved} streams failed over: {results}"
    phases.done(f"engine-0 killed: the {moved:.0f} streams on it continued on engine-1 "
                f"(failover), all {len(results)} complete, the longest stall "
                f"{max(r.get('gap', 0.0) for r in results):.2f} s; new requests served "
                f"{served_after:.2f} s after the kill")

    subprocess.run(compose + ["start", "engine-0"], check=True, capture_output=True)
    back = wait_for(lambda: metric(url, "roseserve_engines_healthy") == 2, 300,
                    "engine-0 started again and healthy")
    routed_again(url, client, model, engine_address(compose, "engine-0"))
    phases.done(f"docker compose start engine-0: rejoined {back:.1f} s later, requests "
                f"routed to it again")

    # A crash: the engine process dies inside its container; the policy restarts it.
    container = subprocess.run(compose + ["ps", "-q", "engine-1"], capture_output=True,
                               text=True, check=True).stdout.strip()
    restarts = int(docker_inspect(container, "{{.RestartCount}}"))
    init_pid = int(docker_inspect(container, "{{.State.Pid}}"))
    engine_pid = psutil.Process(init_pid).children()[0].pid  # under docker-init (init: true)
    os.kill(engine_pid, signal.SIGKILL)
    crashed = time.monotonic()
    wait_for(lambda: int(docker_inspect(container, "{{.RestartCount}}")) > restarts, 120,
             "engine-1 restarted by its restart policy")
    restarted = time.monotonic() - crashed
    wait_for(lambda: metric(url, "roseserve_engines_healthy") == 2, 300,
             "engine-1 healthy again")
    rejoined = time.monotonic() - crashed
    routed_again(url, client, model, engine_address(compose, "engine-1"))
    phases.done(f"engine-1 process crashed: container restarted by its policy after "
                f"{restarted:.1f} s, serving again {rejoined:.1f} s after the crash")
    # Both engines have restarted since the store's prompt: their pools are empty, and
    # the one it goes to pulls its blocks from the store.
    again = client.completions.create(model=model, prompt=store_prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == stored.choices[0].text, (again, stored)
    assert again.usage.prompt_tokens_details.cached_tokens == 240, again.usage
    wait_for(lambda: metric(url, "roseserve_kv_store_hits_total") >= 15, 10,
             "15 blocks pulled from the KV store")
    phases.done("a prompt computed before both engines restarted pulled from the KV store "
                "(240 of 256 tokens), the same output")
    print("[compose-check] passed: " + ", ".join(f"{n} {s:.1f} s" for n, s in phases.rows))
    return 0


def check_curve(compose: list[str]) -> None:
    """From inside the compose network, a health check with the cluster key is answered
    by engine-1 and the tokenizer pool, and the same check without it is not."""
    for kind, address in (("engine", "tcp://engine-1:5557"), ("tokenizer", "tcp://tokenizer:5558")):
        check = ["python", "-m", "roseserve.healthcheck", kind, address, "--timeout", "3"]
        keyed = subprocess.run(compose + ["exec", "-T", "engine-0", *check],
                               capture_output=True, text=True)
        assert keyed.returncode == 0, f"{kind} with the key: {keyed.stdout}{keyed.stderr}"
        plain = subprocess.run(compose + ["exec", "-T", "engine-0", "env",
                                          "ROSESERVE_CURVE_KEY_FILE=", *check],
                               capture_output=True, text=True)
        assert plain.returncode == 1 and "no answer" in plain.stderr, (
            f"{kind} without the key: {plain.returncode} {plain.stdout}{plain.stderr}")


def check_disagg(url: str, mixed_url: str, compose: list[str]) -> int:
    """The disagg profile's frontend answers exactly as the mixed engines do, its
    prompts computed by the prefill engine and their KV blocks pulled by the decode
    engine (none computed again), and both engines end with no block in use."""
    took = wait_for(lambda: metric(url, "roseserve_engines_healthy") == 2, 300,
                    "the prefill and the decode engine healthy")
    prompt = ("Explain, step by step and with an example for each, how a paged KV cache "
              "lets a server share prompt prefixes between requests.")
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    prefill, decode = (engine_address(compose, s) for s in ("engine-prefill", "engine-decode"))
    # Distinct from their first block on: each has blocks for the decode engine to pull.
    bodies = [{"model": model, "prompt": f"{i}. {prompt}", "max_tokens": 12, "temperature": 0,
               "return_token_ids": True} for i in range(1, 5)]
    for body in bodies:
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        want = httpx.post(f"{mixed_url}/v1/completions", json=body, timeout=120).json()
        ids = got["choices"][0]["token_ids"]
        assert ids == want["choices"][0]["token_ids"], (got, want)
        timing = got["timing"]
        assert (timing["prefill_engine"], timing["engine"]) == (prefill, decode), timing
        assert timing["kv_outcome"] == "complete", timing
    wait_for(lambda: metric(url, "roseserve_kv_transfer_blocks_total", direction="received") > 0
             and metric(url, "roseserve_engine_kv_blocks", state="used") == 0
             and metric(url, "roseserve_kv_leases") == 0, 30,
             "the transfers counted and every block let go")
    assert metric(url, "roseserve_kv_transfer_fallbacks_total") == 0
    received = metric(url, "roseserve_kv_transfer_blocks_total", direction="received")
    print(f"[compose-check] disagg: {len(bodies)} completions token-identical to the mixed "
          f"engines', {received:.0f} KV blocks pulled from the prefill engine (engines healthy "
          f"after {took:.1f} s)")
    return 0


def check_prometheus(prom: str) -> int:
    """The frontend is a target that is up, and the requests made are counted."""
    def value(expr: str) -> float:
        result = httpx.get(f"{prom}/api/v1/query", params={"query": expr},
                           timeout=5).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    took = wait_for(lambda: value('up{job="roseserve"}') == 1
                    and value("sum(vllm:request_success_total)") > 0, 180,
                    "Prometheus scraping the frontend, with its requests counted")
    print(f"[compose-check] monitoring: Prometheus scrapes the frontend ({took:.1f} s), "
          f"{value('sum(vllm:request_success_total)'):.0f} requests counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
