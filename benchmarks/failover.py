"""Mid-stream failover under load: streams in flight while an engine dies, checked
token for token against the same streams without the fault; printed figures.

    python benchmarks/failover.py                  # default model, --engines 2, every fault
    python benchmarks/failover.py --faults kill --streams 32 --max-tokens 128 \\
        --json docs/bench/failover.json -- --model /path/to/model   # after --: serve's flags

Starts ``roseserve serve --engines 2`` (and, for the fault "pd", ``--prefill-engines 1
--decode-engines 2``), runs --streams streamed completions of --max-tokens tokens
(half greedy, half sampled with a seed each) once as they are (the reference), then
once for each fault, on the same stack, applied when every stream has a quarter of
its tokens:

  kill        SIGKILL one engine
  kill-twice  SIGKILL one engine, then, once it is back and every stream is moving
              again, the other (the streams it took over fail over a second time)
  restart     a rolling restart (SIGHUP): each engine drains and is restarted in turn
  pd          SIGKILL one of the two decode engines

Reported for each: streams complete, error events, outputs identical to the reference
(greedy and seeded), failovers (roseserve_request_failovers_total), and the longest
stall each client saw (the longest gap between two of its tokens) over the streams
that failed over, p50 and max, with the same over the reference run for scale. The
exit code is 1 if any stream failed or differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import psutil  # noqa: E402

from benchmarks.stack import Stack, cpu_model, metric, scrape  # noqa: E402

FAULTS = ("kill", "kill-twice", "restart", "pd")


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, of: {', '.join(FAULTS)}")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", dest="json_path", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.faults = args.faults.split(",")
    if not args.faults or set(args.faults) - set(FAULTS):
        p.error(f"--faults: each of {', '.join(FAULTS)}, got {args.faults}")
    if args.streams < 2 or args.max_tokens < 8:
        p.error("--streams must be 2 or more and --max-tokens 8 or more")
    return args, serve_args


@dataclass
class Stream:
    body: dict
    token_ids: list = field(default_factory=list)
    error: object = None
    done: bool = False
    last: float = 0.0        # when its last tokens came
    max_gap: float = 0.0     # the longest wait between two of its chunks with tokens

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and \
            len(self.token_ids) == self.body["max_tokens"]


async def stream(client: httpx.AsyncClient, url: str, s: Stream) -> None:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=s.body,
                                 timeout=600) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    s.done = True
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                s.error = chunk.get("error", s.error)
                for c in chunk.get("choices", []):
                    if c.get("token_ids"):
                        now = time.monotonic()
                        if s.last:
                            s.max_gap = max(s.max_gap, now - s.last)
                        s.last = now
                        s.token_ids += c["token_ids"]
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"


def bodies(n: int, max_tokens: int, model: str) -> list[dict]:
    """Distinct prompts; odd ones greedy, even ones sampled with a seed each."""
    return [{"model": model, "prompt": f"Story {i}: the {i}th traveller came to a town and",
             "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
             "return_token_ids": True,
             **({"temperature": 0.0} if i % 2 else {"temperature": 1.0, "seed": i})}
            for i in range(n)]


def engine_pids(stack: Stack, role: str = "") -> list[int]:
    """The live engine processes (of ``role``, if given), in start order."""
    out = []
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
            if "engine_worker" in cmd and p.status() != psutil.STATUS_ZOMBIE and (
                    not role or role in cmd):
                out.append((p.create_time(), p.pid))
        except psutil.Error:
            continue
    return [pid for _, pid in sorted(out)]


def wait_healthy(stack: Stack, n: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(scrape(stack.url), "roseserve_engines_healthy") < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{n} engines not healthy:\n{stack.tail()}")
        time.sleep(0.3)


async def run(stack: Stack, reqs: list[dict], fault: str = "") -> list[Stream]:
    """The streams, with ``fault`` applied once each has a quarter of its tokens."""
    streams = [Stream(b) for b in reqs]
    quarter = reqs[0]["max_tokens"] // 4

    def check() -> None:
        if all(s.done or s.error for s in streams):
            raise SystemExit(f"the streams ended before the fault:\n{stack.tail()}")

    async def until(predicate) -> None:
        while not predicate():
            check()
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(reqs) + 8)) as c:
        tasks = [asyncio.create_task(stream(c, stack.url, s)) for s in streams]
        if fault:
            await until(lambda: all(len(s.token_ids) >= quarter for s in streams))
            if fault == "restart":
                stack.proc.send_signal(signal.SIGHUP)
            else:
                victims = engine_pids(stack, "decode" if fault == "pd" else "")
                os.kill(victims[0], signal.SIGKILL)
                if fault == "kill-twice":   # once the first is back, the other
                    while set(engine_pids(stack)) <= set(victims) or metric(
                            (await c.get(f"{stack.url}/metrics")).text,
                            "roseserve_engines_healthy") < len(victims):
                        check()
                        await asyncio.sleep(0.1)
                    await until(lambda: all(s.done or s.last > time.monotonic() - 0.5
                                            for s in streams))
                    os.kill(victims[1], signal.SIGKILL)
        await asyncio.gather(*tasks)
    return streams


def _log(stack: Stack) -> str:
    return Path(stack.log.name).read_text(errors="replace")


def figures(stack: Stack, reqs: list[dict], reference: list[Stream], fault: str,
            engines: int) -> dict:
    wait_healthy(stack, engines)
    before = metric(scrape(stack.url), "roseserve_request_failovers_total")
    restarts = _log(stack).count("rolling restart of")
    streams = asyncio.run(run(stack, reqs, fault))
    while fault == "restart" and _log(stack).count("rolling restart of") == restarts:
        time.sleep(0.3)   # (the last engine's restart)
    moved = int(metric(scrape(stack.url), "roseserve_request_failovers_total") - before)
    same = [s.token_ids == r.token_ids for s, r in zip(streams, reference)]
    # the streams that moved are those with the longest stalls (a failover's wait)
    stalls = sorted(s.max_gap for s in streams)[-min(moved, len(streams)):] if moved else []
    usual = sorted(s.max_gap for s in reference)
    return {
        "fault": fault, "streams": len(streams),
        "complete": sum(s.complete for s in streams),
        "error_events": sum(s.error is not None for s in streams),
        "errors": sorted({str(s.error) for s in streams if s.error is not None}),
        "identical_greedy": sum(ok for ok, b in zip(same, reqs) if "seed" not in b),
        "identical_seeded": sum(ok for ok, b in zip(same, reqs) if "seed" in b),
        "failovers": moved,
        "stall_p50_s": round(statistics.median(stalls), 3) if stalls else None,
        "stall_max_s": round(max(stalls), 3) if stalls else None,
        "reference_gap_p50_s": round(statistics.median(usual), 3),
        "reference_gap_max_s": round(usual[-1], 3),
    }


def main(argv=None) -> int:
    args, serve_args = parse_args(argv)
    reqs = bodies(args.streams, args.max_tokens, "bench")
    print(f"CPU: {cpu_model()}; {args.streams} streams x {args.max_tokens} tokens; "
          f"serve {' '.join(serve_args) or '(the default model)'}", flush=True)
    results = []
    mixed = [f for f in args.faults if f != "pd"]
    plans = ([(mixed, ["--engines", "2"], 2)] if mixed else []) + \
        ([(["pd"], ["--prefill-engines", "1", "--decode-engines", "2"], 3)]
         if "pd" in args.faults else [])
    for faults, engines_args, engines in plans:
        stack = Stack([*engines_args, *serve_args], name="bench")
        try:
            stack.wait_ready()
            wait_healthy(stack, engines)
            reference = asyncio.run(run(stack, reqs))
            if not all(s.complete for s in reference):
                raise SystemExit(f"the reference run failed: {[s.error for s in reference]}")
            for fault in faults:
                r = figures(stack, reqs, reference, fault, engines)
                results.append(r)
                stall = (f"stall p50 {r['stall_p50_s']} s, max {r['stall_max_s']} s"
                         if r["failovers"] else "no stall")
                print(f"{fault}: {r['complete']}/{r['streams']} complete, "
                      f"{r['error_events']} error events, identical "
                      f"{r['identical_greedy']} greedy + {r['identical_seeded']} seeded, "
                      f"{r['failovers']} failovers, {stall} (without the fault: gap p50 "
                      f"{r['reference_gap_p50_s']} s, max {r['reference_gap_max_s']} s)",
                      flush=True)
        finally:
            code = stack.stop()
        if code != 0:
            raise SystemExit(f"roseserve serve exited {code}:\n{stack.tail()}")
    report = {"cpu": cpu_model(), "serve_args": serve_args, "streams": args.streams,
              "max_tokens": args.max_tokens, "results": results}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    ok = all(r["complete"] == r["streams"] == r["identical_greedy"] + r["identical_seeded"]
             for r in results)
    print("every stream complete and identical" if ok else "FAILED: streams lost or differed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
