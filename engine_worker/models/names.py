"""Where a checkpoint or a GGUF file keeps each of our weights.

Our modules' paths ("layers.3.self_attn.qkv_proj") are mapped by rules over paths with
"*" for each index ("layers.*.self_attn.qkv_proj"): a rule names a prefix of the path,
and the longest rule that matches wins; the rest of the path follows the rule's target
unchanged. A target is one name or one per part of a fused layer (q, k and v). A path
no rule names is the same in the checkpoint, but for a fused layer's last component,
which is split into its parts' names (``SPLIT``: Hugging Face's Llama names). A family
gives only the rules where its checkpoints differ (models/spec.py: Architecture.names).
"""

from __future__ import annotations

from engine_worker.models.spec import Names

# Our fused layers' parts, as Hugging Face's Llama-style checkpoints name them
SPLIT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class TensorNames:
    def __init__(self, rules: Names, split: dict[str, tuple[str, ...]]) -> None:
        self.rules = {key: (value,) if isinstance(value, str) else tuple(value)
                      for key, value in rules.items()}
        self.split = split

    def __call__(self, path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(the names of ``path``'s tensors, without .weight or .bias; the indices of
        its path a target has no "*" for, in order: an expert of a file's tensor that
        holds every expert)."""
        parts = path.split(".")
        wild = ["*" if p.isdigit() else p for p in parts]
        for k in range(len(parts), 0, -1):
            targets = self.rules.get(".".join(wild[:k]))
            if targets is None:
                continue
            indices = [int(p) for p in parts[:k] if p.isdigit()]
            used = targets[0].count("*")
            rest = parts[k:]
            names = tuple(_fill(t, indices[:used]) for t in targets)
            if rest:   # (a rule for the whole path names it whole)
                names = self._split(names[0] + "." + ".".join(rest))
            return names, tuple(indices[used:])
        return self._split(path), ()

    def _split(self, name: str) -> tuple[str, ...]:
        head, _, last = name.rpartition(".")
        if last not in self.split:
            return (name,)
        return tuple(f"{head}.{part}" if head else part for part in self.split[last])


def _fill(pattern: str, indices: list[int]) -> str:
    for index in indices:
        pattern = pattern.replace("*", str(index), 1)
    return pattern
