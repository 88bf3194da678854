"""The packed weight formats of the CPU kernels (engine_worker/cpu/csrc/gemm.c): float32,
bfloat16 and int8 with one scale per 32 inputs. Each computes exactly with the weights
it unpacks to (int8 with its input quantized the same way), those are as close to the
original as the format allows, and the engine on them gives Hugging Face's greedy output
on the same (unpacked) weights."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine_worker.cpu import build
from engine_worker.cpu.fused import FusedForward
from helpers import greedy, make_engine, random_prompts, run_to_end
from hf_reference import NEAR_TIE, assert_matches, hf_greedy, quantize_blocks

FORMATS = ["float32", "bfloat16", "int8", "q4", "iq4", "mxfp4"]
# The formats whose products quantize x (int8, a scale per block of 32 inputs).
INTEGER = ("int8", "q4", "iq4", "mxfp4")


NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISAS = {"native": [], "avx2": ["-mno-avx512f"], "avx2-no-vnni": ["-mno-avx512f", "-mno-avxvnni"],
        "portable": ["-mno-avx2", "-mno-avx512f"],
        # vdpbf16ps' tiles, which builds for Intel CPUs leave out (they widen faster)
        "avx512-bf16": [*NO_AMX, "-DBF16_DOT_TILES=1"],
        "avx512-no-vnni": ["-mno-avx512vnni", *NO_AMX],
        "avx512-no-bf16": ["-mno-avx512bf16", *NO_AMX],
        "amx-built": ["-mamx-tile", "-mamx-bf16", "-mamx-int8"],
        # AMX's tile instructions in plain C (csrc/amx_emulate.h): the AMX paths run here
        "amx-emulated": ["-DRS_AMX_EMULATE", *NO_AMX]}
# AMX's tiles emulated with every product off by one
FAULTY_AMX = ["-DRS_AMX_EMULATE", "-DRS_AMX_EMULATE_FAULT", *NO_AMX]
# test_intel_and_other_builds_compute_the_same_floats's and
# test_unpacked_4bit_panels_give_the_packed_tiles_floats's ISAs
INTEL_ISAS = ["native", "avx2", "avx512-no-bf16"]
UNPACKING_ISAS = ["avx512-bf16", "avx2", "avx2-no-vnni", "portable"]
PACKED_ONLY = "-DQ4X_MIN_ROWS=1000000"   # 4-bit panels never unpacked


def intel_builds(isa: str) -> tuple[list[str], list[str], list[str]]:
    """An ISA's build for Intel CPUs, for others, and the other that widens bfloat16."""
    return ([*ISAS[isa], "-DRS_INTEL"], [*ISAS[isa], "-URS_INTEL"],   # after the vendor's -D
            [*ISAS["avx512-no-bf16" if isa == "native" else isa], "-URS_INTEL"])


# Every build the tests here load
BUILDS = [*ISAS.values(), NO_AMX, FAULTY_AMX,
          *(flags for isa in INTEL_ISAS for flags in intel_builds(isa)),
          *([*ISAS[isa], PACKED_ONLY] for isa in UNPACKING_ISAS)]


@pytest.fixture(scope="module", autouse=True)
def builds():
    """The kernels the tests here load, built before them all together: on a fresh
    machine, each object compiled once, as many at once as it has cores (built one
    after the other, the longest source of each left a core idle)."""
    build.build_all(BUILDS)


@pytest.fixture(scope="module", params=list(ISAS))
def cpu(request):
    """The kernels as built for this machine, and as an AVX2 machine with and without
    VNNI, one without AVX2, and AVX-512 machines with and without VNNI, bf16 products
    and AMX would build them (the int8 and bfloat16 products differ on each), so that every
    path this CPU can execute is checked whichever CPU runs the tests. AMX's tiles run
    only where the CPU has them; built with them elsewhere, the kernels must fall back.
    And the AMX paths with the tile instructions emulated, which run on any CPU."""
    k = build.build_and_load(ISAS[request.param])
    assert k is not None, "the C kernels must build on the test machines"
    return k


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())


def bf16_dot_products(flags: set[str]) -> str:
    """The bfloat16 path a build without AMX takes on this CPU: vdpbf16ps where it has
    the instruction, but on Intel's, whose cores widen faster (gemm.c)."""
    intel = "-DRS_INTEL" in build.vendor_flags()
    return "avx512-bf16" if "avx512_bf16" in flags and not intel else "widened"


def test_bfloat16_takes_the_best_products_this_cpu_has():
    flags = cpu_flags()
    best = "amx" if "amx_bf16" in flags else bf16_dot_products(flags)
    assert build.build_and_load([]).bf16_path == best
    assert build.build_and_load(NO_AMX).bf16_path == bf16_dot_products(flags)
    assert build.build_and_load(ISAS["avx512-bf16"]).bf16_path == (
        "avx512-bf16" if "avx512_bf16" in flags else "widened")
    assert build.build_and_load(ISAS["avx512-no-bf16"]).bf16_path == "widened"
    assert build.build_and_load(ISAS["amx-built"]).bf16_path == best
    emulated = "amx" if "avx512_bf16" in flags else "widened"  # AMX's bf16 tiles take vdpbf16ps' x
    assert build.build_and_load(ISAS["amx-emulated"]).bf16_path == emulated
    if "amx_bf16" not in flags:
        pytest.skip("this CPU has no AMX: its tiles were built and fell back, not run")


def int8_dot_products(flags: set[str]) -> str:
    """The int8 path an AVX-512 (or AVX2) build without AMX takes on this CPU."""
    return ("vnni" if "avx512_vnni" in flags or ("avx_vnni" in flags and "avx512f" not in flags)
            else "no-vnni")


def test_int8_takes_the_best_products_this_cpu_has():
    flags = cpu_flags()
    best = "amx" if "amx_int8" in flags else int8_dot_products(flags)
    assert build.build_and_load([]).int8_path == best
    assert build.build_and_load(NO_AMX).int8_path == int8_dot_products(flags)
    assert build.build_and_load(ISAS["avx512-no-vnni"]).int8_path == "no-vnni"
    assert build.build_and_load(ISAS["amx-built"]).int8_path == best
    if "amx_int8" not in flags:
        pytest.skip("this CPU has no AMX: its int8 tiles were built and fell back, not run "
                    "(test_amx_integer_tiles_give_the_vnni_tiles_results runs them "
                    "emulated)")


def amx_and_vnni_builds():
    """The kernels with AMX's int8 tiles (this CPU's, else emulated) and without them."""
    if int8_dot_products(cpu_flags()) != "vnni":
        pytest.skip("AMX's int8 tiles are built only with VNNI (every AMX CPU has it)")
    vnni = build.build_and_load(NO_AMX)
    native = build.build_and_load([])
    amx = native if native.int8_path == "amx" else build.build_and_load(ISAS["amx-emulated"])
    assert (amx.int8_path, vnni.int8_path) == ("amx", "vnni")
    return amx, vnni


@pytest.mark.parametrize("fmt", ["int8", "q4", "iq4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (50, 96), (130, 576), (40, 1536)])
def test_amx_integer_tiles_give_the_vnni_tiles_results(n, k, fmt):
    """From 16 rows int8 and 4-bit products run on AMX tiles (a block of 32 inputs per
    product, odd and even block counts; 4-bit nibbles spread into bytes first; IQ4's and
    MXFP4's panels unpacked to int8 ones, a panel at a time), scaled as the VNNI tiles
    scale them: int8, IQ4 and MXFP4 the same floats, 4-bit within a float32 rounding
    (the compiler orders its sum of two products otherwise there). On a CPU without AMX
    the tile instructions are emulated (csrc/amx_emulate.h)."""
    amx, vnni = amx_and_vnni_builds()
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * torch.logspace(-3, 1, k)
    packed = vnni.pack(w, fmt)
    assert torch.equal(amx.pack(w, fmt), packed)
    deq = vnni.unpack(packed, n, k, fmt)
    for m in (15, 16, 17, 31, 32, 33, 64):
        x = torch.randn(m, k) * 3
        x[1, :32] = 0.0  # an all-zero block: scale 0
        for bias in (None, torch.randn(n)):
            got = amx.linear(x, packed, n, bias, fmt)
            want = vnni.linear(x, packed, n, bias, fmt)
            if fmt != "q4":
                assert torch.equal(got, want), (m, (got - want).abs().max())
            else:  # float32 roundings of the sum of |products|, far below a block's share
                bound = 1e-6 * (x.abs() @ deq.abs().T + 1)
                assert ((got - want).abs() <= bound).all(), (m, (got - want).abs().max())


def test_amx_tiles_that_disagree_at_load_are_not_used(caplog):
    """The kernels check AMX's tiles against the other paths on a small layer as they
    load; tiles that give other results (here emulated ones, every product off by one)
    are not used, with a warning, and the layers still compute right."""
    flags = cpu_flags()
    if int8_dot_products(flags) != "vnni" and "avx512_bf16" not in flags:
        pytest.skip("AMX's tiles are built only with VNNI or AVX-512-BF16 beside them")
    with caplog.at_level(logging.WARNING, logger="engine_worker.cpu.kernels"):
        faulty = build.build_and_load(FAULTY_AMX)
    assert "AMX tiles gave other results than its vector instructions" in caplog.text
    assert faulty.int8_path == int8_dot_products(flags)
    assert faulty.bf16_path == bf16_dot_products(flags)
    plain = build.build_and_load(NO_AMX)
    torch.manual_seed(1)
    w, x = torch.randn(40, 96), torch.randn(33, 96)
    for fmt in ("int8", "q4", "bfloat16"):
        packed = plain.pack(w, fmt)
        assert torch.equal(faulty.linear(x, packed, 40, None, fmt),
                           plain.linear(x, packed, 40, None, fmt))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine_worker.cpu.kernels"):
        assert build.build_and_load(ISAS["amx-emulated"]).int8_path in ("amx", "no-vnni")
    assert "AMX tiles" not in caplog.text


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_the_engine_on_amx_integer_tiles_gives_the_vnni_engines_tokens_and_logprobs(
        tiny_llama_dir, fmt):
    """The fused forward with AMX's integer tiles (its threads each configure their own
    tiles), prompts and 16-sequence decode steps: the VNNI engine's tokens, and its
    logprobs (int8: the same floats; 4-bit: within a rounding)."""
    amx, vnni = amx_and_vnni_builds()
    prompts = random_prompts([3, 17, 5, 33, 9, 16, 2, 21, 7, 40, 11, 4, 26, 8, 13, 19], seed=5)
    results = []
    try:
        for k in (amx, vnni):
            build.loaded["cpu"] = k
            # a float32 cache: keys within a rounding of each other could round to
            # different bfloat16 ones
            engine = make_engine(tiny_llama_dir, quantization=fmt, kv_cache_dtype="float32")
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{i}", prompt, greedy(6, logprobs=2))
            results.append({r: [(o.new_token_ids, o.logprobs) for o in outs]
                            for r, outs in run_to_end(engine).items()})
    finally:
        build.loaded.pop("cpu", None)
    if fmt == "int8":
        assert results[0] == results[1]
    tokens = [{r: [ids for ids, _ in outs] for r, outs in res.items()} for res in results]
    assert tokens[0] == tokens[1]
    logprobs = [[lp.logprob for outs in res.values() for _, lps in outs for lp in lps]
                for res in results]
    assert logprobs[0] == pytest.approx(logprobs[1], rel=1e-5, abs=1e-5)
    assert len(results[0]) == 16 and all(sum(len(ids) for ids, _ in outs) == 6
                                         for outs in results[0].values())


def test_bfloat16_weights_need_an_even_number_of_inputs(cpu):
    with pytest.raises(ValueError, match="multiples of 2; a layer has 33"):
        cpu.pack(torch.randn(16, 33), "bfloat16")


def rounded_inputs(cpu, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """x as the kernels multiply it: int8 with a scale per block of 32, bfloat16 where
    the CPU multiplies bf16 products, else as it is."""
    if fmt in INTEGER:
        return quantize_blocks(x)
    if fmt == "bfloat16" and cpu.bf16_path != "widened":
        return x.to(torch.bfloat16).float()
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_weight_is_as_close_as_its_format_allows(cpu, fmt):
    torch.manual_seed(0)
    w = torch.randn(50, 96) * torch.logspace(-3, 1, 96)  # varied magnitudes along K
    w[3] = 0.0  # an all-zero row: scale 0, no division by it
    got = cpu.unpack(cpu.pack(w, fmt), 50, 96, fmt)
    if fmt == "float32":
        assert torch.equal(got, w)
    elif fmt == "bfloat16":
        assert torch.equal(got, w.to(torch.bfloat16).float())  # round to nearest even
    elif fmt == "int8":
        blocks = w.view(50, 3, 32)
        step = blocks.abs().amax(-1, keepdim=True) / 127  # one int8 step per block
        err = (got.view(50, 3, 32) - blocks).abs()
        assert (err <= step * 0.5001 + 1e-12).all()
        assert torch.equal(got[3], torch.zeros(96))
    if fmt == "q4":  # as GGUF's Q4_1: 16 steps from each block's minimum to its maximum
        blocks = w.view(50, 3, 32)
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        step = (hi - lo) / 15  # and d, min rounded to half precision
        err = (got.view(50, 3, 32) - blocks).abs()
        assert (err <= step * 0.51 + lo.abs() * 1e-3 + 1e-7).all()
        assert torch.equal(got[3], torch.zeros(96))
    if fmt == "iq4":  # as ggml's IQ4_NL: the largest weight of a block its level -127
        blocks = w.view(50, 3, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        err = (got.view(50, 3, 32) - blocks).abs()
        # at most half the widest gap (24 levels), or past the far end (113 against 127)
        assert (err <= d * 14.0001 + 1e-12).all()
        assert torch.equal(got[3], torch.zeros(96))
    if fmt == "mxfp4":  # as gguf quantizes MXFP4 (the OCP MX format's scale), exactly
        from gguf import GGMLQuantizationType, quants

        raw = quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
        assert torch.equal(cpu.pack(w, fmt), cpu.pack_gguf(torch.from_numpy(raw), 39, 50, 96)[0])
        assert torch.equal(got, torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4)))
        assert torch.equal(got[3], torch.zeros(96))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (50, 96), (130, 576), (40, 130)])
def test_linear_computes_with_the_unpacked_weight(cpu, fmt, n, k):
    if fmt in INTEGER and k % 32:
        return  # refused: test_int8_refuses_inputs_that_are_not_whole_blocks
    torch.manual_seed(n * k)
    w, bias = torch.randn(n, k), torch.randn(n)
    packed = cpu.pack(w, fmt)
    deq = cpu.unpack(packed, n, k, fmt)
    # tile remainders; in-register and expanded; AMX's tiles of 16 rows and their rest
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k)
        x[0, :32] = 0.0  # an all-zero block: int8 scale 0
        xr = rounded_inputs(cpu, fmt, x)
        torch.testing.assert_close(cpu.linear(x, packed, n, bias, fmt), xr @ deq.T + bias,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cpu.linear(x, packed, n, None, fmt), xr @ deq.T,
                                   rtol=1e-4, atol=1e-4)


def random_blocks(ggml_type: str, n: int, k: int) -> np.ndarray:
    """n rows of k weights in random IQ4_NL blocks (a half scale, 16 bytes of nibbles)
    or IQ4_XS super-blocks of 256 (a half scale, then random 6-bit sub-block scales and
    nibbles), which gguf cannot quantize, or MXFP4 blocks (a power-of-two scale byte,
    16 bytes of nibbles) of every code, the least scale and a large one: any such bytes
    are valid blocks."""
    size, weights = {"IQ4_NL": (18, 32), "IQ4_XS": (136, 256), "MXFP4": (17, 32)}[ggml_type]
    rng = np.random.default_rng(n * k)
    raw = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    if ggml_type == "MXFP4":
        raw[:, :, 0] = rng.integers(116, 127, (n, k // weights))   # weights up to 3
        raw[0, 0, 0], raw[0, -1, 0] = 0, 250   # the least scale (subnormal), and a large one
        raw[n // 2, :, 1:] = 0   # an all-zero row
        return raw.reshape(n, -1)
    scale = 0.01 if ggml_type == "IQ4_NL" else 0.0005   # IQ4_XS's times up to 32
    raw[:, :, :2] = (rng.standard_normal((n, k // weights, 1)) * scale).astype(np.float16) \
        .view(np.uint8)
    raw[n // 2, :, :2] = 0   # an all-zero row
    return raw.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "MXFP4"])
def test_gguf_blocks_are_packed_as_they_are_and_computed_with(cpu, ggml_type):
    """A GGUF tensor's blocks unpack to exactly what gguf's own dequantization gives
    (nothing requantized), and the kernels compute with them, x quantized per 32."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[ggml_type]
    torch.manual_seed(int(t))
    shapes = [(17, 256), (50, 512)] if ggml_type == "IQ4_XS" else \
        [(1, 32), (17, 64), (50, 96), (130, 576)]
    for n, k in shapes:
        w = torch.randn(n, k) * torch.logspace(-3, 1, k)
        w[n // 2] = 0.0  # an all-zero row
        raw = random_blocks(ggml_type, n, k) if ggml_type in ("IQ4_NL", "IQ4_XS", "MXFP4") \
            else quants.quantize(w.numpy(), t)
        packed, fmt = cpu.pack_gguf(torch.from_numpy(raw), int(t), n, k)
        assert fmt == {"Q8_0": "int8", "IQ4_NL": "iq4", "IQ4_XS": "iq4",
                       "MXFP4": "mxfp4"}.get(ggml_type, "q4")
        deq = cpu.unpack(packed, n, k, fmt)
        assert torch.equal(deq, torch.from_numpy(quants.dequantize(raw, t)))
        if ggml_type == "MXFP4":   # the extreme scales were for unpacking: not products
            raw = raw.reshape(n, -1, 17).copy()
            raw[0, 0, 0] = raw[0, -1, 0] = 127
            packed = cpu.pack_gguf(torch.from_numpy(raw.reshape(n, -1)), int(t), n, k)[0]
            deq = cpu.unpack(packed, n, k, fmt)
        bias = torch.randn(n)
        for m in (1, 2, 3, 4, 9, 17, 33, 64):
            x = torch.randn(m, k)
            x[0, :32] = 0.0
            torch.testing.assert_close(cpu.linear(x, packed, n, bias, fmt),
                                       quantize_blocks(x) @ deq.T + bias,
                                       rtol=1e-4, atol=1e-4)


def test_int8_refuses_inputs_that_are_not_whole_blocks(cpu):
    for fmt in INTEGER:
        with pytest.raises(ValueError, match=f"{fmt} weights need input sizes that are "
                                             f"multiples of 32; a layer has 40"):
            cpu.pack(torch.randn(16, 40), fmt)


def unpacked_checkpoint(engine, src_dir, dst_dir) -> None:
    """The engine's weights as it computes with them, as a Hugging Face checkpoint
    (untied: the embedding rows stay float32 while lm_head is packed)."""
    cfg, model, fmt = engine.model_config, engine.runner.model, engine.runner.weight_format
    unpack = lambda lin: cpu_kernels().unpack(lin.packed, lin.out_features,  # noqa: E731
                                              lin.in_features, fmt)
    q, kv, i_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    tensors = {"model.embed_tokens.weight": model.embed_tokens.weight,
               "model.norm.weight": model.norm.weight, "lm_head.weight": unpack(model.lm_head)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = unpack(layer.self_attn.qkv_proj)
        gate_up = unpack(layer.mlp.gate_up_proj)
        tensors |= {p + "self_attn.q_proj.weight": qkv[:q],
                    p + "self_attn.k_proj.weight": qkv[q:q + kv],
                    p + "self_attn.v_proj.weight": qkv[q + kv:],
                    p + "self_attn.o_proj.weight": unpack(layer.self_attn.o_proj),
                    p + "mlp.gate_proj.weight": gate_up[:i_size],
                    p + "mlp.up_proj.weight": gate_up[i_size:],
                    p + "mlp.down_proj.weight": unpack(layer.mlp.down_proj),
                    p + "input_layernorm.weight": layer.input_layernorm.weight,
                    p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    dst_dir.mkdir()
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              dst_dir / "model.safetensors")
    config = json.loads((src_dir / "config.json").read_text())
    (dst_dir / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    if (src_dir / "generation_config.json").exists():
        shutil.copy(src_dir / "generation_config.json", dst_dir)


def cpu_kernels():
    return build.cpu_kernels()


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "q4", "iq4"])
def test_the_engine_on_packed_weights_matches_hf_on_the_same_weights(tiny_llama_dir,
                                                                     tmp_path, fmt):
    engine = make_engine(tiny_llama_dir, kv_cache_dtype="float32",   # HF's float32 keys
                         **({"dtype": "bfloat16"} if fmt == "bfloat16"
                            else {"quantization": fmt}))
    assert engine.runner.weight_format == fmt and isinstance(engine.runner.step, FusedForward)
    prompts = random_prompts([1, 5, 17, 33], seed=9)
    out = engine.generate(prompts, greedy(10))
    unpacked_checkpoint(engine, tiny_llama_dir, tmp_path / fmt)
    kernels_used = cpu_kernels()
    # Quantized inputs make logits step: an activation one float ulp away from HF's
    # can round to the next int8 step (1/127 of its block's amax), which moved a logit
    # of 3.2 by 5e-4 in a q4 run: for the formats that quantize inputs, a near-tie is a
    # top-2 gap under 2e-3.
    near_tie = 2e-3 if fmt in ("int8", "q4", "iq4") else NEAR_TIE
    assert_matches(out, hf_greedy(tmp_path / fmt, prompts, 10,
                                  round_inputs=lambda x: rounded_inputs(kernels_used, fmt, x)),
                   fmt, near_tie)
    # and the format is not a no-op: float32 weights give other logits somewhere
    assert not torch.equal(cpu_kernels().unpack(engine.runner.model.lm_head.packed,
                                                engine.model_config.vocab_size,
                                                engine.model_config.hidden_size, fmt),
                           make_engine(tiny_llama_dir).runner.model.embed_tokens.weight)


def test_int8_without_the_c_kernels_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="int8 weights need the CPU C kernels"):
        make_engine(tiny_llama_dir, cpu_kernels=False, quantization="int8")


def test_an_unknown_quantization_is_refused_by_name():
    from common.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be int8, q4, iq4, fp8 or unset, got 'int4'"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize("isa", INTEL_ISAS)
def test_intel_and_other_builds_compute_the_same_floats(isa):
    """The kernels for Intel CPUs (RS_INTEL, which kernels.py sets from the vendor)
    fetch float tiles' next panels into L2 instead of L1 and take 4 panels at every row
    count (FLOAT_WIDE_TILES): a cache hint and another grouping of the same products,
    each output summed in the same order, so float32 layers give the same floats either
    way, at 1-64 rows (row blocks of 6, the last partial; 4 panels, then 3 alone).
    Their bfloat16 weights are widened (in registers up to 16 rows, into float32 panels
    above), where other builds may multiply with vdpbf16ps: the floats of a build that
    widens (one without AVX-512-BF16)."""
    intel, other, widened = map(build.build_and_load, intel_builds(isa))
    assert intel is not None and other is not None and widened is not None
    torch.manual_seed(0)
    for fmt, reference in (("float32", other), ("bfloat16", widened)):
        w = torch.randn(100, 96)
        packed = other.pack(w, fmt)
        for m in (1, 5, 8, 12, 17, 64):
            x = torch.randn(m, 96)
            assert torch.equal(intel.linear(x, packed, 100, None, fmt),
                               reference.linear(x, packed, 100, None, fmt)), (fmt, m)


@pytest.mark.parametrize("fmt", ["q4", "iq4", "mxfp4"])
@pytest.mark.parametrize("isa", UNPACKING_ISAS)
def test_unpacked_4bit_panels_give_the_packed_tiles_floats(isa, fmt):
    """From Q4X_MIN_ROWS rows a thread unpacks each group of 4-bit (or IQ4, MXFP4) panels
    into bytes once (gemm.c; IQ4's and MXFP4's into int8 panels, for the int8 tiles) instead of each row
    block unpacking the nibbles: the same products summed in the same order, so the same
    floats."""
    unpacking = build.build_and_load(ISAS[isa])   # without AMX, whose tiles take over
    packed_only = build.build_and_load([*ISAS[isa], PACKED_ONLY])
    assert unpacking is not None and packed_only is not None
    torch.manual_seed(0)
    w = torch.randn(100, 160)   # a partial panel; 5 blocks of 32 inputs
    weight = unpacking.pack(w, fmt)
    for m in (33, 40, 64, 97):
        x = torch.randn(m, 160)
        assert torch.equal(unpacking.linear(x, weight, 100, None, fmt),
                           packed_only.linear(x, weight, 100, None, fmt)), m


def test_only_intel_cpus_build_with_the_intel_flag(monkeypatch):
    for vendor, flags in (("vendor_id\t: GenuineIntel\n", ("-DRS_INTEL",)),
                          ("vendor_id\t: AuthenticAMD\n", ()), ("", ())):
        monkeypatch.setattr(build, "_cpuinfo", lambda field, v=vendor: v)
        build.vendor_flags.cache_clear()
        assert build.vendor_flags() == flags
        assert build.build_flags(["-DX"])[-len(flags) - 1:] == [*flags, "-DX"]
    build.vendor_flags.cache_clear()
