"""Building and choosing the CPU kernels: every way it can go wrong falls back to the
torch path instead of failing, and the fast path is only taken where it applies; the
paged decode attention kernel against its definition."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.protocol import SamplingParams
from engine_worker.attention import TorchAttention
from engine_worker.cpu import build, kernels
from engine_worker.cpu.fused import FusedForward, FusedLlama
from helpers import greedy, make_engine, random_prompts, run_to_end
import hf_reference
from hf_reference import assert_matches, hf_greedy, hf_model

ROOT = Path(__file__).resolve().parents[2]


def test_a_cc_naming_no_program_falls_back_to_cc_on_the_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ROSESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    assert build.build_and_load() is not None
    assert "CC=/nonexistent/bin/cc names no program" in caplog.text


def test_no_compiler_at_all_means_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ROSESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    assert build.build_and_load() is None
    assert "no C compiler found" in caplog.text


def test_a_compiler_that_fails_means_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ROSESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert build.build_and_load() is None
    assert "building the CPU kernels failed" in caplog.text
    # no half-written file left (the build's lock file stays)
    assert [p.suffix for p in (tmp_path / "kernels").glob("*")] == [".lock"]


def test_a_head_dim_the_attention_kernel_cannot_do_takes_the_torch_path(tiny_llama_hd8_dir):
    prompts = random_prompts([3, 9, 20], seed=4)
    engine = make_engine(tiny_llama_hd8_dir, cpu_kernels=True)
    assert type(engine.runner.attn) is TorchAttention  # head_dim 8: not a multiple of 16
    assert isinstance(engine.runner.model.ops, kernels.CpuKernels)  # the other C kernels run
    assert_matches(engine.generate(prompts, greedy(10)), hf_greedy(tiny_llama_hd8_dir, prompts, 10),
                   "head_dim 8")


def test_the_declared_torch_floor_has_what_the_code_uses():
    """scaled_dot_product_attention's enable_gqa (engine_worker/attention.py) arrived
    in torch 2.5: pyproject.toml must not admit an older torch."""
    assert "enable_gqa" in (ROOT / "engine_worker" / "attention.py").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "pyproject.toml").read_text())
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 5)


def paged_cache(num_seqs: int, max_len: int, bs: int, hkv: int, d: int,
                kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random KV cache (2, blocks, bs, hkv, d) holding num_seqs sequences of up to
    max_len tokens, and their block tables: the blocks shuffled among the sequences."""
    max_blocks = (max_len + bs - 1) // bs
    num_blocks = num_seqs * max_blocks
    cache = torch.randn(2, num_blocks, bs, hkv, d).to(kv_dtype)
    return cache, torch.randperm(num_blocks).view(num_seqs, max_blocks)


def softmax_attention(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, length: int,
                      scale: float, window: int = 0, sinks=None) -> torch.Tensor:
    """The reference: one token's query heads (Hq, D) against softmax(q k^T) v over its
    sequence's first ``length`` keys and values (the last ``window`` of them, if given),
    gathered through its block table (a bfloat16 cache's widened exactly); sinks (Hq,):
    each head's sink logit in the softmax, with no value."""
    hq, (hkv, d) = q.shape[0], cache.shape[-2:]
    first = max(0, length - window) if window else 0
    keys, values = (cache[i][table].float().reshape(-1, hkv, d)[first:length]
                    .repeat_interleave(hq // hkv, dim=1) for i in (0, 1))
    scores = torch.einsum("hd,thd->ht", q, keys) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.unsqueeze(1)], dim=1)
    p = torch.softmax(scores, dim=-1)[:, :keys.shape[0]]
    return torch.einsum("ht,thd->hd", p, values)


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"]], ids=["native", "avx2"])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 8),
                                         (14, 2, 128, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 13], ids=["full", "window-13"])
def test_the_paged_decode_attention_kernel_matches_softmax_over_the_context(isa, hq, hkv, d,
                                                                            bs, kv_dtype, window):
    """Every context length around the 4-token groups of keys the kernel scores together,
    the 16-token groups the AVX-512 kernel sums together and the block size, read through
    a shuffled block table, against softmax(q k^T) v over each sequence's gathered keys
    and values (a bfloat16 cache's widened exactly). 7 query heads a KV head are scored
    4 and 3 at a time, and their values summed 2 at a time with 128-float heads."""
    k = build.build_and_load(isa)
    torch.manual_seed(hq * d + bs)
    lens = [1, 2, 3, 4, 5, 7, 15, 16, 17, 31, 33, 48, 50]
    cache, tables = paged_cache(len(lens), max(lens), bs, hkv, d, kv_dtype)
    q = torch.randn(len(lens), hq, d)
    scale = d ** -0.5
    out = k.paged_decode_attention(q, cache, tables, torch.tensor(lens), scale, window)
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b], softmax_attention(q[b], cache, tables[b], n, scale,
                                                             window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"]], ids=["native", "avx2"])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 8),
                                         (16, 1, 32, 16), (32, 1, 64, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [0, 13, 40], ids=["full", "window-13", "window-40"])
def test_prompt_chunks_are_attended_in_tiles_as_softmax_over_each_tokens_context(
        isa, hq, hkv, d, bs, kv_dtype, window):
    """A step mixing decode rows with prompt chunks (a fresh prompt, long enough for
    several tiles; a chunk after a cached prefix; a one-token chunk), each query token
    against softmax(q k^T) v over its own first context_lens keys: the tiles' causal
    masks, partial key groups and padded rows. A tile holds 64 (token, head) rows with
    AVX-512, 16 with AVX2: there 16 query heads per KV head make one-token tiles, and
    32 more than a tile holds (each token attended alone). With a sliding window, each
    token's last keys only: tiles whose rows' windows start inside a group of keys,
    and chunks whose first rows see all they have."""
    k = build.build_and_load(isa)
    torch.manual_seed(hq * d + bs + hkv)
    # (sequence, first token's context length, tokens)
    runs = [(0, 40, 1), (1, 20, 37), (2, 1, 70), (3, 1, 1), (4, 33, 1), (5, 17, 2)]
    seq, lens = [], []
    for s, first, count in runs:
        seq += [s] * count
        lens += list(range(first, first + count))
    cache, tables = paged_cache(len(runs), max(lens), bs, hkv, d, kv_dtype)
    q = torch.randn(len(seq), hq, d)
    scale = d ** -0.5
    out = k.paged_attention(q, cache, torch.tensor(seq), tables, torch.tensor(lens), scale,
                            window)
    for n, (s, length) in enumerate(zip(seq, lens)):
        torch.testing.assert_close(out[n], softmax_attention(q[n], cache, tables[s], length,
                                                             scale, window),
                                   rtol=1e-5, atol=1e-5, msg=f"token {n}")


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"]], ids=["native", "avx2"])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (8, 2, 128, 8)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", [[1030], [700, 3], [2049, 257, 16]])
@pytest.mark.parametrize("window", [0, 901], ids=["full", "window-901"])
def test_few_decode_rows_over_long_contexts_split_their_keys_and_merge(isa, hq, hkv, d, bs,
                                                                       kv_dtype, lens, window):
    """A step of so few decode rows that each row's keys are split into parts across
    threads (some of a short row's parts empty), merged: softmax(q k^T) v over each
    row's whole context, or its window's keys (split from the window's block on)."""
    k = build.build_and_load(isa)
    torch.manual_seed(len(lens) * d + bs)
    cache, tables = paged_cache(len(lens), max(lens), bs, hkv, d, kv_dtype)
    q = torch.randn(len(lens), hq, d) * 3  # peaked: the parts' maxima differ
    scale = d ** -0.5
    out = k.paged_decode_attention(q, cache, tables, torch.tensor(lens), scale, window)
    for b, n in enumerate(lens):
        torch.testing.assert_close(out[b], softmax_attention(q[b], cache, tables[b], n, scale,
                                                             window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"]], ids=["native", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sink_logits_join_every_attention_path(isa, kv_dtype):
    """gpt-oss's sinks, each head's logit in its softmax: decode rows attended whole,
    prompt chunks in tiles (a sliding window too), and few rows over long contexts,
    their keys split into parts (the sinks join where the parts merge); one head's
    sink far above its scores (its output near 0)."""
    k = build.build_and_load(isa)
    torch.manual_seed(5)
    hq, hkv, d, bs = 8, 2, 64, 16
    sinks = torch.tensor([0.5, 30.0, -30.0, -1.0, 2.0, 0.0, 1.0, -2.0])
    runs = {"rows": [(0, 40, 1), (1, 5, 1), (2, 17, 1), (3, 33, 1), (4, 2, 1)],
            "chunks": [(0, 20, 37), (1, 1, 30), (2, 9, 1)],
            "parts": [(0, 1030, 1), (1, 700, 1)]}
    for path, window in (("rows", 0), ("chunks", 0), ("chunks", 13), ("parts", 0),
                         ("parts", 301)):
        seq, lens = [], []
        for s_, first, count in runs[path]:
            seq += [s_] * count
            lens += list(range(first, first + count))
        cache, tables = paged_cache(len(runs[path]), max(lens), bs, hkv, d, kv_dtype)
        q = torch.randn(len(seq), hq, d) * 2
        out = k.paged_attention(q, cache, torch.tensor(seq), tables, torch.tensor(lens),
                                d ** -0.5, window, sinks=sinks)
        for n, (s_, length) in enumerate(zip(seq, lens)):
            want = softmax_attention(q[n], cache, tables[s_], length, d ** -0.5, window, sinks)
            torch.testing.assert_close(out[n], want, rtol=1e-5, atol=1e-5,
                                       msg=f"{path}, window {window}, token {n}")
            assert float(out[n, 1].abs().max()) < 1e-6
        plain = softmax_attention(q[0], cache, tables[seq[0]], lens[0], d ** -0.5, window)
        assert (out[0] - plain).abs().max() > 0.05   # the sinks matter


def hf_greedy_bf16_kv(model_dir, prompts, max_new_tokens, monkeypatch):
    """HF's greedy outputs with every key (after RoPE) and value rounded to bfloat16
    before attention reads it, as a bfloat16 KV cache holds them."""
    from transformers.models.llama import modeling_llama

    rotary = modeling_llama.apply_rotary_pos_emb

    def rounded_keys(q, k, *args, **kw):
        q, k = rotary(q, k, *args, **kw)
        return q, k.to(torch.bfloat16).float()

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rounded_keys)
    model = hf_model(model_dir)
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda _m, _args, out: out.to(torch.bfloat16).float()) for layer in model.model.layers]
    try:
        return hf_reference._greedy(model, prompts, max_new_tokens)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["c-kernels", "torch"])
def test_a_bfloat16_kv_cache_holds_twice_the_tokens_and_matches_hf_reading_rounded_keys(
        tiny_llama_dir, monkeypatch, cpu_kernels):
    """--kv-cache-dtype bfloat16: keys and values rounded to bfloat16 as they are
    written, read back by every query (a prompt's own chunk too), on the fused C forward
    and on the torch reference path alike; the same memory holds twice the blocks."""
    prompts = random_prompts([3, 9, 20, 37], seed=11)
    engine = make_engine(tiny_llama_dir, cpu_kernels=cpu_kernels, budget=16,
                         kv_cache_dtype="bfloat16")
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert isinstance(engine.runner.step, FusedForward) == cpu_kernels
    got = engine.generate(prompts, greedy(12))
    assert_matches(got, hf_greedy_bf16_kv(tiny_llama_dir, prompts, 12, monkeypatch),
                   "bfloat16 KV")
    f32 = make_engine(tiny_llama_dir, cpu_kernels=cpu_kernels)
    assert f32.runner.kv.layer_block_bytes() == 2 * engine.runner.kv.layer_block_bytes()


@pytest.mark.parametrize("weights, kv", [
    ({}, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16),
    ({"quantization": "int8"}, torch.bfloat16), ({"quantization": "q4"}, torch.bfloat16),
    ({"quantization": "int8", "kv_cache_dtype": "float32"}, torch.float32),
    ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16),
    ({"dtype": "bfloat16", "cpu_kernels": False}, torch.bfloat16),
    ({"cpu_kernels": False}, torch.float32)], ids=str)
def test_an_auto_kv_cache_follows_the_weights_precision(tiny_llama_dir, weights, kv):
    """auto: float32 weights keep a float32 cache (Hugging Face's output token for
    token); bfloat16, int8 and 4-bit weights a bfloat16 one; a dtype asked for is kept."""
    engine = make_engine(tiny_llama_dir, **weights)
    assert engine.runner.kv_dtype == kv
    assert all(c.dtype == kv for c in engine.runner.kv_caches)


def test_the_kv_cache_dtype_is_checked():
    from common.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, "
                                         "bfloat16, fp8, got 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16")


def test_processes_starting_together_build_the_kernels_once(tmp_path):
    """Engines started together on a fresh machine: one builds, the others wait for it
    (each compiling too would make them all slower on the same cores)."""
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from engine_worker.cpu.build import cpu_kernels; assert cpu_kernels() is not None")
    env = {**os.environ, "ROSESERVE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(out.count("building the CPU kernels") for out in outs) == 1, outs


def test_the_kernels_leave_the_process_its_ieee_arithmetic(tiny_llama_dir):
    """The kernels flush subnormals to zero in their own threads only: once a process
    has loaded them and run engine steps (the fused forward, attention, argmax), its own
    arithmetic, torch's and numpy's, in its threads and torch's, keeps subnormals. GCC's
    -ffast-math start-up code, linked in, set flush-to-zero for the whole process."""
    code = f"""
import sys, threading
sys.path.insert(0, {str(ROOT / "tests")!r})
import numpy as np, torch
from engine_worker.cpu.fused import FusedForward
from helpers import greedy, make_engine, random_prompts
engine = make_engine({str(tiny_llama_dir)!r})
assert isinstance(engine.runner.step, FusedForward)
print(engine.generate(random_prompts([5, 9], seed=1), greedy(4)))
tiny = 1e-39   # a float32 subnormal
checks = {{"torch": (torch.tensor([tiny]) * 1.0).item(),
          "numpy": float(np.float32(tiny) * np.float32(1.0)),
          "torch's threads": (torch.full((1 << 20,), tiny) * 1.0).min().item()}}
thread = threading.Thread(target=lambda: checks.update(
    {{"a new thread": (torch.tensor([tiny]) * 1.0).item()}}))
thread.start(); thread.join()
print(checks)
assert all(v > 0 for v in checks.values()), checks
# and the kernels, in their own threads, still take subnormals as zeros
from engine_worker.cpu.build import cpu_kernels
from engine_worker.cpu.fused import FusedForward
k = cpu_kernels()
y = k.linear(torch.full((2, 32), tiny), k.pack(torch.ones(16, 32)), 16, None)
assert not y.any(), y
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                            capture_output=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_a_build_linked_otherwise_is_cached_apart(monkeypatch):
    """The cache's key covers how the library is linked, not only how its sources are
    compiled: a link that changed alone does not load the old build."""
    before = build.cached_path()
    assert "-ffast-math" in build.build_flags([])
    assert "-ffast-math" not in build.link_flags(build.build_flags([]))
    monkeypatch.setattr(build, "link_flags", lambda flags: list(flags))
    assert build.cached_path() != before


def _tokens_and_logprobs(engine, prompts):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outs = run_to_end(engine)
    return ([[t for o in outs[f"r{i}"] for t in o.new_token_ids] for i in range(len(prompts))],
            [lp.logprob for i in range(len(prompts)) for o in outs[f"r{i}"]
             for lp in o.logprobs or []])


@pytest.mark.parametrize("model", ["tiny_mixtral_dir", "tiny_qwen3_moe_dir",
                                   "tiny_qwen2_moe_dir", "tiny_gpt_oss_dir"])
def test_mixtures_of_experts_run_in_the_fused_forward_as_layer_by_layer(
        request, model, monkeypatch):
    """A mixture's layers run inside the one-call C forward: the router, each token's
    top k (Mixtral's and Qwen3's renormalized, Qwen2-MoE's not, gpt-oss's softmax over
    the chosen logits), each chosen expert once on its rows, Qwen2-MoE's gated shared
    expert, gpt-oss's biases, clamped SwiGLU and attention sinks. The same tokens and
    logprobs as the layers run one operation at a time on the same kernels (prompts
    of 1 to 33 tokens in one step: experts with one row and with many)."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts([1, 5, 17, 33], seed=3, vocab=1000)
    engine = make_engine(model_dir)
    assert isinstance(engine.runner.step, FusedForward)
    fused = _tokens_and_logprobs(engine, prompts)
    monkeypatch.setattr(FusedLlama, "supports", staticmethod(lambda model: False))
    layered = make_engine(model_dir)
    assert not isinstance(layered.runner.step, FusedForward)
    want = _tokens_and_logprobs(layered, prompts)
    assert fused[0] == want[0]
    assert len(fused[1]) == 4 * 6
    assert torch.allclose(torch.tensor(fused[1]), torch.tensor(want[1]), rtol=0, atol=1e-5)


def test_a_family_whose_layers_the_c_forward_does_not_compute_runs_them_on_the_kernels(
        tiny_olmo2_dir):
    """OLMo 2's layers (norms after each part, q and k normed whole) are not the shared
    decoder's, which the one C call computes: its steps run layer by layer, on the same
    packed weights, C attention and fused ops (its parity with Hugging Face:
    test_engine_hf_parity.py)."""
    from engine_worker.cpu.attention import CpuAttention
    from engine_worker.cpu.formats import PackedMethod
    from engine_worker.models.layers.linear import Linear

    engine = make_engine(tiny_olmo2_dir, quantization="int8")
    assert not FusedLlama.supports(engine.runner.model)
    assert not isinstance(engine.runner.step, FusedForward)
    assert isinstance(engine.runner.attn, CpuAttention)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1 and all(
        isinstance(m.method, PackedMethod) and m.fmt == "int8" for m in linears)
    assert len(engine.generate(random_prompts([9], seed=2), greedy(3))[0]) == 3
