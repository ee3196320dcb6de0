"""One sequence over the whole KV cache: the single-request path of the target.

`generate`, the speculative driver, EAGLE-3 and the tests see the target as one growing
sequence: `forward` appends tokens (a prompt, a decode token, a verify chain or a verify
tree) and returns their logits, `truncate` rolls back, `keep` keeps one verified branch of a
tree. Here that sequence owns every cache block, in order (the identity block table), and each
call becomes `ForwardBatch`es run by `run` (the model's own forward, or the runner, which
first sends the batch to the worker ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetero_run.runtime.models.batch import ForwardBatch, tree_extras
from hetero_run.runtime.models.kv_cache import check_room


class OneSequence:
    def __init__(self, run: Callable[[ForwardBatch], torch.Tensor | None], max_tokens: int, block_size: int,
                 prefill_chunk: int = 512):
        self.run = run
        self.max_tokens, self.block_size, self.prefill_chunk = max_tokens, block_size, prefill_chunk
        self.length = 0  # tokens in the cache
        self._copies: list[tuple[int, int]] = []  # K/V moves `keep` asked for, sent with the next forward
        self._tree: tuple[int, list[int]] | None = None  # (start, parents) of the last forward, if a tree
        self._last_rows = 0  # rows of the last forward

    def check_room(self, n: int) -> None:
        check_room(self.length, n, self.max_tokens)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, num_logits: int | None = None,
                parents: list[int] | None = None) -> torch.Tensor | None:
        """ids, positions [n] -> logits [num_logits or n, vocab] (rank 0; None elsewhere).

        A chain (no `parents`) takes cache positions length .. length + n - 1, each token
        attending to everything before it; prompts longer than `prefill_chunk` run in chunks.
        With `parents` the n tokens form a tree: row 0 follows the cache (parents[0] == -1),
        parents[i] < i is row i's parent, each row attends to the cache, its ancestors and
        itself, and positions are length + depth; `keep` then picks the branch that stays.
        """
        n = ids.shape[0]
        if n == 0 or positions.shape != ids.shape:
            raise ValueError(f"need n >= 1 ids with one position each, got {tuple(ids.shape)} ids and "
                             f"{tuple(positions.shape)} positions")
        keep = n if num_logits is None else num_logits
        if not 1 <= keep <= n:
            raise ValueError(f"num_logits must be in 1..{n}, got {num_logits}")
        if parents is not None and (len(parents) != n or parents[0] != -1):
            raise ValueError(f"a tree forward needs one parent per row and parents[0] == -1, got {parents}")
        self.check_room(n)
        self._tree, self._last_rows = None, n
        if parents is not None:
            start = self.length
            out = self._run(ids, positions, torch.arange(n - keep, n), parents)
            self._tree = (start, list(parents))
            return out
        kept = []
        for begin in range(0, n, self.prefill_chunk):
            end = min(n, begin + self.prefill_chunk)
            first = max(begin, n - keep)
            logits_rows = torch.arange(first - begin, end - begin) if end > first else None
            out = self._run(ids[begin:end], positions[begin:end], logits_rows)
            if logits_rows is not None:
                kept.append(out)
        if kept[0] is None:  # not the first rank: no logits
            return None
        return kept[0] if len(kept) == 1 else torch.cat(kept)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor | None,
             parents: list[int] | None = None) -> torch.Tensor | None:
        n, start = ids.shape[0], self.length
        if parents is None:
            return self.append(ids, positions, torch.arange(start + 1, start + n + 1), logits_rows)
        offsets, extras = tree_extras(start, parents)
        return self.append(ids, positions, torch.full((n,), start, dtype=torch.long), logits_rows, offsets, extras)

    def append(self, ids: torch.Tensor, positions: torch.Tensor, prefix: torch.Tensor,
               logits_rows: torch.Tensor | None, extra_offsets: torch.Tensor | None = None,
               extras: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows themselves: ids at positions length .. length + n - 1, row i attending to
        positions 0 .. prefix[i] - 1 and then its extras (batch.ForwardBatch) -> logits of
        `logits_rows` (None for none)."""
        n, start, b = ids.shape[0], self.length, self.block_size
        self.check_room(n)
        width = -(-(start + n) // b)
        copies = torch.tensor(self._copies, dtype=torch.long).T.contiguous() if self._copies else None
        self._copies = []
        batch = ForwardBatch(ids.to(torch.long), positions.to(torch.long), torch.zeros(n, dtype=torch.long),
                             torch.arange(start, start + n), prefix, torch.arange(width)[None], b,
                             logits_rows if logits_rows is not None else torch.empty(0, dtype=torch.long),
                             extra_offsets, extras, copies)
        out = self.run(batch)
        self.length = start + n
        return out if logits_rows is not None else None

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (e.g. the accepted prefix after a chain verify)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length, self._tree, self._last_rows = length, None, 0

    def keep(self, rows: list[int]) -> None:
        """After a tree forward: keep rows `rows` (row 0, then the accepted path in order) as the
        cache's next tokens, exactly as if they had been decoded one at a time (their K/V move
        with the next forward). After a chain forward, keep(range(a + 1)) is a truncate."""
        if self._tree is None:
            if list(rows) != list(range(len(rows))) or len(rows) > self._last_rows:
                raise ValueError(f"the last forward was a chain of {self._last_rows} rows: kept rows must be "
                                 f"0 .. a within it, got {rows}")
            self.truncate(self.length - self._last_rows + len(rows))
            return
        start, parents = self._tree
        if not rows or rows[0] != 0 or any(not 0 <= r < len(parents) for r in rows) or any(
                parents[b] != a for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"kept rows must be row 0 and then a path of children, got {rows} (parents {parents})")
        self._tree = None
        for j, row in enumerate(rows):
            if row != j:  # identity table: logical position == physical slot
                self._copies.append((start + row, start + j))
        self.length = start + len(rows)
