"""An engine split over two tensor-parallel ranks (engine_worker/tensor_parallel.py),
through its real processes: rank 0 starts rank 1, both join a gloo group, and clients
see one engine, token-identical to one that is not split; a rank that dies takes the
engine down whole, and the supervisor starts it again."""

from __future__ import annotations

import asyncio
import time

import httpx
import psutil

from common.protocol import SamplingParams
from engine_worker_helpers import collect, connect, run, token_ids
from helpers import greedy, random_prompts
from hf_reference import hf_greedy
from processes import Serve

PROMPTS = random_prompts([5, 23, 9, 40], seed=31)


def served(address: str, prompts, params: SamplingParams) -> list[list[int]]:
    async def main():
        client = await connect(address)
        outs = await asyncio.gather(*(collect(client, f"r{i}", p, params)
                                      for i, p in enumerate(prompts)))
        await client.close()
        return [token_ids(o) for o in outs]
    return run(main())


def ranks_of(proc) -> list[psutil.Process]:
    return psutil.Process(proc.proc.pid).children(recursive=True)


def test_two_ranks_serve_what_one_engine_does(engine_factory, tiny_llama_dir):
    """Greedy and seeded sampling over the engine's socket, against an engine that is
    not split; the second rank is a process of rank 0's, pinned to a core of its own."""
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    one = engine_factory(name="one")
    expected = [served(one.address, PROMPTS, p) for p in (greedy(8), sampled)]
    split = engine_factory("--tensor-parallel-size", "2", name="split")
    assert [served(split.address, PROMPTS, p) for p in (greedy(8), sampled)] == expected
    (rank1,) = ranks_of(split)
    rank0 = psutil.Process(split.proc.pid)
    cores = psutil.Process().cpu_affinity()
    if len(cores) >= 2:   # each rank on its own half of the cores
        assert not set(rank0.cpu_affinity()) & set(rank1.cpu_affinity())
        assert len(rank0.cpu_affinity()) + len(rank1.cpu_affinity()) == len(cores)
    assert "tensor-parallel rank 1 of 2: following rank 0's steps" in split.output()


def test_a_dead_rank_takes_the_engine_down_and_it_is_restarted_whole(tmp_path,
                                                                    tiny_llama_dir):
    """Through HTTP: roseserve serve --tensor-parallel-size 2 is token-identical to
    Hugging Face; SIGKILL of rank 1 ends rank 0 with a clear line, the supervisor
    starts both again, and the engine serves the same tokens."""
    prompt = PROMPTS[1]
    expected = hf_greedy(tiny_llama_dir, [prompt], 8)[0].token_ids
    serve = Serve(tiny_llama_dir, tmp_path / "serve.log", "--tensor-parallel-size", "2")
    try:
        serve.wait_ready()

        def complete() -> list[int]:
            r = httpx.post(f"{serve.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert complete() == expected
        # the engine's processes: rank 0, a child of the supervisor's, and rank 1, its
        (rank0,) = [psutil.Process(pid) for pid in serve.pids()["engine"]
                    if psutil.Process(pid).parent().pid == serve.proc.pid]
        (rank1,) = rank0.children()
        rank1.kill()
        rank0.wait(30)
        deadline = time.monotonic() + 120
        while "tensor-parallel rank 1 exited with code -9" not in serve.log():
            assert time.monotonic() < deadline, serve.log()
            time.sleep(0.2)
        while True:   # restarted whole: a new rank 0 with a rank 1 of its own
            engines = [psutil.Process(pid) for pid in serve.pids()["engine"]]
            if len(engines) == 2 and rank0.pid not in [e.pid for e in engines]:
                break
            assert time.monotonic() < deadline, serve.log()
            time.sleep(0.2)
        while True:
            try:
                assert complete() == expected
                break
            except (AssertionError, httpx.HTTPError):
                assert time.monotonic() < deadline, serve.log()
                time.sleep(0.5)
    finally:
        serve.stop()


def test_what_a_split_engine_does_not_do_yet_is_refused(tiny_llama_dir):
    import subprocess
    import sys

    for flags, message in ((["--role", "decode"], "a prefill or decode engine moves its KV"),
                           (["--kv-offload-memory", "1"], "the KV offload tiers and the KV "
                                                           "store hold whole blocks")):
        proc = subprocess.run([sys.executable, "-m", "engine_worker", "--model",
                               str(tiny_llama_dir), "--device", "cpu", "--bind",
                               "ipc:///tmp/rs-tp-refused.sock", "--tensor-parallel-size", "2",
                               *flags], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
