"""Tensor parallelism in the model layer (engine_worker/models/layers/parallel.py): each
rank's part of every layer is the whole model's, cut where the scheme says, in every
weight format; and engines on two ranks (processes joined by gloo) generate the tokens
one engine does."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket

import numpy as np
import pytest
import torch
from torch import nn

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.errors import ModelLoadError
from engine_worker.engine import LLMEngine
from engine_worker.models.layers.embedding import VocabShard
from engine_worker.models.layers.linear import Linear
from engine_worker.models.layers.parallel import NOT_SPLIT, Parallel, Shard
from common.model_files import resolve_model_dir
from engine_worker.models.gguf import gguf_file
from engine_worker.models.loader import load_model
from engine_worker.models.registry import load_model_config
from engine_worker.platform import make_platform
from helpers import greedy, random_prompts

# (the torch path's dense weights, and the C kernels' packed formats)
FORMATS = [("torch", None), ("float32", None), ("bfloat16", None), ("int8", "int8"),
           ("q4", "q4")]


def load(model, parallel: Parallel, fmt: str, quantization) -> tuple[nn.Module, object]:
    """The model (a folder, or a GGUF file) as a rank's runner builds it, and its
    platform's kernels."""
    config = EngineConfig(model=str(model), device="cpu", cpu_kernels=fmt != "torch",
                          dtype="bfloat16" if fmt == "bfloat16" else "auto",
                          quantization=quantization)
    platform = make_platform(config)
    model_dir = resolve_model_dir(str(model))
    gguf = gguf_file(model_dir)
    cfg = load_model_config(model_dir)
    formats, dtype, _ = platform.formats(config, cfg, gguf)
    attn, ops = platform.attention(parallel.local(cfg), None, 4, 4)
    backends = dataclasses.replace(platform.backends(attn, ops, formats), parallel=parallel)
    return (load_model(cfg, model_dir, backends, torch.device("cpu"), dtype, gguf),
            platform.kernels)


def dense(layer: Linear, kernels) -> torch.Tensor:
    if layer.weight is not None:
        return layer.weight.float()
    return kernels.unpack(layer.packed, layer.out_features, layer.in_features, layer.fmt)


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_0"])
def tiny_llama_gguf(request, tiny_llama_dir, tmp_path_factory):
    from gguf_files import gguf_from_hf

    path = tmp_path_factory.mktemp("gguf") / f"tiny-llama.{request.param}.gguf"
    return gguf_from_hf(tiny_llama_dir, path, "llama", request.param)


@pytest.mark.parametrize("fmt, quantization", FORMATS, ids=[f for f, _ in FORMATS])
def test_each_ranks_shard_is_the_whole_models_cut_where_the_scheme_says(
        tiny_llama_dir, fmt, quantization):
    """Every linear layer: a rank's weight (unpacked) equals the whole model's, cut by
    its shard, exactly (a packed format's blocks run along the input, and the
    row-parallel layers are cut on block boundaries); biases too, and the rows of the
    vocabulary. The query heads' rows of the two ranks are the whole's, each once."""
    check_shards(tiny_llama_dir, fmt, quantization)


def test_a_gguf_files_blocks_are_cut_as_they_are(tiny_llama_gguf):
    """A GGUF file's tensors, cut by rows or on their blocks before they are packed:
    each rank's layers are the whole file's, cut (F32, Q8_0, Q4_0)."""
    check_shards(tiny_llama_gguf, "float32", None)


def test_a_k_quant_tensor_cut_inside_its_blocks_is_refused(tmp_path):
    """A row-parallel layer's inputs cut for two ranks: Q4_K's blocks of 256 inputs
    split where each rank's half is whole blocks (512 inputs), and are refused, naming
    the type and the cut, where each half is inside a block (256)."""
    from gguf import GGMLQuantizationType as T, GGUFWriter

    from engine_worker.cpu import build
    from engine_worker.models.gguf import GgufWeights

    w = GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_block_count(1)
    for name, blocks in (("blk.0.ffn_down.weight", 1), ("blk.1.ffn_down.weight", 2)):
        w.add_tensor(name, np.zeros((8, 144 * blocks), np.uint8), raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    weights = GgufWeights(tmp_path / "k.gguf", build.cpu_kernels())

    def pack(name: str, inputs: int, rank: int):
        cols = Parallel(rank, 2).split(inputs, "the MLP's intermediate features", unit=32)
        return weights.pack([name], inputs, shard=Shard(cols=cols), sizes=(8,))

    assert [pack("blk.1.ffn_down.weight", 512, r).in_features for r in range(2)] == [256, 256]
    for rank, cut in enumerate(("0-128", "128-256")):
        with pytest.raises(ModelLoadError, match=f"^k\\.gguf: a Q4_K tensor's blocks of 256 "
                                                 f"inputs do not split at input {cut} for "
                                                 f"this tensor-parallel rank; serve it over "
                                                 f"fewer ranks$"):
            pack("blk.0.ffn_down.weight", 256, rank)


def check_shards(model, fmt: str, quantization) -> None:
    whole, kernels = load(model, NOT_SPLIT, fmt, quantization)
    layers = {n: m for n, m in whole.named_modules() if isinstance(m, Linear)}
    q_rows = 0
    for rank in range(2):
        part, _ = load(model, Parallel(rank, 2), fmt, quantization)
        for name, layer in part.named_modules():
            if not isinstance(layer, Linear):
                continue
            full = layers[name]
            assert layer.shard is not None, name
            cut = layer.shard.take(dense(full, kernels), full.output_sizes)
            assert torch.equal(dense(layer, kernels), cut), (name, rank)
            if name.endswith("qkv_proj"):
                q_rows += layer.output_sizes[0]
        emb = part.embed_tokens
        assert isinstance(emb, VocabShard)
        assert torch.equal(emb.weight, whole.embed_tokens.weight[emb.shards["weight"][1]])
        # 4 query heads, 2 KV heads: 2 and 1 a rank; the MLP's 128 features, 64 a rank
        attn = part.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert part.layers[0].mlp.down_proj.in_features == 64
    assert q_rows == 2 * layers["layers.0.self_attn.qkv_proj"].output_sizes[0]


def test_heads_are_split_or_shared_and_impossible_splits_are_refused():
    assert Parallel(1, 2).heads(8, 4) == (slice(4, 8), slice(2, 4))
    # SmolLM2-135M's: whole KV heads with their query heads, as evenly as they go
    assert [Parallel(r, 2).heads(9, 3) for r in range(2)] == [
        (slice(0, 3), slice(0, 1)), (slice(3, 9), slice(1, 3))]
    # fewer KV heads than ranks: each rank holds the one its query heads read
    assert [Parallel(r, 4).heads(8, 2) for r in range(4)] == [
        (slice(0, 2), slice(0, 1)), (slice(2, 4), slice(0, 1)),
        (slice(4, 6), slice(1, 2)), (slice(6, 8), slice(1, 2))]
    for heads in ((6, 2), (12, 3)):
        with pytest.raises(ValueError, match=f"{heads[0]} query heads reading {heads[1]} KV "
                                             f"heads do not split over 4"):
            Parallel(0, 4).heads(*heads)
    # the MLP's features: in runs of whole 32-value blocks where they can be
    assert [Parallel(r, 2).split(1536 + 32, "f", unit=32) for r in range(2)] == [
        slice(0, 768), slice(768, 1568)]
    with pytest.raises(ValueError, match=r"the KV heads \(1\) are too few for 2"):
        Parallel(0, 2).split(1, "the KV heads")
    # the vocabulary: ceil(V / W) rows a rank, the last rank's fewer
    assert [Parallel(r, 2).vocab(50257) for r in range(2)] == [slice(0, 25129),
                                                               slice(25129, 50257)]


def test_models_that_do_not_split_are_refused(tiny_olmo2_dir, tiny_gpt2_dir):
    for model_dir in (tiny_olmo2_dir, tiny_gpt2_dir):
        with pytest.raises(ModelLoadError, match="is not split over tensor-parallel ranks"):
            load(model_dir, Parallel(0, 2), "torch", None)
    with pytest.raises(ValueError, match="needs torch.distributed's default group of 2"):
        LLMEngine(EngineConfig(model=str(tiny_olmo2_dir), device="cpu",
                               tensor_parallel_size=2, cache=CacheConfig(num_blocks=16)))


# -- engines on two ranks -------------------------------------------------------------

PROMPTS = random_prompts([5, 17, 9, 30], seed=21, vocab=49152)   # (every model's ids)
SHARED = random_prompts([12], seed=22, vocab=49152)[0]
PROMPTS += [SHARED + [7, 8], SHARED + [9, 10, 11]]   # (prefix-cache hits)


def engine_config(model_dir, size: int, cpu_kernels: bool, kv: str = "auto") -> EngineConfig:
    # a budget of 16 tokens: chunked prompts, and steps of prompt chunks and decodes
    return EngineConfig(model=str(model_dir), device="cpu", cpu_kernels=cpu_kernels,
                        num_threads=1, tensor_parallel_size=size,
                        attention_backend="auto" if cpu_kernels else "torch",
                        cache=CacheConfig(block_size=4, num_blocks=256, kv_cache_dtype=kv),
                        scheduler=SchedulerConfig(max_batch_size=8, max_num_batched_tokens=16))


def rank_main(rank: int, size: int, port: int, model_dir: str, cpu_kernels: bool, kv: str,
              results) -> None:
    """Rank 0 generates; the others follow its steps, as an engine's ranks do."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=size)
    try:
        engine = LLMEngine(engine_config(model_dir, size, cpu_kernels, kv))
        if rank == 0:
            results.put((rank, engine.generate(PROMPTS, greedy(8))))
            engine.runner.inputs.stop()
        else:
            engine.runner.follow()
            results.put((rank, "followed"))
    except BaseException as e:
        results.put((rank, repr(e)))
        raise
    finally:
        torch.distributed.destroy_process_group()


def on_ranks(model_dir, size: int, cpu_kernels: bool, kv: str = "auto") -> list:
    """Rank 0's generated tokens and the others' "followed" (a rank that failed: its
    error, in words)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, port, str(model_dir), cpu_kernels,
                                                 kv, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(size)]


@pytest.mark.parametrize("model, cpu_kernels, kv", [
    ("tiny_llama_dir", True, "auto"), ("tiny_llama_dir", False, "auto"),
    ("tiny_llama_dir", False, "fp8"), ("tiny_qwen3_moe_dir", True, "auto"),
    ("default_model_dir", True, "auto")])
def test_two_ranks_generate_the_tokens_one_engine_does(model, cpu_kernels, kv, request):
    """Greedy, float32: chunked prompts, mixed steps and prefix hits, on Llama (grouped
    KV heads, a vocabulary of odd size split unevenly), a mixture of experts (each
    expert split, the router whole) and the default model (its 3 KV heads split 1 and
    2, with 3 and 6 query heads), on the C kernels' packed weights and torch's; an fp8
    KV cache's scales set by the first step on every rank (torch's path reads fp8)."""
    model_dir = request.getfixturevalue(model)
    expected = LLMEngine(engine_config(model_dir, 1, cpu_kernels, kv)).generate(
        PROMPTS, greedy(8))
    assert on_ranks(model_dir, 2, cpu_kernels, kv) == [expected, "followed"]


def test_two_ranks_serve_a_gguf_file_as_one_engine_does(tiny_llama_dir, tmp_path):
    from gguf_files import gguf_from_hf

    path = gguf_from_hf(tiny_llama_dir, tmp_path / "tiny-llama.Q4_0.gguf", "llama", "Q4_0")
    expected = LLMEngine(engine_config(path, 1, True)).generate(PROMPTS, greedy(8))
    assert on_ranks(path, 2, True) == [expected, "followed"]
