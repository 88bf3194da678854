"""The Triton paged-attention kernels against a float64 reference.

Without a GPU they run through Triton's interpreter (tests/conftest.py), in float32
and on small shapes; on a GPU the same cases run compiled, and the cases marked cuda
run in bfloat16 at real shapes (scripts/gpu-check)."""

from __future__ import annotations

import pytest
import torch

from engine_worker.gpu.attention import SplitBuffers, num_splits, paged_attention
from engine_worker.ops import FP8, from_value_blocks, to_value_blocks
from paged_cases import make_case, reference, rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 on both paths: the interpreter computes exactly, a GPU in ieee float32.
TOL = 1e-5


def run(case, splits: int = 1, window: int = 0, softcap: float = 0.0, sinks=None
        ) -> torch.Tensor:
    out = torch.full_like(case.q, float("nan"))  # poisoned: every row must be written
    buffers = None
    if splits > 1:
        buffers = SplitBuffers.allocate(case.num_decode, case.q.shape[1], case.q.shape[2],
                                        case.q.device)
    return paged_attention(case.q, case.k_cache, case.v_cache, out, case.block_tables,
                           case.seq_lens, case.query_start, case.num_decode, case.tile_seq,
                           case.tile_offset, case.scale, splits, buffers, window=window,
                           softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["gqa4to1", "mha1to1"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_rows_with_partial_last_blocks(heads, head_dim):
    # Contexts that end inside a block (1, 17, 40) and on its edge (32); one of three
    # passes of the kernel's keys (150: each rescales what the earlier ones summed).
    case = make_case([(1, 1), (17, 1), (40, 1), (32, 1), (150, 1)], *heads, head_dim,
                     device=DEVICE)
    assert rel_l2(run(case), reference(case)) < TOL


@pytest.mark.parametrize("splits", [2, 4])
def test_split_context_merges_to_the_same_result(splits):
    # One context shorter than a split's share: its other splits are empty.
    case = make_case([(150, 1), (70, 1), (3, 1)], 4, 2, 64, device=DEVICE, seed=1)
    assert rel_l2(run(case, splits), reference(case)) < TOL


@pytest.mark.parametrize("heads", [(4, 1), (2, 2)], ids=["gqa4to1", "mha1to1"])
def test_chunk_without_prefix_is_causal(heads):
    case = make_case([(37, 37)], *heads, 64, device=DEVICE, seed=2)
    assert rel_l2(run(case), reference(case)) < TOL


@pytest.mark.parametrize("head_dim", [64, 128])  # 128: 32 keys per iteration
def test_chunk_on_a_cached_prefix(head_dim):
    # 21 new tokens after a 48-token cached prefix; and a chunk of a single block.
    case = make_case([(69, 21), (16, 5)], 4, 1, head_dim, device=DEVICE, seed=3)
    assert rel_l2(run(case), reference(case)) < TOL


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_rows_mixed_with_chunks(splits):
    case = make_case([(33, 1), (5, 1), (90, 30), (20, 20), (7, 3)], 4, 2, 64, device=DEVICE,
                     seed=4)
    assert rel_l2(run(case, splits), reference(case)) < TOL


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [7, 40], ids=["window-7", "window-40"])
def test_a_sliding_window_sees_each_querys_last_keys(splits, window):
    """Decode rows past the window (its first key inside a block and a 64-key pass),
    one within it, chunks with and without a cached prefix whose rows' windows start
    at different keys; split decode rows share the keys from the window's pass on."""
    case = make_case([(150, 1), (33, 1), (5, 1), (90, 30), (37, 37), (7, 3)], 4, 2, 64,
                     device=DEVICE, seed=7)
    assert rel_l2(run(case, splits, window), reference(case, window)) < TOL
    assert rel_l2(reference(case, window), reference(case)) > 0.1   # the window matters


@pytest.mark.parametrize("splits", [1, 4])
def test_soft_capped_scores(splits):
    """Gemma 2's cap tanh(s / cap) on every score, decode rows (split or whole) and
    chunks alike, with a sliding window too; queries scaled up so that the cap of 2
    bites."""
    case = make_case([(150, 1), (33, 1), (90, 30), (37, 37)], 4, 2, 64, device=DEVICE,
                     seed=8)
    case.q.mul_(8.0)
    for window in (0, 40):
        want = reference(case, window, softcap=2.0)
        assert rel_l2(run(case, splits, window, softcap=2.0), want) < TOL
        assert rel_l2(want, reference(case, window)) > 0.1   # the cap matters


@pytest.mark.parametrize("splits", [1, 4])
def test_sink_logits(splits):
    """gpt-oss's sinks: each head's logit in every query's softmax, beside its scores
    (joined once a row's keys are summed, or where its splits merge), decode rows and
    chunks alike, with a sliding window too; one head's sink far above its scores
    (its output near 0), one far below (none of it)."""
    case = make_case([(150, 1), (33, 1), (90, 30), (37, 37), (0, 1)], 4, 2, 64,
                     device=DEVICE, seed=9)
    sinks = torch.tensor([0.5, 30.0, -30.0, -1.0], device=DEVICE)
    for window in (0, 40):
        want = reference(case, window, sinks=sinks)
        got = run(case, splits, window, sinks=sinks)
        assert rel_l2(got, want) < TOL
        assert rel_l2(want, reference(case, window)) > 0.1   # the sinks matter
        assert float(got[:, 1].abs().max()) < 1e-6
        assert torch.equal(got[-1].cpu(), torch.zeros_like(got[-1].cpu()))   # padded row


def test_padded_graph_rows_write_zeros_and_change_nothing_else():
    real = [(25, 1), (9, 1)]
    case = make_case(real + [(0, 1), (0, 1)], 4, 1, 64, device=DEVICE, seed=5)
    out = run(case, 2)
    assert torch.equal(out[2:].cpu(), torch.zeros_like(out[2:].cpu()))
    assert rel_l2(out[:2], reference(case)[:2]) < TOL


@pytest.mark.parametrize("splits", [1, 2])
def test_an_fp8_cache_is_read_widened_to_float16(splits):
    """--kv-cache-dtype fp8: keys and values are float8 e4m3 in the cache; the kernel
    widens them to float16 as it reads and runs the dots in float16, so it computes
    float32 attention over those rounded values (the reference reads the same fp8
    cache) but for the queries' and probabilities' float16 rounding (2^-11)."""
    case = make_case([(33, 1), (70, 1), (90, 70), (20, 20)], 4, 2, 128, device=DEVICE,
                     seed=6, cache_dtype=torch.float8_e4m3fn)
    assert case.k_cache.dtype == torch.float8_e4m3fn
    assert rel_l2(run(case, splits), reference(case)) < 1e-3
    # The values past a context are read unmasked (an fp8 cache holds no NaN, and
    # those keys' probabilities are 0): the largest finite value there changes nothing.
    outside = ~covered_slots(case)
    k, v = case.k_cache.float(), from_value_blocks(case.v_cache).float()
    k[outside], v[outside] = -448.0, 448.0
    case.k_cache, case.v_cache = k.to(FP8), to_value_blocks(v.to(FP8))
    assert outside.sum() > 0 and rel_l2(run(case, splits), reference(case)) < 1e-3


def covered_slots(case) -> torch.Tensor:
    """(num_blocks, page) bool: the cache slots some sequence's context holds."""
    page = case.k_cache.shape[1]
    covered = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool, device=case.k_cache.device)
    for s, ctx in enumerate(case.seq_lens.tolist()):
        for j in range(ctx):
            covered[case.block_tables[s, j // page], j % page] = True
    return covered


def test_splits_fill_the_gpu_only_when_the_batch_does_not():
    assert num_splits(1, 8, 132) == 16
    assert num_splits(16, 8, 132) == 4  # 128 programs, 512 with 4 splits
    assert num_splits(64, 8, 132) == 1
    assert num_splits(256, 8, 132) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (256, 1024)])
def test_bf16_decode_at_real_shapes(batch, ctx):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen).tolist()
    case = make_case([(n, 1) for n in lens], 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    splits = num_splits(batch, 8, torch.cuda.get_device_properties(0).multi_processor_count)
    assert rel_l2(run(case, splits), reference(case)) < 1e-2


@pytest.mark.cuda
def test_bf16_queries_on_an_fp8_cache_at_real_shapes():
    case = make_case([(n, 1) for n in (8192, 1000, 37)] + [(4096, 2048)], 32, 8, 128,
                     dtype=torch.bfloat16, device="cuda", cache_dtype=torch.float8_e4m3fn)
    assert rel_l2(run(case, 4), reference(case)) < 1e-2


@pytest.mark.cuda
def test_bf16_chunks_at_real_shapes():
    case = make_case([(4096, 1), (8192, 2048), (3000, 3000)], 32, 8, 128,
                     dtype=torch.bfloat16, device="cuda")
    assert rel_l2(run(case), reference(case)) < 1e-2
