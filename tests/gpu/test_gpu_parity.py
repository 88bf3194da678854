"""On a GPU: the engine in bfloat16 against Hugging Face in float32, CUDA graph replay
against the same step run eagerly, and the engine process serving over ZeroMQ.
scripts/gpu-check runs these and puts their figures in its report
(ROSESERVE_GPU_REPORT_DIR).

Parity runs on real weights when ROSESERVE_PARITY_MODEL names a model directory
(teacher-forced logits within 1e-2 relative L2 of HF float32, top-1 agreement >= 99%).
Otherwise it builds a SmolLM2-shaped model with fixed-seed random weights, on which no
bfloat16 implementation meets that bar: 30 random layers amplify rounding (on a CPU,
HF's own bf16 forward is 1.6e-2 from its float32 one, top-1 95.5%). There the engine
is held to HF bf16's own error on the same weights instead."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.model_files import resolve_model_dir
from common.protocol import SamplingParams
from engine_worker.engine import LLMEngine
from helpers import random_prompts

pytestmark = pytest.mark.cuda
NEAR_TIE = 0.1


def report(name: str, figures: dict) -> None:
    folder = os.environ.get("ROSESERVE_GPU_REPORT_DIR")
    if folder:
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=2))


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    real = os.environ.get("ROSESERVE_PARITY_MODEL")
    if real:
        return Path(real)
    config = AutoConfig.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("smollm2-shaped")
    model.save_pretrained(out, safe_serialization=True)
    return out


def engine_for(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                  cache=CacheConfig(kv_cache_memory_bytes=2 << 30),
                                  scheduler=SchedulerConfig(max_batch_size=32), **kw))


def test_teacher_forced_logits_and_greedy_tokens_match_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda().eval()
    engine = engine_for(smollm2_dir)
    prompts = random_prompts([300, 77, 1000], seed=1, vocab=49152)
    # Teacher forcing: every prompt position's logits (prompt_logprobs keeps them).
    ours, theirs = [], []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tf-{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        rows = []
        while engine.has_unfinished_requests():
            engine.step()
            rows += [logits.float() for _, _, logits in engine.runner.prompt_logits]
        ours.append(torch.cat(rows))
        with torch.no_grad():
            theirs.append(hf(torch.tensor([prompt], device="cuda")).logits[0, :-1].float())
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    rel_l2 = float((ours - theirs).norm() / theirs.norm())
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    # HF's own bfloat16 forward on the same weights: the error bf16 itself costs.
    hf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        base = torch.cat([hf16(torch.tensor([p], device="cuda")).logits[0, :-1].float()
                          for p in prompts])
    hf_bf16_rel_l2 = float((base - theirs).norm() / theirs.norm())
    hf_bf16_top1 = float((base.argmax(-1) == theirs.argmax(-1)).float().mean())
    del hf16

    # Greedy: identical up to the first step where HF's top-2 gap is under NEAR_TIE.
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    got = engine.generate(prompts, params)
    agreed = []
    for prompt, tokens in zip(prompts, got):
        seq = torch.tensor([prompt], device="cuda")
        n = 0
        for token in tokens:
            with torch.no_grad():
                logits = hf(seq).logits[0, -1].float()
            top2 = logits.topk(2).values
            if token != int(logits.argmax()):
                assert float(top2[0] - top2[1]) < NEAR_TIE, (
                    f"diverged at step {n} with a top-2 gap of {float(top2[0] - top2[1]):.3f}")
                break
            n += 1
            seq = torch.cat([seq, torch.tensor([[token]], device="cuda")], dim=1)
        agreed.append(n)
    real = bool(os.environ.get("ROSESERVE_PARITY_MODEL"))
    report("parity", {"rel_l2": rel_l2, "top1_agreement": top1, "real_weights": real,
                      "hf_bf16_rel_l2": hf_bf16_rel_l2, "hf_bf16_top1_agreement": hf_bf16_top1,
                      "greedy_tokens_agreed": agreed, "greedy_tokens": 64})
    if real:
        assert rel_l2 < 1e-2 and top1 >= 0.99
    else:
        assert rel_l2 < max(1e-2, 1.5 * hf_bf16_rel_l2)
        assert top1 >= min(0.99, hf_bf16_top1 - 0.01)


def test_graph_replay_equals_the_same_step_run_eagerly(smollm2_dir):
    engine = engine_for(smollm2_dir)
    runner = engine.runner
    assert runner.graphs is not None
    prompts = random_prompts([40, 9, 130], seed=2, vocab=49152)
    for i, p in enumerate(prompts):
        engine.add_request(f"g-{i}", p, SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True))
    engine.step()  # the prefill, eager
    for _ in range(5):
        engine.step()
    scheduled = engine.scheduler.schedule()
    layout = scheduled.scheduled
    bucket = runner.graphs.bucket(len(layout))
    batch = runner.inputs.prepare(layout, list(range(len(layout))), len(layout), pad_to=bucket,
                                  num_splits=runner.graphs.splits(bucket))
    replayed = runner.graphs.run(batch).clone()
    eager = runner.graphs.step(batch.input_ids, batch.positions, batch.meta)[:len(layout)]
    equal = bool(torch.equal(replayed, eager))
    report("graphs", {"graph_equals_eager": equal, "bucket": bucket, "rows": len(layout)})
    assert equal


def test_engine_process_serves_over_zeromq_on_cuda(tmp_path):
    from engine_worker.client import EngineClient

    address = f"ipc://{tmp_path}/engine.sock"
    proc = subprocess.Popen([sys.executable, "-m", "engine_worker", "--device", "cuda",
                             "--model", "smollm2-135m", "--load-format", "dummy", "--bind",
                             address, "--kv-cache-memory", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    async def main():
        client = EngineClient(address)
        ready = await client.start(timeout_s=300)
        tokens = []
        async for out in client.generate("r1", [1, 9690, 198], SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True)):
            tokens += out.new_token_ids
        await client.close()
        return ready, tokens

    try:
        ready, tokens = asyncio.run(asyncio.wait_for(main(), 400))
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert len(tokens) == 16, log[-3000:]
    report("zmq", {"tokens": tokens, "ready": str(ready)})
