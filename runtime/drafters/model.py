"""The drafter's network as the proposers see it: a KV cache that grows by forwards and rolls back.

    forward(ids [n], parents=None, head=None) -> logits [n, vocab]

appends n tokens after the `length` cached ones. Without `parents` they form a chain, as in
decoding. With `parents` they are nodes of a tree (SLRS scores many drafter segmentations at
once): the tree opens at the first tree forward after a chain, and its nodes are numbered in
the order they were appended, over one or more forwards. parents[i] is the number of node i's
parent, -1 for a child of the last token before the tree; a node attends to everything
before the tree, its ancestors and itself, at position base + depth. Worked example, 10
cached tokens, then a tree forward of 4 nodes and one of 1:

    node     0  1  2  3 | 4          parents -1  0  0  2 | 1    (0 -> 1 -> 4, 0 -> 2 -> 3)
    position 10 11 11 12| 12         node 4 attends to slots 0..9 and nodes 0, 1, 4

`truncate` ends the tree; only a leading chain of nodes (node i's parent is i - 1) is valid
cache afterwards, so callers truncate to base + that many (`leading_chain`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class DraftModel(Protocol):
    length: int  # tokens in the KV cache
    vocab_size: int  # rows of the full head

    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None, head=None,
                last: bool = False) -> torch.Tensor:
        """`head`: from `prune_head` (logits [n, len(rows)]); None = the full head. `last`: only
        the last row's logits are wanted ([1, ...]; a model may skip the head for the others)."""
        ...

    def truncate(self, length: int) -> None: ...

    def prune_head(self, rows: torch.Tensor):
        """A head computing only vocabulary rows `rows` (TLI drafts over the shared tokens), an
        opaque handle that `forward(head=...)` takes."""
        ...


class TreeState:
    """Ancestry of the tree nodes appended since the tree opened at `base`."""

    def __init__(self, base: int):
        self.base = base
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.ancestors: list[int] = []  # bit i set: node i is this node or one of its ancestors

    def add(self, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append nodes -> (positions [n], mask [n, base + nodes] bool, True = may attend)."""
        first = len(self.parents)
        for i, parent in enumerate(parents, start=first):
            if parent >= i:
                raise ValueError(f"tree node {i} has parent {parent}: parents must come first")
            self.parents.append(parent)
            self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
            self.ancestors.append((1 << i) | (self.ancestors[parent] if parent >= 0 else 0))
        total = len(self.parents)
        rows = [[(bits >> j) & 1 for j in range(total)] for bits in self.ancestors[first:]]
        mask = torch.cat([torch.ones(len(rows), self.base, dtype=torch.bool), torch.tensor(rows, dtype=torch.bool)], 1)
        positions = torch.tensor(self.depth[first:], dtype=torch.long) + self.base
        return positions, mask


def leading_chain(parents: list[int]) -> int:
    """How many of the first tree nodes form a chain off the base (valid KV after the tree)."""
    count = 0
    for i, parent in enumerate(parents):
        if parent != i - 1:
            break
        count += 1
    return count
