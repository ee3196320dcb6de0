"""Same-architecture drafters (llama, qwen2, qwen3): one sequence slot of the fast drafter network.

`FastDraftModel` is the single-sequence protocol of `drafters.model` (chains, trees for SLRS,
truncate, prune_head) over one slot of a `network.DraftNetwork`, whose compiled step runs
every layer in one call. Built from a runtime model directly (`FastDraftModel(target_model)`)
it owns a one-slot network of its own.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.drafters.model import TreeState

ARCHITECTURES = ("llama", "qwen2", "qwen3")


class FastDraftModel:
    def __init__(self, source, slot: int | None = None):
        """`source`: a DraftNetwork and one of its slots in use, or a runtime `TargetModel` at TP
        size 1 (a one-slot network over its weights, its slot taken here)."""
        from hetero_run.runtime.drafters.network import DraftNetwork

        if isinstance(source, DraftNetwork):
            if slot is None:
                raise ValueError("a view of a drafter network needs the slot it reads")
            source.table.check(slot)
            self.network, self.slot = source, slot
        else:
            self.network = DraftNetwork.from_model(source)
            self.slot = self.network.acquire()
        self.generation = self.network.table.generation[self.slot]
        self.vocab_size = self.network.vocab_size
        self.tree: TreeState | None = None

    @property
    def length(self) -> int:
        self.network.table.check(self.slot, self.generation)
        return self.network.length(self.slot)

    def prune_head(self, rows: torch.Tensor):
        return self.network.prune_head(rows)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None, head=None,
                last: bool = False) -> torch.Tensor:
        self.network.table.check(self.slot, self.generation)
        if parents is None:
            if self.tree is not None:
                raise ValueError("a chain forward inside an open tree: truncate first")
            return self.network.chain(self.slot, ids, head, last)
        if self.tree is None:
            self.tree = TreeState(self.length)
        positions, mask = self.tree.add(parents.tolist())  # [n], [n, base + nodes]
        logits = self.network.tree(self.slot, ids, positions, mask, head)
        return logits[-1:] if last else logits

    def truncate(self, length: int) -> None:
        self.network.table.check(self.slot, self.generation)
        self.network.truncate(self.slot, length)
        self.tree = None
