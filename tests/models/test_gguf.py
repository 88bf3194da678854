"""Serving a GGUF file as it is (engine_worker/models/gguf.py, common/model_files.py): the
default model's own file (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding),
whose weights must be exactly what the file's dequantization gives (the default model's
folder holds them so); each block type packed as it is or re-stored; and files the
engine must refuse, by name, at start. Served through the real processes:
tests/e2e/test_gguf_served.py; each architecture's files:
tests/models/test_gguf_architectures.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from common.errors import ModelLoadError
from common.protocol import SamplingParams
from common.model_files import (_convert_gguf, _find_gguf, end_of_generation_ids,
                                materialize_default_model, resolve_model_dir)
from engine_worker.cpu import build
from engine_worker.cpu.fused import FusedForward
from helpers import greedy, make_engine
from gguf_files import gguf_from_hf
from hf_reference import hf_model, quantize_blocks


@pytest.fixture(scope="module")
def gguf_path():
    return _find_gguf()


@pytest.fixture(scope="module")
def gguf_engine(gguf_path):
    return make_engine(resolve_model_dir(str(gguf_path)))


def test_the_folder_of_a_gguf_file_holds_its_metadata_and_no_weights(gguf_path):
    folder = resolve_model_dir(str(gguf_path))
    assert folder.name == "SmolLM2-135M-Instruct.Q4_1"
    assert json.loads((folder / "gguf.json").read_text()) == {"file": str(gguf_path.resolve())}
    assert not list(folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        (30, 576, 49152)
    assert "im_start" in (folder / "chat_template.jinja").read_text()
    assert resolve_model_dir(str(gguf_path)) == folder  # made once


def test_a_missing_gguf_file_is_named():
    with pytest.raises(ModelLoadError, match="GGUF file '/nowhere/x.gguf' does not exist"):
        resolve_model_dir("/nowhere/x.gguf")


def test_every_weight_is_what_the_file_holds(gguf_engine):
    """Unpacked, each packed layer equals transformers' dequantization of the same file
    (the default model's folder), q and k rows back in Hugging Face's order."""
    model, k = gguf_engine.runner.model, build.cpu_kernels()
    cfg = gguf_engine.model_config
    assert gguf_engine.runner.weight_format == "q4" and isinstance(gguf_engine.runner.step, FusedForward)
    assert gguf_engine.runner.kv_dtype == torch.bfloat16   # auto, for 4-bit weights
    ref_dir = materialize_default_model()
    with safe_open(str(ref_dir / "model.safetensors"), framework="pt") as ref:
        def take(name):
            return ref.get_tensor(name)

        def unpack(lin):
            return k.unpack(lin.packed, lin.out_features, lin.in_features, lin.fmt)

        for i in (0, cfg.num_layers - 1):
            p, layer = f"model.layers.{i}.", model.layers[i]
            assert layer.self_attn.qkv_proj.fmt == "q4"
            assert torch.equal(unpack(layer.self_attn.qkv_proj), torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            assert torch.equal(unpack(layer.self_attn.o_proj), take(p + "self_attn.o_proj.weight"))
            assert torch.equal(unpack(layer.mlp.gate_up_proj), torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            assert torch.equal(unpack(layer.mlp.down_proj), take(p + "mlp.down_proj.weight"))
            assert torch.equal(layer.input_layernorm.weight, take(p + "input_layernorm.weight"))
        embed = take("model.embed_tokens.weight")
        assert torch.equal(model.embed_tokens.weight, embed)
        assert model.lm_head.fmt == "int8"  # the file's Q8_0 embedding, tied
        assert torch.equal(unpack(model.lm_head), embed)
        assert torch.equal(model.norm.weight, take("model.norm.weight"))


def test_each_greedy_token_is_hfs_choice_up_to_quantization_noise(gguf_engine):
    """Hugging Face on the dequantized file, each linear layer's input quantized as
    the kernels quantize it, scores the engine's greedy tokens (teacher forcing): each
    is its best token or within 0.3 of it in log-probability, and most are its best.
    Not token for token: quantized inputs turn a one-ulp difference in an activation
    (HF's RMSNorm rounds otherwise than ours) into a whole int8 step, and over 30
    layers that moved a first token's log-probability by 0.04 between our own fused
    and layer-by-layer forwards, with int8 weights as with these."""
    prompts = [[1, 9690, 28, 198], [1, 504, 3458, 282, 4649, 314], [1] + list(range(400, 430))]
    outs = gguf_engine.generate(prompts, greedy(8))
    model = hf_model(materialize_default_model())
    hooks = [m.register_forward_pre_hook(lambda _m, args: (quantize_blocks(args[0]),))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    best_chosen = 0
    try:
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0]
            lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            chosen, best = lp[torch.arange(len(out)), out], lp.max(-1).values
            assert (best - chosen <= 0.3).all(), (out, (best - chosen).tolist())
            best_chosen += int((chosen == best).sum())
    finally:
        for hook in hooks:
            hook.remove()
    assert best_chosen >= 0.75 * sum(map(len, outs))


def write_gguf(path, arch="llama", tensors=(), fields=None):
    """A GGUF file with llama metadata, ``fields`` (key: u16) and ``tensors``: (name,
    array, raw type)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in (fields or {}).items():
        w.add_uint16(key, value)
    for name, array, raw_type in tensors:
        w.add_tensor(name, array, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_files_it_cannot_serve_are_refused_saying_why(tmp_path):
    from gguf import GGMLQuantizationType as T

    from engine_worker.models.gguf import GgufWeights
    from engine_worker.models.registry import gguf_architecture

    q8_k = np.zeros((64, 292), dtype=np.uint8)  # 64 rows of 256 Q8_K weights (activations')
    ok = np.zeros((64, 256), dtype=np.float32)
    write_gguf(tmp_path / "k.gguf", tensors=[("blk.0.attn_v.weight", q8_k, T.Q8_K),
                                             ("blk.0.attn_q.weight", ok, T.F32)])
    with pytest.raises(ModelLoadError, match=r"k\.gguf has tensors in types roseserve cannot "
                       r"serve as they are: blk\.0\.attn_v\.weight \(Q8_K\); it serves F32.*"
                       r"IQ4_NL, IQ4_XS and MXFP4 as they are, and Q5_0, Q4_K.* re-stored"):
        GgufWeights(tmp_path / "k.gguf", build.cpu_kernels())
    write_gguf(tmp_path / "s.gguf", tensors=[("blk.0.attn_q.weight", ok, T.F32)],
               fields={"split.count": 3})
    with pytest.raises(ModelLoadError, match=r"s\.gguf is one of 3 parts of a split GGUF "
                       r"file; join them first \(llama.cpp's llama-gguf-split --merge"):
        GgufWeights(tmp_path / "s.gguf", build.cpu_kernels())
    with pytest.raises(ModelLoadError, match=r"q\.gguf: roseserve serves GGUF files of the "
                       r"llama, qwen2, qwen2moe, qwen3, qwen3moe, phi3, gemma2, gemma3 and "
                       r"gpt-oss architectures \(.*\), not 'seed_oss'"):
        gguf_architecture("q.gguf", {"general.architecture": "seed_oss"})


def test_q_k_v_of_types_of_other_formats_become_one_int8_weight(tmp_path):
    """q Q4_0 (4-bit) beside k Q8_0 (int8): one weight of int8, Q4_0's values exactly
    (q - 8 are int8 values of its scale); a dense tensor beside a block one is refused."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.models.gguf import GgufWeights

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    tensors = [("blk.0.attn_q.weight", quants.quantize(w, T.Q4_0), T.Q4_0),
               ("blk.0.attn_k.weight", quants.quantize(w, T.Q8_0), T.Q8_0),
               ("blk.0.attn_v.weight", w, T.F32)]
    write_gguf(tmp_path / "mix.gguf", tensors=tensors)
    weights = GgufWeights(tmp_path / "mix.gguf", build.cpu_kernels())
    lin = weights.pack(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 64)
    assert lin.fmt == "int8"
    want = np.concatenate([quants.dequantize(a, t) for _, a, t in tensors[:2]])
    assert torch.equal(build.cpu_kernels().unpack(lin.packed, 128, 64, "int8"),
                       torch.from_numpy(want))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_k\.weight \(Q8_0\), "
                       r"blk\.0\.attn_v\.weight \(F32\) are computed as one weight and "
                       r"must all be dense or all in blocks"):
        weights.pack(["blk.0.attn_k.weight", "blk.0.attn_v.weight"], 64)


def test_one_weight_of_types_that_cannot_pack_together(tmp_path):
    """IQ4_NL rows that are not whole panels of 16 beside IQ4_XS ones cannot be packed
    apart: both become int8 (IQ4_NL's values exactly, IQ4_XS's requantized); BF16
    beside F32 is widened to one float32 weight; and IQ4_XS tensors need inputs in
    whole super-blocks of 256."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.models.gguf import GgufWeights

    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 24, 8, 18, (0,)), T.IQ4_NL),
               "blk.0.attn_k.weight": (random_blocks(rng, 16, 1, 136, (0,)), T.IQ4_XS),
               "blk.0.ffn_gate.weight": (w, T.F32),
               "blk.0.ffn_up.weight": (torch.from_numpy(w).bfloat16().view(torch.int16)
                                       .numpy(), T.BF16)}
    write_gguf(tmp_path / "m.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    weights = GgufWeights(tmp_path / "m.gguf", build.cpu_kernels())
    lin = weights.pack(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 256)
    assert (lin.fmt, lin.out_features) == ("int8", 40)
    got = build.cpu_kernels().unpack(lin.packed, 40, 256, "int8")
    nl, xs = (torch.from_numpy(quants.dequantize(*tensors[n])).view(-1, 256)
              for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    assert torch.equal(got[:24], nl)
    err = (got[24:] - xs).view(-1, 32).abs().amax(-1)
    assert (err <= xs.view(-1, 32).abs().amax(-1) / 250).all() and err.max() > 0
    dense = weights.pack(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], 256)
    assert (dense.fmt, dense.out_features) == ("float32", 32)
    assert torch.equal(build.cpu_kernels().unpack(dense.packed, 32, 256, "float32"),
                       torch.cat([torch.from_numpy(w),
                                  torch.from_numpy(w).bfloat16().float()]))
    with pytest.raises(ValueError, match="multiples of 256; a tensor has 288"):
        build.cpu_kernels().pack_gguf(torch.zeros(16, 136 + 17, dtype=torch.uint8), 23,
                                        16, 288)


def random_blocks(rng, rows: int, blocks: int, size: int, halves: tuple[int, ...]):
    """Rows of random GGUF blocks of ``size`` bytes whose half-precision fields at
    ``halves`` are small finite scales: any other bytes are valid block contents."""
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in halves:
        raw[:, :, at:at + 2] = (rng.standard_normal((rows, blocks, 1)) * 0.01) \
            .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_k_quant_files_tensors_are_re_stored_as_types_the_kernels_compute(tmp_path,
                                                                            monkeypatch):
    """The types of a Q4_K_M file (llama.cpp's Q4_K_M of the default model holds Q5_0,
    Q4_K, Q6_K and Q8_0 tensors, q and k Q5_0 beside a Q8_0 v): Q5_0 becomes Q8_0
    exactly, so q, k and v make one int8 weight equal to gguf's dequantization; Q4_K
    becomes Q4_1 with each sub-block's scale and offset rounded to half precision (Q6_K:
    the next test); beside Q8_0 it becomes int8. Tensors are re-stored a few rows at a
    time here (RESTORE_CHUNK_BYTES), as large ones are."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.models import gguf_types
    from engine_worker.models.gguf import GgufWeights

    monkeypatch.setattr(gguf_types, "RESTORE_CHUNK_BYTES", 600)   # 3 Q5_0, 4 Q4_K rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 64, 8, 22, (0,)), T.Q5_0),
               "blk.0.attn_k.weight": (quants.quantize(w[:32], T.Q5_0), T.Q5_0),
               "blk.0.attn_v.weight": (quants.quantize(w[32:], T.Q8_0), T.Q8_0),
               "blk.0.ffn_gate.weight": (random_blocks(rng, 32, 1, 144, (0, 2)), T.Q4_K),
               "blk.0.ffn_up.weight": (random_blocks(rng, 16, 1, 144, (0, 2)), T.Q4_K)}
    write_gguf(tmp_path / "km.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    weights, k = GgufWeights(tmp_path / "km.gguf", build.cpu_kernels()), build.cpu_kernels()

    def dequantized(*names):
        return torch.from_numpy(np.concatenate(
            [quants.dequantize(*tensors[n]).reshape(len(tensors[n][0]), -1) for n in names]))

    def unpacked(lin):
        return k.unpack(lin.packed, lin.out_features, lin.in_features, lin.fmt)

    qkv = weights.pack(["blk.0.attn_q.weight", "blk.0.attn_k.weight",
                          "blk.0.attn_v.weight"], 256)
    assert (qkv.fmt, qkv.out_features) == ("int8", 128)
    assert torch.equal(unpacked(qkv), dequantized("blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                                  "blk.0.attn_v.weight"))
    gate_up = weights.pack(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], 256)
    assert gate_up.fmt == "q4"
    want = dequantized("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")
    # a weight d sc q - dmin m, with d sc and dmin m each off by at most half an ulp of
    # half precision (2^-11 of it), q at most 15
    blocks = np.concatenate([tensors[n][0] for n in ("blk.0.ffn_gate.weight",
                                                     "blk.0.ffn_up.weight")]).reshape(-1, 144)
    d, dmin = (torch.from_numpy(blocks[:, at:at + 2].copy().view(np.float16)[:, 0]
                                .astype(np.float32)).abs().repeat_interleave(256)
               for at in (0, 2))
    bound = (15 * 63 * d + 63 * dmin) * 2.0 ** -11
    err = (unpacked(gate_up) - want).abs().flatten()
    assert (err <= bound + 1e-12).all() and err.max() > 0  # rounded, not exact
    # Q4_K (4-bit) beside Q8_0 (int8), as llama.cpp's mixes give v more bits than q and
    # k: one int8 weight, Q4_K's values requantized within half a step of 127 a block
    mixed = weights.pack(["blk.0.ffn_up.weight", "blk.0.attn_v.weight"], 256)
    assert (mixed.fmt, mixed.out_features) == ("int8", 48)
    want = dequantized("blk.0.ffn_up.weight", "blk.0.attn_v.weight").view(-1, 32)
    err = (unpacked(mixed).view(-1, 32) - want).abs().amax(-1)
    assert (err <= want.abs().amax(-1) / 250).all() and err[:128].max() > 0
    assert torch.equal(unpacked(mixed)[16:], dequantized("blk.0.attn_v.weight"))


def test_iq4_files_tensors_are_packed_as_they_are(tmp_path):
    """llama.cpp's IQ4_XS files (of the default model: IQ4_NL where a row's 576 weights
    are not whole super-blocks of 256, IQ4_XS elsewhere): both pack as the IQ4 format,
    exactly what gguf's dequantization gives (IQ4_XS's scales are floats there), and q
    and k of the two types are one weight, each packed apart (their rows whole
    panels)."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.models.gguf import GgufWeights

    rng = np.random.default_rng(1)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 32, 8, 18, (0,)), T.IQ4_NL),
               "blk.0.attn_k.weight": (random_blocks(rng, 16, 1, 136, (0,)), T.IQ4_XS)}
    write_gguf(tmp_path / "iq4.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    lin = GgufWeights(tmp_path / "iq4.gguf", build.cpu_kernels()).pack(
        ["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 256)
    assert (lin.fmt, lin.out_features) == ("iq4", 48)
    want = np.concatenate([quants.dequantize(*tensors[n]) for n in tensors])
    assert torch.equal(build.cpu_kernels().unpack(lin.packed, 48, 256, "iq4"),
                       torch.from_numpy(want))


# Bytes per block and where its half-precision scales are, for the types requantized.
REQUANTIZED = {"Q5_1": (24, (0, 2)), "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)),
               "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "IQ2_XXS": (66, (0,)),
               "IQ3_S": (110, (0,)), "TQ2_0": (66, (64,))}


@pytest.mark.parametrize("type_name", list(REQUANTIZED))
def test_other_k_quant_types_are_requantized_as_q8_0(tmp_path, monkeypatch, type_name):
    """Q5_1, Q2_K to Q6_K and the other types gguf dequantizes (some of them here) become
    int8 weights (Q8_0 blocks) within half a step of 127 of gguf's dequantization, per
    block of 32, requantized a few rows at a time (the 48 rows in 10 chunks)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    from engine_worker.models import gguf_types
    from engine_worker.models.gguf import GgufWeights

    t = GGMLQuantizationType[type_name]
    size, halves = REQUANTIZED[type_name]
    raw = random_blocks(np.random.default_rng(int(t)), 48, 256 // GGML_QUANT_SIZES[t][0],
                        size, halves)
    monkeypatch.setattr(gguf_types, "RESTORE_CHUNK_BYTES", 5 * raw.shape[1])
    write_gguf(tmp_path / "r.gguf", tensors=[("blk.0.ffn_down.weight", raw, t)])
    lin = GgufWeights(tmp_path / "r.gguf", build.cpu_kernels()).pack(
        ["blk.0.ffn_down.weight"], 256)
    assert lin.fmt == "int8"
    want = torch.from_numpy(quants.dequantize(raw, t)).view(-1, 32)
    got = build.cpu_kernels().unpack(lin.packed, 48, 256, "int8").view(-1, 32)
    err = (got - want).abs().amax(-1)
    # half a step, and where the block's scale is below half precision's normal range
    # (2^-14: a largest weight under 0.002, as some of TQ2_0's random ones), 127 times
    # the scale's own rounding (half of 2^-24)
    assert (err <= want.abs().amax(-1) / 250 + 127 * 2.0 ** -25).all() and (err > 0).any()


def test_a_gguf_file_is_not_requantized(gguf_path):
    with pytest.raises(ValueError, match="served as it is: --quantization"):
        make_engine(resolve_model_dir(str(gguf_path)), quantization="int8")


def test_every_end_of_turn_token_of_a_gguf_file_ends_generation(tiny_llama3_dir, gguf_path,
                                                                tmp_path, caplog):
    """A file names one EOS; its other control tokens that end a turn (Llama 3's
    <|eom_id|> after a tool call, ChatML's <|endoftext|>) end generation too, when the
    file is served as it is. Its folder is made once, and says so."""
    path = gguf_from_hf(tiny_llama3_dir, tmp_path / "llama3.gguf", "llama")
    with caplog.at_level("INFO", logger="common.model_files"):
        folder = resolve_model_dir(str(path))
        assert resolve_model_dir(str(path)) == folder
    assert [r.getMessage() for r in caplog.records] == [
        f"reading llama3.gguf's tokenizer, chat template and config into {folder} (once)"]
    engine = make_engine(folder)
    assert engine.eos_token_ids == {50256, 50258}   # <|endoftext|>, <|eom_id|>
    eom = SamplingParams(max_tokens=6, temperature=0, logit_bias={50258: 100})
    assert engine.generate([[9, 8, 7]], eom) == [[50258]]
    # <|im_end|> (the file's EOS) and <|endoftext|>; not <|im_start|> nor the others
    assert make_engine(resolve_model_dir(str(gguf_path))).eos_token_ids == {2, 0}
    # The default model's folder is the checkpoint's, which ends at its EOS alone.
    out = tmp_path / "folder"
    out.mkdir()
    _convert_gguf(path, out)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50256


def test_end_of_turn_tokens_are_control_tokens_named_so():
    """By text, among control tokens (type 3) only: a plain token that reads
    <|im_end|> ends nothing; the ids the metadata names come first; a file without
    token types (or with too few) is read by text alone where it can be."""
    tokens = ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>"]
    fields = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 2,
              "tokenizer.ggml.eom_token_id": 3,
              "tokenizer.ggml.token_type": np.array([3, 1, 3, 3, 3])}
    assert end_of_generation_ids(fields) == [2, 3, 0, 4]
    assert end_of_generation_ids({**fields, "tokenizer.ggml.token_type": np.array([3, 3])}) \
        == [2, 3, 0, 1]
    assert end_of_generation_ids({"tokenizer.ggml.tokens": tokens}) == [0, 1, 2, 3, 4]


def test_a_llama_file_dequantized_into_a_folder_is_the_checkpoint_it_came_from(
        tiny_llama_dir, tmp_path):
    """The default model's materialization (_convert_gguf) on a tiny Llama written as
    llama.cpp writes it (F32; q and k rows in its RoPE order; an untied lm_head): every
    tensor of the checkpoint, under its name, exactly; the config as the checkpoint's."""
    from safetensors.torch import load_file

    out = tmp_path / "folder"
    out.mkdir()
    _convert_gguf(gguf_from_hf(tiny_llama_dir, tmp_path / "llama.gguf", "llama"), out)
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" in ours
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["dtype"]) == (["LlamaForCausalLM"], "float32")
    assert not (out / "gguf.json").exists()
