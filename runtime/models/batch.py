"""The rows of one target forward, and what each row reads and writes in the paged KV cache.

One engine step (or one sequence's decode, verify or prefill chunk) is one `ForwardBatch`:

    row i: token ids[i] of sequence seq[i] at rotary position positions[i]; its K/V go to the
           sequence's logical position logical[i]; it attends, in this order, to the sequence's
           logical positions 0 .. prefix[i] - 1 and then to extras[i] (a tree row's ancestors and
           itself; nothing for a chain row, whose prefix ends with its own position)

Logical position p of the sequence in row s of `block_tables` lives in the physical cache slot

    block_tables[s, p // block_size] * block_size + p % block_size

Worked example, block_size 4, one sequence with block table [7, 2]: logical 0..3 are slots
28..31 and logical 4..7 are slots 8..11, so a decode row at logical 5 writes slot 9 and
attends to slots 28, 29, 30, 31, 8, 9.

A tree verify after 5 committed tokens: rows 0..3 at logical 5..8 with parents -1, 0, 0, 1
(row 0 is the last committed token, rows 1 and 2 two candidates after it, row 3 follows row 1)
all have prefix 5; row 3 has rotary position 7 (5 + its depth) and extras = logical 5, 6, 8,
so it reads logical 0..4, 5, 6, 8: the keys a one-token decode of that path reads, in the same
order. `copies` [2, C] (physical source and destination slots) run before the forward: after
that tree verify accepts rows 0, 1, 3 they move logical 8 to logical 7.

Only integers cross to the worker ranks: `to_tensor` packs a batch into one int64 tensor and
`from_tensor` unpacks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER = 7  # rows, sequences, table width, logits rows, extras (-1: none), copies, block size


@dataclass
class ForwardBatch:
    ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64, rotary positions
    seq: torch.Tensor  # [R] int64: the row of block_tables holding this row's sequence
    logical: torch.Tensor  # [R] int64: where in its sequence the row's K/V are written
    prefix: torch.Tensor  # [R] int64: logical positions 0 .. prefix - 1 are attended first
    block_tables: torch.Tensor  # [S, W] int64 physical block ids
    block_size: int
    logits_rows: torch.Tensor  # [L] int64: rows whose logits the forward returns, in this order
    extra_offsets: torch.Tensor | None = None  # [R + 1] int64 bounds of each row's extras
    extras: torch.Tensor | None = None  # [E] int64 logical positions attended after the prefix
    copies: torch.Tensor | None = None  # [2, C] int64 physical (source, destination) slots

    @property
    def rows(self) -> int:
        return int(self.ids.numel())

    def physical(self, seq: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        b = self.block_size
        return self.block_tables[seq, logical // b] * b + logical % b

    def write_slots(self) -> torch.Tensor:
        """[R] the physical slot of each row's K/V."""
        return self.physical(self.seq, self.logical)

    def key_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_slots [T], key_offsets [R + 1]): row i attends to the physical slots
        key_slots[key_offsets[i]:key_offsets[i + 1]], in order."""
        counts = self.prefix
        if self.extras is not None:
            counts = counts + (self.extra_offsets[1:] - self.extra_offsets[:-1])
        offsets = torch.zeros(self.rows + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=offsets[1:])
        row = torch.repeat_interleave(torch.arange(self.rows), counts)  # [T]
        j = torch.arange(row.numel()) - offsets[row]  # index of the key within its row
        logical = j
        if self.extras is not None and self.extras.numel():
            past = j - self.prefix[row]  # >= 0: the key is one of the row's extras
            index = (self.extra_offsets[row] + past).clamp(0, self.extras.numel() - 1)
            logical = torch.where(past >= 0, self.extras[index], j)
        return self.physical(self.seq[row], logical), offsets

    def check(self, num_slots: int) -> None:
        """Raise ValueError unless every slot this batch names lies in a cache of `num_slots`
        (run on rank 0 before a batch is sent: a bad one must never reach the workers)."""
        r = self.rows
        for name in ("positions", "seq", "logical", "prefix"):
            if getattr(self, name).shape != (r,):
                raise ValueError(f"{name} must have one entry per row ({r})")
        if r == 0:
            raise ValueError("a forward needs at least one row")
        span = self.block_tables.shape[1] * self.block_size
        if int(self.logical.min()) < 0 or int(self.logical.max()) >= span or int(self.prefix.min()) < 0:
            raise ValueError(f"logical positions must lie in 0 .. {span - 1} (the block tables' width)")
        if int(self.prefix.max()) > span:
            raise ValueError(f"a prefix runs past the block tables' {span} positions")
        if int(self.seq.min()) < 0 or int(self.seq.max()) >= self.block_tables.shape[0]:
            raise ValueError("a row names a sequence outside the block tables")
        if self.logits_rows.numel() and (int(self.logits_rows.min()) < 0 or int(self.logits_rows.max()) >= r):
            raise ValueError("a logits row is outside the batch")
        used = self.block_tables[self.seq.unique()]
        if int(used.min()) < 0 or (int(used.max()) + 1) * self.block_size > num_slots:
            raise ValueError(f"a block table names a block outside the cache of {num_slots} slots")
        if self.extras is not None and self.extras.numel() and (
                int(self.extras.min()) < 0 or int(self.extras.max()) >= span):
            raise ValueError("an extra position lies outside the block tables")
        if self.copies is not None and self.copies.numel() and (
                int(self.copies.min()) < 0 or int(self.copies.max()) >= num_slots):
            raise ValueError(f"a copied slot is outside the cache of {num_slots} slots")

    def to_tensor(self) -> torch.Tensor:
        """-> int64 [HEADER + ...]: everything a worker rank needs, in one tensor."""
        s, w = self.block_tables.shape
        has_extras = self.extras is not None
        copies = self.copies if self.copies is not None else torch.empty(2, 0, dtype=torch.long)
        header = torch.tensor([self.rows, s, w, self.logits_rows.numel(),
                               self.extras.numel() if has_extras else -1, copies.shape[1], self.block_size])
        parts = [header, self.ids, self.positions, self.seq, self.logical, self.prefix, self.block_tables.flatten(),
                 self.logits_rows]
        if has_extras:
            parts += [self.extra_offsets, self.extras]
        parts.append(copies.flatten())
        return torch.cat([p.to(torch.long) for p in parts])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ForwardBatch:
        r, s, w, logits, extras, copies, block_size = t[:HEADER].tolist()
        sizes = [r, r, r, r, r, s * w, logits]
        if extras >= 0:
            sizes += [r + 1, extras]
        sizes.append(2 * copies)
        parts = list(torch.split(t[HEADER:], sizes))
        ids, positions, seq, logical, prefix, tables, logits_rows = parts[:7]
        extra_offsets = extra_list = None
        if extras >= 0:
            extra_offsets, extra_list = parts[7], parts[8]
        return cls(ids, positions, seq, logical, prefix, tables.view(s, w), block_size, logits_rows, extra_offsets,
                   extra_list, parts[-1].view(2, copies) if copies else None)


def tree_extras(start: int, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows start .. start + n - 1 forming a tree (parents[i] < i, -1 for the root's children of
    the committed prefix) -> (extra_offsets [n + 1], extras): each row's ancestors and itself,
    as logical positions, root first."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree row {i} has parent {parent}: parents must come first")
        paths.append((paths[parent] if parent >= 0 else []) + [start + i])
    offsets = torch.tensor([0] + [len(p) for p in paths]).cumsum(0)
    return offsets, torch.tensor([x for p in paths for x in p], dtype=torch.long)


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out
