"""The Swarm stack (deploy/swarm/stack.yml), checked under load from the host (run by
scripts/swarm-test once the stack is deployed).

    python tests/swarm_check.py --stack roseserve-ci [--url http://127.0.0.1:8000]

While clients stream completions without pause (a new connection per request), it
(a) scales the engines 2 -> 3 -> 1 -> 2 and (b) runs ``docker service update
--force`` on the engines, then on the frontends. Every request must complete in
full: no error, no request cut short. Prints each phase's duration and the request
counts.

With ``--url`` the requests go through Swarm's routing mesh. Without it (CI: the
kernel of this project's machines has no IPVS, which the mesh needs), the clients
spread requests over the frontend tasks themselves, reaching each at its address on
the node's docker_gwbridge network and looking the tasks up again every second. A
connection refused or not answered within 3 s (a frontend on its way out or gone;
the request never reached it) is tried on another frontend, as a balancer does; it
is counted, not failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.stack import metric as parse_metric  # noqa: E402
from compose_check import wait_for  # noqa: E402

MAX_TOKENS = 32
CLIENTS = 6


class Frontends:
    """Where the frontends are: the mesh's URL, or each frontend task's address on
    docker_gwbridge (refreshed every second by ``watch``)."""

    def __init__(self, url: Optional[str], stack: str) -> None:
        self.mesh, self.stack = url, stack
        self.urls: list[str] = [url] if url else []
        self.turn = itertools.count()
        if url is None:
            self.refresh()

    def refresh(self) -> None:
        def run(*args: str) -> str:
            return subprocess.run(["docker", *args], capture_output=True, text=True,
                                  check=True).stdout

        try:
            tasks = run("ps", "-q", "--no-trunc", "--filter",
                        f"label=com.docker.swarm.service.name={self.stack}_frontend").split()
            # The bridge exists once the node's first task has started.
            bridge = json.loads(run("network", "inspect", "docker_gwbridge", "-f",
                                    "{{json .Containers}}") or "{}") or {}
        except (subprocess.CalledProcessError, ValueError):
            return  # not yet, or docker was busy: the last answer stands
        self.urls = sorted(f"http://{bridge[t]['IPv4Address'].split('/')[0]}:8000"
                           for t in tasks if t in bridge)

    def watch(self, stop: threading.Event) -> None:
        while self.mesh is None and not stop.wait(1.0):
            self.refresh()

    def next(self) -> str:
        urls = self.urls
        if not urls:
            raise httpx.ConnectError("no frontend task is running")
        return urls[next(self.turn) % len(urls)]


@dataclass
class Load:
    """Clients streaming completions until stopped; what each request got."""

    frontends: Frontends
    model: str
    done: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    # Connections refused, each tried again on another frontend.
    refused: int = 0

    def run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            self.done.append(self.one(f"Client {i}, request {n}:"))
            n += 1

    def one(self, prompt: str) -> dict:
        for _ in range(20):
            try:
                return self.attempt(self.frontends.next(), prompt)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                self.refused += 1
                time.sleep(0.2)
        return {"tokens": 0, "error": "no frontend accepted the connection"}

    def attempt(self, url: str, prompt: str) -> dict:
        r: dict = {"tokens": 0, "frontend": url}
        try:
            # A fresh connection each time: each request may land on another frontend.
            with httpx.Client(timeout=httpx.Timeout(120, connect=3)) as client, client.stream(
                    "POST", f"{url}/v1/completions", json={
                        "model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}) as response:
                r["status"] = response.status_code
                if response.status_code != 200:
                    r["error"] = response.read().decode(errors="replace")[:300]
                    return r
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        r["error"] = chunk["error"].get("message")
                    if chunk.get("usage"):
                        r["tokens"] = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        r["finish"] = choice.get("finish_reason") or r.get("finish")
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise
        except httpx.HTTPError as e:
            r["error"] = f"{type(e).__name__}: {e}"
        return r

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.done if r.get("error") or r.get("finish") != "length"
                or r["tokens"] != MAX_TOKENS]


def store_prompt(url: str, model: str) -> dict:
    """A 256-token prompt (15 full blocks of 16 before its last token), greedy: its text
    and the prompt tokens served from a cache."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": list(range(1000, 1256)), "max_tokens": 8,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["text"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def engines_everywhere(frontends: Frontends, n: int) -> bool:
    """Every frontend reports ``n`` healthy engines (through the mesh: a few scrapes,
    each through a new connection, land on each of them)."""
    urls = frontends.urls * 3 if frontends.mesh else frontends.urls
    if len(urls) < 2:
        return False
    for url in urls:
        with httpx.Client(timeout=10) as client:
            text = client.get(f"{url}/metrics").text
        if parse_metric(text, "roseserve_engines_healthy") != n:
            return False
    return True


def docker(*args: str) -> None:
    subprocess.run(["docker", *args], check=True, capture_output=True, text=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=None, help="the routing mesh's URL (default: reach "
                                                 "each frontend task directly)")
    p.add_argument("--stack", default="roseserve-ci")
    args = p.parse_args()
    engine, frontend = f"{args.stack}_engine", f"{args.stack}_frontend"
    frontends = Frontends(args.url, args.stack)
    stop_watching = threading.Event()
    threading.Thread(target=frontends.watch, args=(stop_watching,), daemon=True).start()
    rows: list[str] = []
    start = time.monotonic()

    def phase(name: str) -> None:
        nonlocal start
        now = time.monotonic()
        rows.append(f"{name} {now - start:.1f} s")
        print(f"[swarm-check] {name}: {now - start:.1f} s", flush=True)
        start = now

    wait_for(lambda: all(httpx.get(f"{u}/health", timeout=5).status_code == 200
                         for u in frontends.urls) and frontends.urls, 600,
             "the frontends' /health 200")
    wait_for(lambda: engines_everywhere(frontends, 2), 600, "2 engines healthy on every frontend")
    phase(f"stack healthy (frontends {', '.join(frontends.urls)}, 2 engines)")
    model = httpx.get(f"{frontends.next()}/v1/models", timeout=10).json()["data"][0]["id"]
    load = Load(frontends, model)
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    wait_for(lambda: len(load.done) >= CLIENTS, 120, "the load running")
    phase(f"load running ({CLIENTS} streaming clients)")
    for n in (3, 1, 2):
        docker("service", "scale", "--detach", f"{engine}={n}")
        wait_for(lambda: engines_everywhere(frontends, n), 600, f"{n} engines on every frontend")
        phase(f"engines scaled to {n}")
    # A prompt whose blocks go to the KV store; once the update has replaced every
    # engine (empty pools), it is pulled from there.
    stored = store_prompt(frontends.next(), model)
    for service in (engine, frontend):
        docker("service", "update", "--force", "--detach=false", "--quiet", service)
        wait_for(lambda: engines_everywhere(frontends, 2), 600, "2 engines on every frontend")
        phase(f"docker service update --force {service}")
        if service == engine:
            again = store_prompt(frontends.next(), model)
            assert again["text"] == stored["text"], (again, stored)
            assert again["cached"] == 240, again
            phase("every engine replaced: a prompt computed before pulled from the KV store "
                  "(240 of 256 tokens), the same output")
    load.stop.set()
    for t in threads:
        t.join(180)
    stop_watching.set()
    failed = load.failed
    print(f"[swarm-check] {len(load.done)} requests, {len(failed)} failed, {load.refused} "
          f"connection(s) refused and tried on another frontend", flush=True)
    if failed:
        print(json.dumps(failed[:10], indent=1))
        return 1
    print(f"[swarm-check] passed: {len(load.done)} requests, 0 failed; " + ", ".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
