"""Each process freezes its start-up heap (common/heap.py): a full garbage collection
then walks only what serving made, not the model, torch and the tokenizer."""

from __future__ import annotations

import gc
import re

import processes
from common.heap import freeze_startup_heap
from common.protocol import SamplingParams
from helpers import make_engine


def test_freezing_leaves_the_start_up_heap_out_of_collections(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    walked = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen > 0.9 * walked
        assert len(gc.get_objects()) < 0.01 * walked
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0,
                                                          ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
        assert len(tokens) == 4   # and it serves on
    finally:
        gc.unfreeze()


def test_every_process_freezes_its_start_up_heap(tmp_path, tiny_llama_dir):
    engine = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/engine.sock")
    pool = processes.tokenizer_pool(tiny_llama_dir, f"ipc://{tmp_path}/tok.sock", 1, None,
                                    "--log-level", "debug")
    front = processes.frontend(tiny_llama_dir, engine.address, pool.address,
                               "--log-level", "debug")
    try:
        processes.wait_healthy(front)
        for proc in (engine, pool, front):
            counts = re.findall(r"start-up heap frozen: (\d+) objects", proc.output())
            assert counts and all(int(n) > 10_000 for n in counts), proc.output()[-2000:]
    finally:
        for p in (front, pool, engine):
            p.stop()
