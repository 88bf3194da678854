"""Serving a GGUF file as it is (engine_worker/gguf.py, common/model_files.py): the
default model's own file (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding),
whose weights must be exactly what the file's dequantization gives (the default model's
folder holds them so), served through the real processes
with the tokenizer and chat template from the file's metadata; and files the engine
must refuse, by name, at start."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
import torch
from safetensors import safe_open

from common.errors import ModelLoadError
from common.protocol import SamplingParams
from common.model_files import (_convert_gguf, _find_gguf, end_of_generation_ids,
                                materialize_default_model, resolve_model_dir)
from common.tokenizer import load_tokenizer
from engine_worker import kernels
from helpers import greedy, make_engine
from gguf_files import gguf_from_hf
from hf_reference import assert_matches, hf_greedy, hf_model, quantize_blocks
from processes import local_stack


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
    model, k = gguf_engine.runner.model, kernels.cpu_kernels()
    cfg = gguf_engine.model_config
    assert gguf_engine.runner.weight_format == "q4" and gguf_engine.runner.fused is not None
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

    from engine_worker.gguf import GgufWeights

    q8_k = np.zeros((64, 292), dtype=np.uint8)  # 64 rows of 256 Q8_K weights (activations')
    ok = np.zeros((64, 256), dtype=np.float32)
    write_gguf(tmp_path / "k.gguf", tensors=[("blk.0.attn_v.weight", q8_k, T.Q8_K),
                                             ("blk.0.attn_q.weight", ok, T.F32)])
    with pytest.raises(ModelLoadError, match=r"k\.gguf has tensors in types roseserve cannot "
                       r"serve as they are: blk\.0\.attn_v\.weight \(Q8_K\); it serves F32.*"
                       r"IQ4_NL and IQ4_XS as they are, and Q5_0, Q4_K.* re-stored"):
        GgufWeights(tmp_path / "k.gguf", kernels.cpu_kernels())
    write_gguf(tmp_path / "s.gguf", tensors=[("blk.0.attn_q.weight", ok, T.F32)],
               fields={"split.count": 3})
    with pytest.raises(ModelLoadError, match=r"s\.gguf is one of 3 parts of a split GGUF "
                       r"file; join them first \(llama.cpp's llama-gguf-split --merge"):
        GgufWeights(tmp_path / "s.gguf", kernels.cpu_kernels())
    write_gguf(tmp_path / "q.gguf", arch="gpt-oss", tensors=[("blk.0.attn_q.weight", ok, T.F32)])
    with pytest.raises(ModelLoadError, match=r"q\.gguf: roseserve serves GGUF files of the "
                       r"llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3 and "
                       r"phi3 architectures \(.*\), not 'gpt-oss'"):
        GgufWeights(tmp_path / "q.gguf", kernels.cpu_kernels())


def test_q_k_v_of_types_of_other_formats_become_one_int8_weight(tmp_path):
    """q Q4_0 (4-bit) beside k Q8_0 (int8): one weight of int8, Q4_0's values exactly
    (q - 8 are int8 values of its scale); a dense tensor beside a block one is refused."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.gguf import GgufWeights

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    tensors = [("blk.0.attn_q.weight", quants.quantize(w, T.Q4_0), T.Q4_0),
               ("blk.0.attn_k.weight", quants.quantize(w, T.Q8_0), T.Q8_0),
               ("blk.0.attn_v.weight", w, T.F32)]
    write_gguf(tmp_path / "mix.gguf", tensors=tensors)
    weights = GgufWeights(tmp_path / "mix.gguf", kernels.cpu_kernels())
    lin = weights.linear(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 64)
    assert lin.fmt == "int8"
    want = np.concatenate([quants.dequantize(a, t) for _, a, t in tensors[:2]])
    assert torch.equal(kernels.cpu_kernels().unpack(lin.packed, 128, 64, "int8"),
                       torch.from_numpy(want))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_k\.weight \(Q8_0\), "
                       r"blk\.0\.attn_v\.weight \(F32\) are computed as one weight and "
                       r"must all be dense or all in blocks"):
        weights.linear(["blk.0.attn_k.weight", "blk.0.attn_v.weight"], 64)


def test_one_weight_of_types_that_cannot_pack_together(tmp_path):
    """IQ4_NL rows that are not whole panels of 16 beside IQ4_XS ones cannot be packed
    apart: both become int8 (IQ4_NL's values exactly, IQ4_XS's requantized); BF16
    beside F32 is widened to one float32 weight; and IQ4_XS tensors need inputs in
    whole super-blocks of 256."""
    from gguf import GGMLQuantizationType as T, quants

    from engine_worker.gguf import GgufWeights

    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 24, 8, 18, (0,)), T.IQ4_NL),
               "blk.0.attn_k.weight": (random_blocks(rng, 16, 1, 136, (0,)), T.IQ4_XS),
               "blk.0.ffn_gate.weight": (w, T.F32),
               "blk.0.ffn_up.weight": (torch.from_numpy(w).bfloat16().view(torch.int16)
                                       .numpy(), T.BF16)}
    write_gguf(tmp_path / "m.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    weights = GgufWeights(tmp_path / "m.gguf", kernels.cpu_kernels())
    lin = weights.linear(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 256)
    assert (lin.fmt, lin.out_features) == ("int8", 40)
    got = kernels.cpu_kernels().unpack(lin.packed, 40, 256, "int8")
    nl, xs = (torch.from_numpy(quants.dequantize(*tensors[n])).view(-1, 256)
              for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    assert torch.equal(got[:24], nl)
    err = (got[24:] - xs).view(-1, 32).abs().amax(-1)
    assert (err <= xs.view(-1, 32).abs().amax(-1) / 250).all() and err.max() > 0
    dense = weights.linear(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], 256)
    assert (dense.fmt, dense.out_features) == ("float32", 32)
    assert torch.equal(kernels.cpu_kernels().unpack(dense.packed, 32, 256, "float32"),
                       torch.cat([torch.from_numpy(w),
                                  torch.from_numpy(w).bfloat16().float()]))
    with pytest.raises(ValueError, match="multiples of 256; a tensor has 288"):
        kernels.cpu_kernels().pack_gguf(torch.zeros(16, 136 + 17, dtype=torch.uint8), 23,
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

    from engine_worker import gguf as gguf_module
    from engine_worker.gguf import GgufWeights

    monkeypatch.setattr(gguf_module, "RESTORE_CHUNK_BYTES", 600)   # 3 Q5_0, 4 Q4_K rows

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 64, 8, 22, (0,)), T.Q5_0),
               "blk.0.attn_k.weight": (quants.quantize(w[:32], T.Q5_0), T.Q5_0),
               "blk.0.attn_v.weight": (quants.quantize(w[32:], T.Q8_0), T.Q8_0),
               "blk.0.ffn_gate.weight": (random_blocks(rng, 32, 1, 144, (0, 2)), T.Q4_K),
               "blk.0.ffn_up.weight": (random_blocks(rng, 16, 1, 144, (0, 2)), T.Q4_K)}
    write_gguf(tmp_path / "km.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    weights, k = GgufWeights(tmp_path / "km.gguf", kernels.cpu_kernels()), kernels.cpu_kernels()

    def dequantized(*names):
        return torch.from_numpy(np.concatenate(
            [quants.dequantize(*tensors[n]).reshape(len(tensors[n][0]), -1) for n in names]))

    def unpacked(lin):
        return k.unpack(lin.packed, lin.out_features, lin.in_features, lin.fmt)

    qkv = weights.linear(["blk.0.attn_q.weight", "blk.0.attn_k.weight",
                          "blk.0.attn_v.weight"], 256)
    assert (qkv.fmt, qkv.out_features) == ("int8", 128)
    assert torch.equal(unpacked(qkv), dequantized("blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                                  "blk.0.attn_v.weight"))
    gate_up = weights.linear(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"], 256)
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
    mixed = weights.linear(["blk.0.ffn_up.weight", "blk.0.attn_v.weight"], 256)
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

    from engine_worker.gguf import GgufWeights

    rng = np.random.default_rng(1)
    tensors = {"blk.0.attn_q.weight": (random_blocks(rng, 32, 8, 18, (0,)), T.IQ4_NL),
               "blk.0.attn_k.weight": (random_blocks(rng, 16, 1, 136, (0,)), T.IQ4_XS)}
    write_gguf(tmp_path / "iq4.gguf", tensors=[(n, a, t) for n, (a, t) in tensors.items()])
    lin = GgufWeights(tmp_path / "iq4.gguf", kernels.cpu_kernels()).linear(
        ["blk.0.attn_q.weight", "blk.0.attn_k.weight"], 256)
    assert (lin.fmt, lin.out_features) == ("iq4", 48)
    want = np.concatenate([quants.dequantize(*tensors[n]) for n in tensors])
    assert torch.equal(kernels.cpu_kernels().unpack(lin.packed, 48, 256, "iq4"),
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

    from engine_worker import gguf as gguf_module
    from engine_worker.gguf import GgufWeights

    t = GGMLQuantizationType[type_name]
    size, halves = REQUANTIZED[type_name]
    raw = random_blocks(np.random.default_rng(int(t)), 48, 256 // GGML_QUANT_SIZES[t][0],
                        size, halves)
    monkeypatch.setattr(gguf_module, "RESTORE_CHUNK_BYTES", 5 * raw.shape[1])
    write_gguf(tmp_path / "r.gguf", tensors=[("blk.0.ffn_down.weight", raw, t)])
    lin = GgufWeights(tmp_path / "r.gguf", kernels.cpu_kernels()).linear(
        ["blk.0.ffn_down.weight"], 256)
    assert lin.fmt == "int8"
    want = torch.from_numpy(quants.dequantize(raw, t)).view(-1, 32)
    got = kernels.cpu_kernels().unpack(lin.packed, 48, 256, "int8").view(-1, 32)
    err = (got - want).abs().amax(-1)
    # half a step, and where the block's scale is below half precision's normal range
    # (2^-14: a largest weight under 0.002, as some of TQ2_0's random ones), 127 times
    # the scale's own rounding (half of 2^-24)
    assert (err <= want.abs().amax(-1) / 250 + 127 * 2.0 ** -25).all() and (err > 0).any()


def test_a_gguf_file_is_not_requantized(gguf_path):
    with pytest.raises(ValueError, match="served as it is: --quantization"):
        make_engine(resolve_model_dir(str(gguf_path)), quantization="int8")


CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
            7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 1232,
            216, 34, 47, 2, 198, 1, 520, 9531, 198]


def test_a_gguf_file_served_through_the_real_processes(gguf_path, tmp_path):
    """Engine, tokenizer pool and frontend all given the file: a chat completion uses
    the chat template from its metadata, and the text is the engine's greedy tokens."""
    with local_stack(str(gguf_path), tmp_path) as front:
        models = requests.get(f"{front.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
        r = requests.post(f"{front.url}/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8
        choice = body["choices"][0]
        # the file's template: its system prompt, then <|im_start|>user\n ... and
        # <|im_start|>assistant\n
        assert choice["prompt_token_ids"] == CHAT_IDS
        assert choice["token_ids"] == \
            make_engine(resolve_model_dir(str(gguf_path))).generate([CHAT_IDS], greedy(8))[0]


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


@pytest.mark.parametrize("arch, model, name", [
    ("llama", "tiny_llama_dir", ""), ("qwen2", "tiny_qwen2_dir", ""),
    ("qwen3", "tiny_qwen3_dir", ""),
    ("llama", "tiny_llama_dir", "mistral")])   # which transformers makes a Mistral config
def test_a_file_as_llama_cpp_converts_a_checkpoint_serves_what_the_checkpoint_does(
        arch, model, name, request, tmp_path):
    """A tiny Llama, a tiny Qwen2 (q/k/v biases, tied embeddings) and a tiny Qwen3 (q and
    k norms, head_dim 32 with 4 heads of a 64-wide model) written as llama.cpp's
    converter writes them (q and k rows in its RoPE order for llama only): the same
    weights, biases and norms included, and the same greedy tokens as the checkpoint's
    engine."""
    model_dir = request.getfixturevalue(model)
    path = gguf_from_hf(model_dir, tmp_path / f"{arch}.gguf", arch, name=name)
    folder = resolve_model_dir(str(path))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == (name or arch)
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]]
    ours, theirs = make_engine(folder), make_engine(model_dir)
    k = kernels.cpu_kernels()
    for a, b in zip(ours.runner.model.layers, theirs.runner.model.layers):
        qkv_a, qkv_b = a.self_attn.qkv_proj, b.self_attn.qkv_proj
        assert torch.equal(k.unpack(qkv_a.packed, qkv_a.out_features, qkv_a.in_features, "float32"),
                           k.unpack(qkv_b.packed, qkv_b.out_features, qkv_b.in_features, "float32"))
        assert (qkv_a.bias is None) == (arch != "qwen2")
        if arch == "qwen2":
            assert torch.equal(qkv_a.bias, qkv_b.bias)
        if arch == "qwen3":
            assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight)
            assert torch.equal(a.self_attn.k_norm.weight, b.self_attn.k_norm.weight)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_qwen3moe_file_serves_its_experts_as_they_are(tiny_qwen3_30b_a3b_dir, tmp_path):
    """llama.cpp's qwen3moe (Qwen3-30B-A3B): each layer's experts in three tensors of all
    of them (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router ffn_gate_inp F32.
    Each expert is read as its rows: an F32 file gives the checkpoint's tokens; a Q8_0
    file's experts are int8 weights equal to the file's own dequantization of their
    rows, and its router stays float32."""
    from gguf import quants

    from common.gguf_reader import GgufReader

    f32 = gguf_from_hf(tiny_qwen3_30b_a3b_dir, tmp_path / "moe.f32.gguf", "qwen3moe")
    folder = resolve_model_dir(str(f32))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["moe_intermediate_size"], config["norm_topk_prob"]) == (32, True)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert make_engine(folder).generate(prompts, greedy(12)) == \
        make_engine(tiny_qwen3_30b_a3b_dir).generate(prompts, greedy(12))

    q8 = gguf_from_hf(tiny_qwen3_30b_a3b_dir, tmp_path / "moe.q8_0.gguf", "qwen3moe", "Q8_0")
    engine = make_engine(resolve_model_dir(str(q8)))
    tensors = {t.name: t for t in GgufReader(q8).tensors}
    k = kernels.cpu_kernels()

    def rows(name: str, expert: int) -> torch.Tensor:
        t = tensors[name]
        values = quants.dequantize(t.data, t.ggml_type).reshape(t.shape[::-1])[expert]
        return torch.from_numpy(np.array(values, dtype=np.float32))

    for i, layer in enumerate(engine.runner.model.layers):
        moe = layer.mlp
        assert moe.gate.fmt == "float32" and len(moe.experts) == 8
        for e, expert in enumerate(moe.experts):
            gate_up, down = expert.gate_up_proj, expert.down_proj
            assert (gate_up.fmt, down.fmt) == ("int8", "int8")
            assert torch.equal(k.unpack(gate_up.packed, 64, 64, "int8"), torch.cat([
                rows(f"blk.{i}.ffn_gate_exps.weight", e),
                rows(f"blk.{i}.ffn_up_exps.weight", e)]))
            assert torch.equal(k.unpack(down.packed, 64, 32, "int8"),
                               rows(f"blk.{i}.ffn_down_exps.weight", e))
    assert len(engine.generate(prompts, greedy(12))[1]) == 12


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("rope, arch, model_fixture", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64},   # long wavelengths at head_dim 16: scaled
     "llama", "tiny_llama_dir"),
    ({"rope_type": "linear", "factor": 4.0}, "llama", "tiny_llama_dir"),
    (YARN, "llama", "tiny_llama_dir"), (YARN, "qwen3moe", "tiny_qwen3_30b_a3b_dir")],
    ids=["llama3", "linear", "yarn", "yarn-qwen3moe"])
def test_a_files_rope_scaling_is_served_as_the_checkpoints(rope, arch, model_fixture, request,
                                                           tmp_path):
    """llama.cpp's converter stores Llama 3.1's RoPE scaling (Llama 3.2, 3.3) as a
    tensor of factors, rope_freqs.weight, and a linear one and YaRN (Qwen's long
    contexts) in the metadata; none reaches the config transformers reads from the file
    (they were left out: another frequency for most dimensions, at every position). A
    qwen3moe file's was looked up under transformers' name for it, qwen3_moe, and not
    found."""
    import shutil

    source = request.getfixturevalue(model_fixture)
    model = tmp_path / "scaled"
    shutil.copytree(source, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    path = gguf_from_hf(model, tmp_path / "scaled.gguf", arch)
    ours, theirs = make_engine(resolve_model_dir(str(path))), make_engine(model)
    inv_freq = theirs.runner.model.rotary.inv_freq
    plain = make_engine(source).runner.model.rotary.inv_freq
    assert not torch.allclose(inv_freq, plain)   # the scaling changes the frequencies
    torch.testing.assert_close(ours.runner.model.rotary.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.runner.model.rotary.scale == theirs.runner.model.rotary.scale
    assert ours.model_config.max_model_len == theirs.model_config.max_model_len
    prompts = [[1, 2, 3, 4], list(range(100, 180))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_rope_scaling_not_served_is_refused_by_name(tiny_llama_dir, tmp_path):
    import shutil

    # Phi-3's LongRoPE picks its frequencies by the sequence's length
    model = tmp_path / "longrope"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    path = gguf_from_hf(model, tmp_path / "longrope.gguf", "llama")
    with pytest.raises(ModelLoadError, match="longrope.gguf: unsupported rope scaling "
                                             "'longrope'; supported: linear, yarn"):
        make_engine(resolve_model_dir(str(path)))


def test_a_yarn_file_with_fields_not_served_is_refused_by_name(tiny_llama_dir, tmp_path):
    """A YaRN file that sets its own attention factor: refused, not served with the
    factor the scaling implies."""
    from common.model_files import _yarn_parameters

    fields = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 256,
              "llama.rope.scaling.yarn_beta_fast": 16.0}
    assert _yarn_parameters("f.gguf", fields, "llama") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 16.0}
    with pytest.raises(ModelLoadError, match="f.gguf: YaRN scaling with attn_factor, "
                                             "yarn_log_multiplier is not served"):
        _yarn_parameters("f.gguf", {**fields, "llama.rope.scaling.attn_factor": 1.2,
                                    "llama.rope.scaling.yarn_log_multiplier": 0.1}, "llama")


def test_a_gemma3_file_serves_what_its_checkpoint_does(tiny_gemma3_six_dir, tmp_path):
    """llama.cpp's gemma3 (Gemma 3 270M to 27B, the language model): four norms a layer,
    stored as the 1 + weight they scale by; q and k normed per head; five sliding layers
    of six with a RoPE of their own, the full one's linearly scaled by the file's
    rope.scaling; tied embeddings scaled by sqrt(hidden); no query scale in the
    metadata (head_dim's, as llama.cpp takes it). An F32 file gives Hugging Face's
    greedy tokens for the checkpoint, past the window of 9; a Q8_0 file's matrices are
    int8 weights, its norms the file's."""
    from gguf import GGMLQuantizationType as T

    from common.gguf_reader import GgufReader

    f32 = gguf_from_hf(tiny_gemma3_six_dir, tmp_path / "gemma3.f32.gguf", "gemma3")
    folder = resolve_model_dir(str(f32))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (16, 9)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_gemma3_six_dir, prompts, 12), "gemma3 gguf")

    q8 = gguf_from_hf(tiny_gemma3_six_dir, tmp_path / "gemma3.q8_0.gguf", "gemma3", "Q8_0")
    model = make_engine(resolve_model_dir(str(q8))).runner.model
    tensors = {t.name: t for t in GgufReader(q8).tensors}
    assert tensors["blk.0.attn_q.weight"].ggml_type == T.Q8_0
    for i, layer in enumerate(model.layers):
        assert (layer.self_attn.qkv_proj.fmt, layer.mlp.down_proj.fmt) == ("int8", "int8")
        for norm, name in ((layer.input_layernorm, "attn_norm"),
                           (layer.attn_out_norm, "post_attention_norm"),
                           (layer.post_attention_layernorm, "ffn_norm"),
                           (layer.mlp_out_norm, "post_ffw_norm")):
            stored = np.array(tensors[f"blk.{i}.{name}.weight"].data).view(np.float32)
            assert torch.equal(norm.weight, torch.from_numpy(stored.reshape(-1))), name


@pytest.mark.parametrize("model_fixture", ["tiny_phi3_dir", "tiny_phi4_mini_dir"])
def test_a_phi3_file_serves_what_its_checkpoint_does(model_fixture, request, tmp_path):
    """llama.cpp's phi3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): q/k/v and gate/up stored
    fused, as in the checkpoints; the sliding window (Phi-3-mini-4k's); LongRoPE's
    factors, tensors of their own, with the original context; RoPE over 3/4 of each
    head (Phi-4-mini's: q's and k's rows reordered at load as from a checkpoint). The
    engine serving the file gives the checkpoint's greedy tokens (a prompt of 70
    tokens, past LongRoPE's original 64)."""
    model_dir = request.getfixturevalue(model_fixture)
    path = gguf_from_hf(model_dir, tmp_path / "phi3.gguf", "phi3")
    folder = resolve_model_dir(str(path))
    ours, theirs = make_engine(folder), make_engine(model_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"]
    for field in ("windows", "rotary_dim", "max_model_len", "tie_word_embeddings"):
        assert getattr(ours.model_config, field) == getattr(theirs.model_config, field), field
    # LongRoPE's factors and attention factor as the file holds them: float32
    mine, checkpoint = ours.model_config.rope, theirs.model_config.rope
    assert (mine.kind, mine.theta) == (checkpoint.kind, checkpoint.theta)
    assert mine.ext_factors == pytest.approx(checkpoint.ext_factors, rel=1e-7)
    assert mine.attention_factor == pytest.approx(checkpoint.attention_factor, rel=1e-7)
    if model_fixture == "tiny_phi3_dir":
        assert set(ours.model_config.windows) == {255}
    else:
        assert ours.model_config.rope.kind == "longrope" and ours.model_config.rotary_dim == 12
    prompts = [[1, 2, 3, 4], list(range(100, 170))]
    assert ours.generate(prompts, greedy(12)) == theirs.generate(prompts, greedy(12))


def test_a_gemma2_file_serves_what_its_checkpoint_does(tiny_gemma2_dir, tmp_path):
    """llama.cpp's gemma2 (Gemma 2 2B, 9B, 27B): Gemma 3's norms and scales without its q
    and k norms, every other layer sliding, and the soft caps of the scores and the
    logits, which its metadata holds: an F32 file gives Hugging Face's greedy tokens."""
    path = gguf_from_hf(tiny_gemma2_dir, tmp_path / "gemma2.gguf", "gemma2")
    folder = resolve_model_dir(str(path))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (1.5, 2.5)
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (16, 9)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_gemma2_dir, prompts, 12), "gemma2 gguf")


def test_what_a_gemma_files_metadata_leaves_out_is_read_as_llama_cpp_reads_it():
    """The 27B models' query scale is hidden / heads, not head_dim (Gemma 3's 62 layers:
    168, not 128; Gemma 2's 46: 144); a file without a sliding window has none; a final
    logit soft cap in a gemma3 file is carried to the config, where it is refused."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from common.model_files import _gemma_reading
    from engine_worker.model_config import _gemma

    big = Gemma3TextConfig(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32,
                           head_dim=128, sliding_window=1024)
    _gemma_reading(big, {"gemma3.attention.sliding_window": 1024}, "gemma3")
    assert (big.query_pre_attn_scalar, big.sliding_window) == (168, 1024)
    big2 = Gemma2Config(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32,
                        head_dim=128)
    _gemma_reading(big2, {"gemma2.attention.sliding_window": 4096}, "gemma2")
    assert big2.query_pre_attn_scalar == 144
    small = Gemma3TextConfig(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4,
                             head_dim=256, sliding_window=512)
    _gemma_reading(small, {"gemma3.final_logit_softcapping": 30.0}, "gemma3")
    assert (small.query_pre_attn_scalar, small.sliding_window) == (256, None)
    with pytest.raises(ModelLoadError, match="final_logit_softcapping is not supported for "
                                             "Gemma 3"):
        _gemma(small.to_dict(), "gemma3", 256, 256, None)


def test_a_mixtral_file_serves_what_its_checkpoint_does(tiny_mixtral_dir, tmp_path):
    """llama.cpp stores Mixtral as llama with experts: q and k rows in its RoPE order,
    each layer's experts in three tensors of all of them, the router F32. Its folder's
    config is Mixtral's, and it gives the checkpoint's greedy tokens."""
    path = gguf_from_hf(tiny_mixtral_dir, tmp_path / "mixtral.gguf", "llama")
    folder = resolve_model_dir(str(path))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    engine = make_engine(folder)
    assert all(len(layer.mlp.experts) == 4 for layer in engine.runner.model.layers)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(engine.generate(prompts, greedy(12)),
                   hf_greedy(tiny_mixtral_dir, prompts, 12), "mixtral gguf")


def test_a_qwen2moe_file_serves_what_its_checkpoint_does(tiny_qwen2_moe_dir, tmp_path):
    """llama.cpp's qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, the experts
    in tensors of all of them, the shared expert and its sigmoid gate in tensors of
    their own, the experts' weights not renormalized: an F32 file gives Hugging Face's
    greedy tokens; a Q8_0 one packs the shared expert as int8, its gate float32."""
    path = gguf_from_hf(tiny_qwen2_moe_dir, tmp_path / "qwen2moe.gguf", "qwen2moe")
    folder = resolve_model_dir(str(path))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"],
            config["norm_topk_prob"]) == (32, 48, False)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    assert_matches(make_engine(folder).generate(prompts, greedy(12)),
                   hf_greedy(tiny_qwen2_moe_dir, prompts, 12), "qwen2moe gguf")
    q8 = gguf_from_hf(tiny_qwen2_moe_dir, tmp_path / "qwen2moe.q8.gguf", "qwen2moe", "Q8_0")
    moe = make_engine(resolve_model_dir(str(q8))).runner.model.layers[0].mlp
    assert (moe.shared_expert.gate_up_proj.fmt, moe.shared_expert_gate.fmt,
            moe.gate.fmt) == ("int8", "float32", "float32")


def test_a_mixture_stored_an_expert_a_tensor_is_refused_by_name(tmp_path):
    """llama.cpp's first Mixtral files stored each expert's projections as tensors of
    their own (blk.N.ffn_gate.E.weight): refused as such, saying what to do, not as a
    file that lacks blk.0.ffn_gate_exps.weight."""
    from gguf import GGUFWriter

    from engine_worker.gguf import GgufWeights

    path = tmp_path / "mixtral.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mixtral.gguf is a mixture of experts \(8 "
                                             r"experts a layer\) that stores each expert as "
                                             r"tensors of its own .* convert its checkpoint "
                                             r"again"):
        GgufWeights(path, kernels.cpu_kernels())


def test_a_qwen2_file_with_q8_0_blocks_serves_through_the_real_processes(tiny_qwen2_dir,
                                                                         tmp_path):
    """Its matrices as Q8_0 (the int8 format, as they are), its biases and norms F32, the
    tokenizer and chat template from its metadata: a chat through HTTP gives the tokens
    the engine gives in process."""
    path = gguf_from_hf(tiny_qwen2_dir, tmp_path / "qwen2.q8_0.gguf", "qwen2", "Q8_0")
    folder = resolve_model_dir(str(path))
    engine = make_engine(folder)
    assert engine.runner.weight_format == "int8"
    assert engine.runner.model.layers[0].self_attn.qkv_proj.fmt == "int8"
    with local_stack(str(path), tmp_path) as front:
        r = requests.post(f"{front.url}/v1/chat/completions", json={
            "model": "qwen2.q8_0", "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    # the tiny models' template: <|user|>\nHi there\n<|assistant|>\n, GPT-2's BPE
    prompt = choice["prompt_token_ids"]
    assert prompt == load_tokenizer(tiny_qwen2_dir).encode("<|user|>\nHi there\n<|assistant|>\n")
    assert choice["token_ids"] == engine.generate([prompt], greedy(8))[0]
