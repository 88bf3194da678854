"""benchmarks/accuracy.py, as docs/performance.md runs it, on the tiny model: its
figures recomputed here from what it reports, and float32's checked against Hugging
Face on the same text and prompts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from benchmarks.accuracy import agreement, reference_text
from hf_reference import assert_matches, hf_greedy, hf_model


def hf_perplexity(model_dir, text_ids: list[int], window: int) -> tuple[float, int]:
    model = hf_model(model_dir)
    nll, count = 0.0, 0
    for i in range(0, len(text_ids) - 1, window):
        ids = text_ids[i:i + window]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        nll -= torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum()
        count += len(ids) - 1
    return math.exp(float(nll) / count), count


def test_accuracy_benchmark_smoke(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "accuracy.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/accuracy.py", "--model", str(tiny_llama_dir),
         "--max-tokens", "4", "--num-prompts", "3", "--text-tokens", "80", "--window", "32",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [f["format"] for f in report["formats"]] == ["float32", "bfloat16", "int8", "q4"]
    reference = report["formats"][0]
    assert reference["perplexity_ratio"] == 1.0 and reference["identical_outputs"] == 1.0
    # float32 is Hugging Face's model: its greedy tokens and its perplexity.
    prompts = report["prompt_token_ids"]
    assert_matches(reference["outputs"], hf_greedy(tiny_llama_dir, prompts, 4), "float32")
    text_ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(reference_text())["input_ids"][:80]
    want, scored = hf_perplexity(tiny_llama_dir, text_ids, report["window"])
    assert reference["scored_tokens"] == scored == 31 + 31 + 15  # windows of 32 over 80
    assert abs(reference["perplexity"] / want - 1) < 1e-4
    for f in report["formats"]:
        assert len(f["outputs"]) == 3 and all(len(o) == 4 for o in f["outputs"])
        assert agreement(f["outputs"], reference["outputs"]) == {
            "identical_outputs": f["identical_outputs"],
            "tokens_before_first_difference": f["tokens_before_first_difference"]}
        assert f["perplexity_ratio"] == f["perplexity"] / reference["perplexity"]
        assert math.isfinite(f["perplexity"]) and f["perplexity"] > 1


def test_accuracy_benchmark_smoke_on_the_default_models_gguf_file(tmp_path):
    """The gguf format (the default model's own file, served as it is) against
    float32 on the default model, as docs/performance.md runs it, briefly."""
    out = tmp_path / "accuracy.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/accuracy.py", "--formats", "float32,gguf",
         "--max-tokens", "4", "--num-prompts", "2", "--text-tokens", "64", "--window", "32",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [f["format"] for f in report["formats"]] == ["float32", "gguf"]
    gguf = report["formats"][1]
    assert len(gguf["outputs"]) == 2 and all(len(o) == 4 for o in gguf["outputs"])
    # the file's weights are the default model's: only the int8 inputs differ
    assert abs(gguf["perplexity_ratio"] - 1) < 0.05


def test_accuracy_benchmark_on_iq4_weights(tiny_llama_dir, tmp_path):
    """--formats float32,iq4, as docs/performance.md runs it: the iq4 engine's figures,
    its weights not float32's (perplexity moves)."""
    out = tmp_path / "accuracy.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/accuracy.py", "--model", str(tiny_llama_dir),
         "--formats", "float32,iq4", "--max-tokens", "4", "--num-prompts", "2",
         "--text-tokens", "64", "--window", "32", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [f["format"] for f in report["formats"]] == ["float32", "iq4"]
    iq4 = report["formats"][1]
    assert len(iq4["outputs"]) == 2 and all(len(o) == 4 for o in iq4["outputs"])
    assert math.isfinite(iq4["perplexity"]) and iq4["perplexity"] != report["formats"][0][
        "perplexity"]


def test_accuracy_benchmark_with_a_bfloat16_kv_cache(tiny_llama_dir, tmp_path):
    """--kv-cache-dtype bfloat16, as docs/performance.md runs it: the formats' caches
    hold bfloat16 (their perplexity moves), the float32 reference's stays float32."""
    reports = {}
    for kv in ("float32", "bfloat16"):
        out = tmp_path / f"accuracy-{kv}.json"
        proc = subprocess.run(
            [sys.executable, "benchmarks/accuracy.py", "--model", str(tiny_llama_dir),
             "--formats", "float32,int8", "--kv-cache-dtype", kv, "--max-tokens", "4",
             "--num-prompts", "2", "--text-tokens", "80", "--window", "40", "--json", str(out)],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        reports[kv] = json.loads(out.read_text())
        assert reports[kv]["kv_cache_dtype"] == kv
    f32, bf16 = (reports[kv]["formats"] for kv in ("float32", "bfloat16"))
    assert f32[0]["perplexity"] == bf16[0]["perplexity"]  # the reference: float32 both times
    assert f32[1]["perplexity"] != bf16[1]["perplexity"]
    assert abs(bf16[1]["perplexity"] / f32[1]["perplexity"] - 1) < 0.01
