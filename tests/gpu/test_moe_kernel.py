"""The grouped experts of a mixture (engine_worker/gpu/moe.py): the rows sorted by
expert on the device, and the grouped GEMM against each expert run alone."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from engine_worker.gpu.moe import GroupedExperts, expert_tiling, sort_rows
from engine_worker.gpu.ops import TritonOps
from engine_worker.ops import TorchOps, clamped_swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rows_are_grouped_by_expert_and_padded_to_whole_tiles():
    """Rows are (token, choice) pairs in order: token 0's are rows 0 and 1. Expert 1 and
    4 get none and no tile; expert 2's three rows keep their order; padding is the row
    count (6), and the tiles past the last expert's are -1."""
    chosen = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    rows, tile_expert = sort_rows(chosen, num_experts=5, block_m=4)
    pad = 6
    # ceil(6 / 4) + min(6, 5) tiles: the most any routing of 6 rows can need
    assert tile_expert.tolist() == [0, 2, 3, -1, -1, -1, -1]
    assert rows.tolist() == ([1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
                             + [pad] * 16)


def test_an_expert_with_more_rows_than_a_tile_takes_several():
    chosen = torch.tensor([[1]] * 5 + [[0]], device=DEVICE)
    rows, tile_expert = sort_rows(chosen, num_experts=2, block_m=2)
    assert tile_expert.tolist()[:4] == [0, 1, 1, 1] and set(tile_expert.tolist()[4:]) == {-1}
    assert rows.tolist()[:8] == [5, 6, 0, 1, 2, 3, 4, 6]


class _Expert(nn.Module):
    def __init__(self, c: int, i: int, seed: int, act, bias: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Linear(c, 2 * i, bias=bias)
        self.down_proj = nn.Linear(i, c, bias=bias)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.randn(2 * i, c, generator=g) / c ** 0.5)
            self.down_proj.weight.copy_(torch.randn(c, i, generator=g) / i ** 0.5)
            if bias:
                self.gate_up_proj.bias.copy_(torch.randn(2 * i, generator=g))
                self.down_proj.bias.copy_(torch.randn(c, generator=g))
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _mixture(tokens: int, experts: int, top_k: int, c: int = 48, i: int = 40,
             crowd: bool = False, act=TritonOps().silu_mul, bias: bool = False):
    """Experts, inputs and a routing (``crowd``: every token's first choice expert 3)."""
    g = torch.Generator().manual_seed(tokens)
    mlps = nn.ModuleList(_Expert(c, i, seed, act, bias) for seed in range(experts))
    x = torch.randn(tokens, c, generator=g)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k]
                          for _ in range(tokens)])
    if crowd:
        chosen[:, 1] = torch.where(chosen[:, 0] == 3, chosen[:, 1], chosen[:, 0])
        chosen[:, 0] = 3
    weights = torch.rand(tokens, top_k, generator=g)
    return mlps.to(DEVICE), x.to(DEVICE), weights.to(DEVICE), chosen.to(DEVICE)


CLAMPED = functools.partial(TritonOps().clamped_swiglu, alpha=1.702, limit=0.8)


@pytest.mark.parametrize("tokens,crowd,gpt_oss", [
    (3, False, False), (70, False, False), (70, True, False), (3, False, True),
    (70, True, True)], ids=["decode-tiles", "prompt-tiles", "one-expert-many-tiles",
                            "gpt-oss-decode", "gpt-oss-prompt"])
def test_grouped_experts_match_each_expert_run_alone(tokens, crowd, gpt_oss):
    """Tiles of 16 rows (3 tokens, 8 experts) and of 64 (70 tokens), and an expert every
    token chose (70 rows: two tiles); gpt-oss's experts: biases (down's added before
    the routing weight) and the clamped SwiGLU (Triton's, the limit reached), against
    the torch reference of each."""
    mlps, x, weights, chosen = _mixture(tokens, experts=8, top_k=2, crowd=crowd,
                                        act=CLAMPED if gpt_oss else TritonOps().silu_mul,
                                        bias=gpt_oss)
    assert expert_tiling(tokens, 8).block_m == (16 if tokens <= 8 else 64)
    with torch.no_grad():
        got = GroupedExperts(mlps)(x, weights, chosen)
        for mlp in mlps:   # the reference: torch's ops
            mlp.act = (functools.partial(clamped_swiglu, alpha=1.702, limit=0.8) if gpt_oss
                       else TorchOps().silu_mul)
        want = torch.stack([sum(weights[n, j] * mlps[int(chosen[n, j])](x[n:n + 1])[0]
                                for j in range(2)) for n in range(tokens)])
        gate_up = mlps[0].gate_up_proj(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert float(gate_up.abs().max()) > 2 * 0.8   # gpt-oss's clamp bites


@pytest.mark.skipif(DEVICE != "cuda", reason="captures a CUDA graph")
def test_grouped_experts_replay_from_a_cuda_graph_under_another_routing():
    """Nothing in the routing waits for the host: captured once, a replay with other
    tokens routed elsewhere gives what an eager run gives (in bfloat16, at a real
    mixture's width: 128 experts, 8 a token)."""
    mlps, x, weights, chosen = _mixture(16, experts=128, top_k=8, c=256, i=128)
    grouped = GroupedExperts(mlps.to(torch.bfloat16))
    x, weights = x.to(torch.bfloat16), weights
    static = [x.clone(), weights.clone(), chosen.clone()]
    with torch.no_grad():
        grouped(*static)   # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped(*static)
        _, x2, weights2, chosen2 = _mixture(16, experts=128, top_k=8, c=256, i=128,
                                            crowd=True)
        for tensor, new in zip(static, (x2.to(torch.bfloat16), weights2, chosen2)):
            tensor.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, grouped(x2.to(torch.bfloat16), weights2, chosen2),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [3, 70], ids=["decode-tiles", "prompt-tiles"])
def test_mxfp4_experts_compute_as_their_dequantized_weights(tokens):
    """gpt-oss's experts kept MXFP4 (bytes and a scale byte a 32 inputs, as its
    checkpoints hold them): the grouped GEMM decodes them in the kernel, each input's
    nibble by its place (even inputs low, odd high); against the same experts
    dequantized (engine_worker.models.checkpoint.mxfp4_to_float) as dense weights. 96 inputs to
    down: a pass of 64 and a pass of 32, half masked."""
    from engine_worker.gpu.moe import GroupedExperts
    from engine_worker.models.checkpoint import mxfp4_to_float

    c, i, e = 64, 96, 4
    mlps, x, weights, chosen = _mixture(tokens, experts=e, top_k=2, c=c, i=i, act=CLAMPED,
                                        bias=True)
    g = torch.Generator().manual_seed(1)
    grouped = GroupedExperts.mxfp4(e, c, i, CLAMPED, bias=True)
    with torch.no_grad():
        for name, (rows, cols) in (("gate_up", (2 * i, c)), ("down", (c, i))):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8,
                                   generator=g)
            scales = torch.randint(122, 129, (e, rows, cols // 32), dtype=torch.uint8,
                                   generator=g)
            getattr(grouped, name).copy_(blocks.reshape(e, rows, cols // 2))
            getattr(grouped, name + "_scales").copy_(scales)
            getattr(grouped, name + "_bias").copy_(torch.randn(e, rows, generator=g))
            dense = mxfp4_to_float(blocks, scales)
            for k, mlp in enumerate(mlps):
                proj = mlp.gate_up_proj if name == "gate_up" else mlp.down_proj
                proj.weight.copy_(dense[k])
                proj.bias.copy_(getattr(grouped, name + "_bias")[k])
        grouped = grouped.to(DEVICE)
        got = grouped(x, weights, chosen)
        want = GroupedExperts(mlps)(x, weights, chosen)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [3, 70], ids=["decode-tiles", "prompt-tiles"])
def test_fp8_experts_compute_as_their_dequantized_weights(tokens):
    """--quantization fp8 in a mixture: its experts' e4m3 weights (a scale per output
    channel) stacked and widened in the grouped GEMM, each column scaled after its sums;
    against the same weights dequantized, dense. 96 inputs to down: a pass of 64 and a
    masked one of 32."""
    import copy

    from engine_worker.models.layers.fp8 import quantize_rows

    mlps, x, weights, chosen = _mixture(tokens, experts=4, top_k=2, c=64, i=96)
    fp8 = copy.deepcopy(mlps)
    with torch.no_grad():
        for dense, quantized in zip(mlps, fp8):
            for name in ("gate_up_proj", "down_proj"):
                q, scale = quantize_rows(getattr(dense, name).weight)
                proj = getattr(quantized, name)
                proj.weight = nn.Parameter(q, requires_grad=False)
                proj.weight_scale = scale.view(-1)
                getattr(dense, name).weight.copy_(q.float() * scale)
        grouped = GroupedExperts(fp8)
        assert grouped.gate_up.dtype == torch.float8_e4m3fn
        assert grouped.down_scales.shape == (4, 64)
        got = grouped(x, weights, chosen)
        want = GroupedExperts(mlps)(x, weights, chosen)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
