"""benchmarks/engine.py, in the forms docs/performance.md runs it, on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def engine_benchmark(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """benchmarks/engine.py with these arguments; check: it must exit 0."""
    proc = subprocess.run([sys.executable, "benchmarks/engine.py", *args],
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("extra", [
    ["--hf-batch-sizes", "4,same"],                            # against Hugging Face
    ["--shared-prefix", "8", "--input-len", "10", "--block-size", "4", "--skip-hf"],  # prefix cache
    ["--zmq", "--skip-hf", "--kv-cache-dtype", "bfloat16"],    # through the engine process
    ["--roofline", "--roofline-batches", "1,3", "--skip-hf"],  # decode steps vs their floor
    ["--quantization", "int8", "--skip-hf", "--roofline", "--roofline-batches", "1,3"],
    ["--quantization", "q4", "--skip-hf", "--roofline", "--roofline-batches", "1,3",
     "--kv-cache-dtype", "bfloat16"],
    ["--dtype", "bfloat16", "--skip-hf", "--roofline", "--roofline-batches", "1,3",
     "--against-float32"],
    ["--dtype", "bfloat16", "--kernel-isa", "avx2", "--skip-hf"],
    ["--long-context", "24,70", "--skip-hf"],                 # one long prompt alone
])
def test_engine_benchmark_smoke(tiny_llama_dir, tmp_path, extra):
    out = tmp_path / "engine.json"
    args = ["--model", str(tiny_llama_dir), "--num-requests", "4", "--input-len", "8",
            "--output-len", "4", "--repeats", "1", "--json", str(out)]
    engine_benchmark(*args, *extra)
    report = json.loads(out.read_text())
    assert report["engine"]["output_tokens"] == 16
    if "--zmq" in extra:
        assert report["zmq"]["frame"]["frame_bytes"] > 0 and report["zmq"]["ratio"] > 0
    if "--shared-prefix" in extra:
        assert report["engine"]["prefix_cache_hit_tokens"] > 0
    if "--roofline" in extra:
        rl = report["roofline"]
        assert rl["read_bandwidth_gbs"] > 0 and rl["gemm_gflops"] > 0
        # the compute floor is the best rate measured, and says where it came from
        assert rl["gemm_gflops"] == max(rl["gemm_rates_gflops"].values())
        assert rl["gemm_rates_gflops"][rl["gemm_from"]] == rl["gemm_gflops"]
        assert any(name.startswith("torch") for name in rl["gemm_rates_gflops"])
        assert [b["batch"] for b in rl["batches"]] == [1, 3]
        for b in rl["batches"]:
            assert b["steps"] > 0 and 0 < b["floor_s"] and 0 < b["fraction_of_floor"]
            assert b["linear"] > 0 and b["attention"] > 0
            # the memory floor reads the step's bytes at the faster of the two rates
            fastest = 1e9 * max(b["read_bandwidth_gbs"], b["step_bytes_read_gbs"])
            assert b["floor_memory_s"] == pytest.approx(b["step_bytes"] / fastest)
    if "--quantization" in extra:
        fmt = extra[extra.index("--quantization") + 1]
        assert report["weights"] == report["roofline"]["weights"] == fmt
        assert "torch._int_mm int8, 1024^3" in report["roofline"]["gemm_rates_gflops"]
    if "--dtype" in extra and "--roofline" in extra:
        assert report["weights"] == report["roofline"]["weights"] == "bfloat16"
        assert "torch.matmul bfloat16, 1024^3" in report["roofline"]["gemm_rates_gflops"]
        a = report["against_float32"]
        assert len(a["ratio_runs"]) == 1 and a["ratio"] > 0
    if "--roofline" in extra:
        cfg = json.loads((tiny_llama_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        # bytes of a bfloat16 or float32 cache: auto keeps bfloat16 for other weights
        elem = 2 if {"--kv-cache-dtype", "--quantization", "--dtype"} & set(extra) else 4
        assert report["roofline"]["kv_bytes_per_token"] == (
            2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem)
    if "--kernel-isa" in extra:
        assert report["weights"] == "bfloat16" and report["kernel_isa"] == "avx2"
    if "--long-context" in extra:
        rows = report["long_context"]
        assert [r["prompt_tokens"] for r in rows] == [24, 70]
        for r in rows:  # the prefill's token, then --output-len decode steps
            assert r["decode_steps"] == 4 and r["prefill_steps"] >= 1
            assert r["prefill_s"] > r["prefill_attention_s"] > 0 and r["decode_step_s"] > 0
    if "--hf-batch-sizes" in extra:
        assert report["hf"] and report["hf"][0]["output_tokens"] == 16


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gpu_benchmark_smoke_on_the_cpu(tiny_llama_dir, tmp_path, kv):
    """benchmarks/engine.py --device cuda hands over to engine_gpu.py; the same code
    runs here on the CPU (the torch path) with the tiny model, and so does scripts/
    gpu-check's run with an fp8 KV cache."""
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--model-config", str(tiny_llama_dir), "--load-format", "auto",
            "--attention-backend", "torch", "--dtype", "float32", "--concurrency", "1,3",
            "--input-len", "8", "--output-len", "4", "--hf-batches", "1,3", "--json", str(out),
            "--kv-cache-dtype", kv, "--hf-static-compile", "--hf-compile-backend", "eager"]
    proc = subprocess.run([sys.executable, "benchmarks/engine_gpu.py", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["tokens_per_s"]) == set(report["floor_fraction"]) == {"1", "3"}
    assert set(report["hf_tokens_per_s"]) == set(report["hf_static_compile_tokens_per_s"]) \
        == {"1", "3"}
    assert report["runs"]["3"]["output_tokens"] == 12
    assert all(0 < f for f in report["floor_fraction"].values())
    assert report["spec_fraction"] == {}   # (no spec sheet for a CPU)
    assert report["ttft_ms_one_stream"] > 0 and report["bandwidth_bytes_per_s"] > 0
    staggered, top_p = report["workloads"]["staggered"], report["workloads"]["top_p"]
    assert staggered["concurrency"] == 3 and staggered["requests"] == 12
    assert staggered["output_tokens"] > 12 and top_p["output_tokens"] == 12
    assert staggered["vs_greedy"] > 0 and top_p["vs_greedy"] > 0
    assert report["kernels_compiled_while_serving"] == 0  # the torch path compiles none
    assert report["kv_cache_dtype"] == ("torch.float8_e4m3fn" if kv == "fp8" else "torch.float32")


def test_gpu_benchmark_smoke_with_a_mixture_of_experts(tiny_qwen3_moe_dir, tmp_path):
    """A mixture's roofline counts the experts a step's tokens are expected to read;
    its experts grouped as on a GPU (Triton's interpreter here); no HF run."""
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--model-config", str(tiny_qwen3_moe_dir), "--load-format",
            "auto", "--attention-backend", "triton", "--dtype", "float32",
            "--concurrency", "3", "--input-len", "8", "--output-len", "4",
            "--hf-batches", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, "benchmarks/engine_gpu.py", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HF generate: not run for a mixture of experts" in proc.stdout
    report = json.loads(out.read_text())
    assert report["runs"]["3"]["output_tokens"] == 12 and report["hf_tokens_per_s"] == {}


def test_a_mixtures_roofline_reads_the_experts_its_tokens_choose(tiny_qwen3_moe_dir):
    from benchmarks.engine_gpu import weight_reads
    from common.config import CacheConfig, EngineConfig
    from engine_worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_moe_dir), device="cpu",
                                    attention_backend="torch",
                                    cache=CacheConfig(num_blocks=16)))
    model, cfg = engine.runner.model, engine.model_config
    reads = weight_reads(model, cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # 2 MoE layers of 8 experts, each 3 x 64 x 32 float32 weights; the embedding table
    # whole (the lm_head is tied to it)
    experts = 2 * 8 * 3 * 64 * 32 * 4
    assert cfg.tie_word_embeddings
    assert reads(1) == pytest.approx(total - experts + experts * 2 / 8)
    assert reads(10_000) == pytest.approx(total)


def test_an_untied_embedding_table_is_read_a_row_a_token(tiny_llama_dir):
    """A step reads its tokens' rows of the table (50257 x 64 float32), not the whole:
    1.05 GB of the Llama-3-8B shape's 16 GB were once counted every decode step."""
    from benchmarks.engine_gpu import weight_reads
    from common.config import CacheConfig, EngineConfig
    from engine_worker.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu",
                                    attention_backend="torch",
                                    cache=CacheConfig(num_blocks=16)))
    model, cfg = engine.runner.model, engine.model_config
    assert not cfg.tie_word_embeddings
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table, row = 50257 * 64 * 4, 64 * 4
    reads = weight_reads(model, cfg)
    assert reads(1) == total - table + row and reads(64) == total - table + 64 * row


def test_the_zmq_comparison_runs_the_engine_process_in_the_same_format(monkeypatch):
    """--zmq compares the in-process engine with an engine process: the same weight
    format on both sides (it once left --quantization out: int8 against float32)."""
    import subprocess as sp

    from benchmarks import engine as bench

    launched = []
    monkeypatch.setattr(sp, "Popen", lambda cmd, **kw: launched.append(cmd))
    args = bench.parse_args(["--zmq", "--quantization", "int8", "--dtype", "bfloat16"])
    bench.start_engine_process(args, 4, "ipc:///tmp/x.sock")
    cmd = " ".join(launched[0])
    assert "--quantization int8" in cmd and "--dtype bfloat16" in cmd
    with pytest.raises(SystemExit, match="--kernel-isa avx2 applies to the in-process"):
        bench.main(["--zmq", "--kernel-isa", "avx2"])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_attention_benchmark_smoke_through_the_interpreter(tmp_path, kv_cache_dtype):
    """benchmarks/gpu_attention.py, whose tilings docs/performance.md compares on a GPU,
    runs here through Triton's interpreter at SmolLM2's shape (GQA 3:1), with each
    cache: every tiling's output agrees with the engine's, or it exits 1."""
    import os

    out = tmp_path / "attention.json"
    args = ["--device", "cpu", "--model-config", "smollm2-135m", "--batches", "1,3",
            "--context", "40", "--chunk-seqs", "2", "--chunk-len", "24", "--iters", "1",
            "--repeats", "1", "--decode-tilings", "32x4x2,16x4x2",
            "--chunk-tilings", "64x32x4x2,128x16x8x3", "--kv-cache-dtype", kv_cache_dtype,
            "--json", str(out)]
    proc = subprocess.run([sys.executable, "benchmarks/gpu_attention.py", *args],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == {"auto": "float32", "fp8": "float8_e4m3fn"}[kv_cache_dtype]
    assert set(report["decode"]) == {"1", "3"}
    # The engine's tiling first, and last with twice its splits (1 here: one "SM").
    assert list(report["decode"]["3"]) == ["64x4x3", "32x4x2", "16x4x2", "64x4x3, 2 splits"]
    assert list(report["chunk"]) == ["64x64x4x3", "64x32x4x2", "128x16x8x3"]
    errors = [row["rel_l2_vs_engine"] for rows in (*report["decode"].values(), report["chunk"])
              for row in rows.values()]
    # (an fp8 cache's dots run in float16, rounding the probabilities per tile)
    assert max(errors) < (1e-3 if kv_cache_dtype == "fp8" else 1e-5)
    assert all(row["us"] > 0 for row in report["chunk"].values())


def test_schedule_floor_as_the_docs_quote_it():
    """benchmarks/schedule_floor.py with the H100's figures (docs/performance.md): pure
    arithmetic, so its figures are exact."""
    args = ["--model-config", "llama-3-8b", "--concurrency", "256", "--budgets", "512,8192",
            "--bandwidth", "2.95e12", "--gemm-rate", "798e12"]
    proc = subprocess.run([sys.executable, "benchmarks/schedule_floor.py", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # (before the embedding table and the prompts' lm_head rows were counted right:
    # 5.50 s, 5.70 s and 5.71 s)
    assert "budget   512: step by step  5.25 s (597 steps,   12486 tokens/s)" in lines[1]
    assert "budget  8192: step by step  5.44 s (272 steps,   12052 tokens/s)" in lines[2]
    assert "the benchmark's floor  5.45 s" in lines[2]


def test_kv_accuracy_benchmark_smoke(tmp_path):
    """benchmarks/kv_accuracy.py, which docs/performance.md quotes, on the default model
    and one short window: an fp8 cache moves the logits further than a bfloat16 one."""
    out = tmp_path / "kv.json"
    proc = subprocess.run([sys.executable, "benchmarks/kv_accuracy.py", "--windows", "1",
                           "--window", "48", "--chunk", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["positions"] == 47
    bf16, fp8 = report["dtypes"]["bfloat16"], report["dtypes"]["fp8"]
    assert 0 < bf16["rel_l2"] < fp8["rel_l2"] < 0.1
    assert 0 < bf16["mean_kl"] < fp8["mean_kl"]


def test_gpu_profile_smoke_on_the_cpu(tiny_llama_dir):
    """benchmarks/gpu_profile.py, which docs/performance.md quotes from a GPU, runs
    here on the CPU with the tiny model (its graph and kernel sections need CUDA)."""
    args = ["--device", "cpu", "--model-config", str(tiny_llama_dir), "--load-format", "auto",
            "--batches", "1,3", "--input-len", "8", "--decode-steps", "3"]
    proc = subprocess.run([sys.executable, "benchmarks/gpu_profile.py", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "=== batch 1: prefill" in out and "=== batch 3: prefill" in out
    assert out.count("decode step:") == 2 and "time to first token (8-token prompt)" in out
    assert out.count("ncalls  tottime") == 2  # cProfile's table of the host functions
    assert out.count("the collector: ") == 2


def test_gpu_profile_hands_its_kv_cache_dtype_to_the_engine(tiny_llama_dir):
    """--kv-cache-dtype fp8, as docs/performance.md runs it on a GPU, reaches the engine:
    on the CPU its kernels refuse that cache, with the engine's own message."""
    args = ["--device", "cpu", "--model-config", str(tiny_llama_dir), "--load-format", "auto",
            "--batches", "1", "--input-len", "8", "--decode-steps", "1",
            "--kv-cache-dtype", "fp8"]
    proc = subprocess.run([sys.executable, "benchmarks/gpu_profile.py", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "--kv-cache-dtype fp8 is for CUDA: the CPU kernels read a float32" in proc.stderr


def test_engine_benchmark_smoke_on_a_gguf_file(tmp_path):
    """--model FILE.gguf, as docs/performance.md's roofline of the default model's own
    file runs it (the shipped file: no tiny GGUF exists)."""
    from common.model_files import _find_gguf

    out = tmp_path / "gguf.json"
    args = ["--model", str(_find_gguf()), "--num-requests", "2", "--input-len", "8",
            "--output-len", "4", "--repeats", "1", "--skip-hf", "--roofline",
            "--roofline-batches", "1,2", "--json", str(out)]
    engine_benchmark(*args)
    report = json.loads(out.read_text())
    assert report["engine"]["output_tokens"] == 8
    assert report["weights"] == report["roofline"]["weights"] == "q4"
    assert [b["batch"] for b in report["roofline"]["batches"]] == [1, 2]


def test_the_last_level_cache_is_read_from_linux(tmp_path):
    """The largest cache Linux reports (a Xeon's 260 MiB L3), which sizes the memory
    rate's buffer (4 times it, where that is more than 256 MiB)."""
    from benchmarks.engine_steps import last_level_cache_bytes

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "260M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 260 * 2**20
    assert last_level_cache_bytes(tmp_path / "none") == 0


def test_the_roofline_waits_out_prompts_that_take_many_steps(tiny_llama_dir, tmp_path):
    """16 prompts of 40 tokens under a budget of 16 tokens a step, which the decoding
    rows share, take more than 32 steps to fill: the batch is timed over 32 steps that
    decode all 16 however long its prompts took (with 32 output tokens a request the
    first finished before the last prompt was in, and no step decoded all 16), and its
    memory floor reads the contexts those steps had."""
    out = tmp_path / "engine.json"
    args = ["--model", str(tiny_llama_dir), "--num-requests", "1", "--input-len", "40",
            "--output-len", "2", "--repeats", "1", "--skip-hf", "--roofline",
            "--roofline-batches", "16", "--max-num-batched-tokens", "16", "--json", str(out)]
    engine_benchmark(*args)
    rl = json.loads(out.read_text())["roofline"]
    (b,) = rl["batches"]
    assert b["steps"] == 32
    assert 40 + 32 < b["context"] < 40 + 32 + 200
    assert b["step_bytes"] == int(rl["weight_bytes"] + 16 * b["context"]
                                  * rl["kv_bytes_per_token"])


def test_a_roofline_batch_above_the_token_budget_is_refused_at_once(tiny_llama_dir):
    """No step can decode more requests than it computes tokens: the batch is refused,
    naming the budget, before any request runs (it would run to its token limit and
    fail after)."""
    proc = engine_benchmark("--model", str(tiny_llama_dir), "--num-requests", "1",
                            "--input-len", "8", "--output-len", "2", "--repeats", "1",
                            "--skip-hf", "--roofline", "--roofline-batches", "16",
                            "--max-num-batched-tokens", "8", check=False)
    assert proc.returncode == 1
    assert ("--roofline-batches 16: a step computes at most 8 tokens "
            "(--max-num-batched-tokens), so no step can decode 16 requests") in proc.stderr


def test_gpu_report_gathers_what_the_steps_wrote(tmp_path):
    """benchmarks/gpu_report.py (scripts/gpu-check's report): the issue's keys from the
    steps' JSON, null where a step did not run (a run cut short), TensorRT-LLM's table
    beside ours, and the tests' outcome from pytest's junit XML."""
    from benchmarks.gpu_report import TRTLLM_H200, gather

    def write(name, report):
        (tmp_path / f"{name}.json").write_text(json.dumps(report))

    write("llama-3-8b", {"device": "NVIDIA H200", "tokens_per_s": {"1": 200.0, "64": 9000.0},
                         "floor_fraction": {"1": 0.9}, "workloads": {"top_p": {"vs_greedy": 0.95}}})
    write("llama-3-8b-fp8", {"tokens_per_s": {"1": 340.0, "64": 12600.0}})
    write("llama-3-70b-fp8", {"tokens_per_s": {"1": 40.0}, "max_streams_4k": 90})
    write("trtllm-8b-1000-1000", {"tokens_per_s": {"512": 17744.0}})
    write("parity_fp8", {"rel_l2": 0.05, "top1_agreement": 0.9})
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="120" failures="0" errors="0" skipped="3"/></testsuites>')
    report = gather(tmp_path, passed=False, tests_passed=True)
    assert report["passed"] is False   # (a benchmark step failed; the tests did not)
    assert report["device"] == "NVIDIA H200" and report["tokens_per_s"]["64"] == 9000.0
    assert report["fp8"]["speedup"] == {"1": 1.7, "64": 1.4}
    assert (report["fp8"]["rel_l2"], report["fp8"]["top1_agreement"]) == (0.05, 0.9)
    assert report["llama_3_70b_fp8"] == {"tokens_per_s": {"1": 40.0}, "floor_fraction": None,
                                         "max_streams_4k": 90}
    assert report["workloads"]["top_p"]["vs_greedy"] == 0.95
    assert report["trtllm_table"]["ours"] == {"8b_fp8_1000_1000": 17744.0,
                                              "8b_fp8_500_2000": None,
                                              "70b_fp8_1000_1000": None}
    assert report["trtllm_table"]["ratio"] == {"8b_fp8_1000_1000": 1.0}
    assert report["trtllm_table"]["theirs"] == TRTLLM_H200
    assert report["hf"] == {"generate": None, "static_compile": None}
    assert report["tests"] == {"tests": 120, "failures": 0, "errors": 0, "skipped": 3,
                               "passed": True}
    assert set(report["runs"]) == {"llama-3-8b", "llama-3-8b-fp8", "llama-3-70b-fp8",
                                   "trtllm-8b-1000-1000", "parity_fp8"}
    assert gather(tmp_path, passed=True, tests_passed=False)["tests"]["passed"] is False


def test_tensor_parallel_benchmark_smoke(tiny_llama_dir, tmp_path):
    """benchmarks/engine.py --tensor-parallel-size 2 (engine_tp.py): the split engine's
    tokens are the whole one's, and every figure is in its report."""
    out = tmp_path / "tp.json"
    proc = engine_benchmark("--tensor-parallel-size", "2", "--model", str(tiny_llama_dir),
                            "--batches", "1,3", "--output-len", "4", "--repeats", "1",
                            "--json", str(out))
    assert "tokens identical" in proc.stdout and "DIFFER" not in proc.stdout
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["identical"] and r["ratio"] > 0
        assert r["collective_share"]["all_reduce"] > 0
