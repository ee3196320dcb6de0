"""Same-architecture drafters (llama, qwen2, qwen3) through the runtime's own model code at TP=1.

The runtime's decoder (static KV cache, fused projections, PyTorch's fused CPU attention) runs
a drafter step with far less per-layer overhead than transformers, which matters for a
drafter that must cost a small fraction of a target step. Chains use the model's own forward;
tree forwards (SLRS) append the tree's nodes, each attending to the cache before the tree, its
ancestors and itself.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.drafters.model import TreeState

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def quantize_nvfp4(model) -> None:
    """Replace the drafter's projection and head weights by NVFP4 (weight-only, W4A16) in place.

    A drafter step reads every weight once; 4-bit weights read a quarter of bf16's bytes
    through the runtime's NVFP4 kernel. Drafts get a little worse (fewer accepted), never wrong.
    """
    from hetero_run.runtime.weights import NVFP4Weight

    for layer in model.layers:
        for linear in (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up, layer.mlp.down):
            linear.weight = NVFP4Weight.quantize(linear.weight.dequantize(torch.float32), activation="w4a16")
    model.lm_head.weight = NVFP4Weight.quantize(model.lm_head.weight.dequantize(torch.float32), activation="w4a16")


class FastDraftModel:
    def __init__(self, model):
        self.model = model  # runtime.models TargetModel at TP size 1
        self.vocab_size = model.config.vocab_size
        self.tree: TreeState | None = None

    @property
    def length(self) -> int:
        return self.model.length

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        return rows  # the head runs whole; its rows are picked afterwards

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None,
                head: torch.Tensor | None = None) -> torch.Tensor:
        if parents is None:
            if self.tree is not None:
                raise ValueError("a chain forward inside an open tree: truncate first")
            start = self.model.length
            logits = self.model.forward(ids, torch.arange(start, start + ids.numel()))
        else:
            logits = self._tree_forward(ids, parents)
        return logits if head is None else logits.index_select(-1, head)

    def _tree_forward(self, ids: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        sequence = self.model.sequence
        if self.tree is None:
            self.tree = TreeState(sequence.length)
        tree, first = self.tree, len(self.tree.parents)
        positions, _ = tree.add(parents.tolist())
        n = ids.numel()
        paths = [[tree.base + j for j in range(i + 1) if tree.ancestors[i] >> j & 1] for i in range(first, first + n)]
        offsets = torch.tensor([0] + [len(p) for p in paths]).cumsum(0)
        extras = torch.tensor([x for p in paths for x in p], dtype=torch.long)
        return sequence.append(ids, positions, torch.full((n,), tree.base, dtype=torch.long), torch.arange(n),
                               offsets, extras)

    def truncate(self, length: int) -> None:
        self.model.truncate(length)
        self.tree = None
