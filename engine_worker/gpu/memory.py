"""How much of the GPU the KV cache gets.

Model. The engine may use ``gpu_memory_utilization`` of the device's total memory
(what other processes hold counts against it). From that come off, in order: what the
process held before loading (the CUDA context, libraries), the weights, the peak of
one forward pass at the step's token budget together with the sampler at the full
decode batch (measured by running them, so nothing is guessed), and as much again as
the decode batch's peak for the CUDA graphs' private memory pool. The KV cache gets
the rest, in whole blocks. ``--kv-cache-memory`` skips the arithmetic and gives the
cache exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # device memory, bytes
    used_by_others: int  # held by other processes and the CUDA context when we start
    weights: int
    activation_peak: int  # one forward at the token budget, sampler at the decode batch
    graph_pool: int  # reserved for CUDA graphs (0 when eager)

    def kv_cache_bytes(self, utilization: float) -> int:
        """The KV cache's share; raises ValueError when nothing is left for it."""
        budget = int(self.total * utilization)
        left = budget - self.used_by_others - self.weights - self.activation_peak - self.graph_pool
        if left <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {utilization:.0%} of "
                f"{_gib(self.total)} is {_gib(budget)}, and {self.describe()} take "
                f"{_gib(budget - left)}; raise --gpu-memory-utilization, lower "
                f"--max-num-batched-tokens or --max-batch-size, or use a smaller model")
        return left

    def describe(self) -> str:
        return (f"other processes and the CUDA context {_gib(self.used_by_others)}, weights "
                f"{_gib(self.weights)}, activations {_gib(self.activation_peak)}, CUDA "
                f"graphs {_gib(self.graph_pool)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
