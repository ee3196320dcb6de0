"""An EAGLE-3 head as a drafter: the `DraftModel` interface over the head and the target's states.

The target calls `record` after every forward on rank 0 (its `capture` sink): the aux states of
the n tokens it just ran at cache slots start .. start + n - 1 are fused (`fc`) and kept by slot
in a `FeatureLog`, so the log always mirrors the target's KV cache: rows below `target.length`
are the fused states of the committed tokens, whatever ran in between (rounds without drafting
included).

`forward(ids)` appends target tokens. Token j pairs with the features of position j - 1: the
target's row when the target has run position j - 1, otherwise the head's own output h for
token j - 1 (a drafted chain). Token 0 has no pair and takes no cache slot, so head slot
s holds token s + 1. Worked example, prompt x0..x4, first emitted token x5, drafts d1 d2:

    target rows   f0 f1 f2 f3 f4                     (prefill: the target ran x0..x4)
    head slots    (f0,x1) (f1,x2) (f2,x3) (f3,x4) (f4,x5) (h,d1)   -> logits for d2
    verify x5 d1 d2 -> rows f5 f6 f7; d1 accepted, d2 rejected: target length 7
    next forward: slot (h,d1) is run again as (f5,d1), then (f6,y) for the recovered token y

Re-running accepted drafts with the target's own states is what EAGLE does: the head was trained
on target states, and its own h is only a stand-in until they exist. Chain forwards of several
tokens return the last token's logits only ([1, vocab]; callers read [-1]): a long prompt's
rows would otherwise cost n * vocab floats for nothing.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.eagle3.head import Eagle3Head


class FeatureLog:
    """Fused target states by target slot: rows [low, end) were written since the last restart."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.rows = torch.empty(capacity, hidden, dtype=dtype, device=device)  # [capacity, H]
        self.low = self.end = 0

    def write(self, start: int, g: torch.Tensor) -> None:  # g [n, H] for slots start .. start + n - 1
        end = start + g.shape[0]
        if start == 0 or start > self.end:  # a new sequence, or rows the log never saw
            self.low = start
        if end > self.rows.shape[0]:
            grown = torch.empty(max(end, 2 * self.rows.shape[0]), self.rows.shape[1], dtype=self.rows.dtype,
                                device=self.rows.device)
            grown[:self.end] = self.rows[:self.end]
            self.rows = grown
        self.rows[start:end] = g
        self.end = end

    def available(self, target_length: int) -> tuple[int, int]:
        """[low, high): the rows that hold the target's committed positions."""
        return self.low, min(self.end, target_length)


class Eagle3Drafter:
    """`DraftModel` for an EAGLE-3 head bound to rank 0's target model."""

    chain_only = True  # no tree forwards (SLRS)

    def __init__(self, head: Eagle3Head, target, draft_target_ids: torch.Tensor, target_vocab: int):
        self.head, self.target = head, target
        self.draft_target_ids = draft_target_ids  # [draft_vocab] int64: target id of draft id d
        self.vocab_size = target_vocab  # the full head's logits are over the target vocabulary
        self.log = FeatureLog(head.config.hidden_size, head.dtype, head.device)
        self.tokens: list[int] = []
        self.exact = 0  # tokens 1 .. exact ran with the target's features
        self.hidden: torch.Tensor | None = None  # [1, H] own output of token `hidden_of`
        self.hidden_of = -1
        self._draft_rows = draft_target_ids  # prune_head(draft_target_ids) returns this very tensor
        self.seq, self.committed = 0, lambda: target.length  # whose rows `record` keeps (see `bind`)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def aux_layers(self) -> tuple[int, int, int]:
        return self.head.config.aux_layers

    def bind(self, seq: int, length) -> None:
        """Follow the sequence in row `seq` of the target's block tables from now on; `length()`
        is how many of its tokens the target has committed. (The one-sequence view: seq 0 and
        the target's own length, the default.)"""
        self.seq, self.committed = seq, length

    def record(self, batch, features: torch.Tensor) -> None:
        """The target's capture sink: aux states [rows, 3 * H_target] of a forward's rows; this
        head keeps those of its sequence (its rows are consecutive in a batch)."""
        rows = (batch.seq == self.seq).nonzero().flatten()
        if rows.numel():
            first, last = int(rows[0]), int(rows[-1]) + 1
            self.log.write(int(batch.logical[first]), self.head.fuse(features[first:last]))

    def prune_head(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits for target ids `rows` only: -> draft id of each (-1: not in the draft vocabulary).
        `prune_head(draft_target_ids)` gives the head's own draft-vocabulary logits, unpermuted."""
        if rows is self.draft_target_ids:
            return self._draft_rows
        index = torch.full((self.vocab_size,), -1, dtype=torch.long)
        index[self.draft_target_ids] = torch.arange(self.draft_target_ids.numel())
        return index[rows]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {length}")
        del self.tokens[length:]
        self.exact = min(self.exact, max(0, length - 1))
        if self.hidden_of >= length:
            self.hidden, self.hidden_of = None, -1
        self.head.truncate(max(0, length - 1))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None,
                head: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
        """Append target tokens ids [n] -> logits [1, vocab] after the last one (see the module doc;
        always the last row alone, whatever `last`)."""
        if parents is not None:
            raise ValueError("an EAGLE-3 head drafts chains; tree forwards are not supported")
        before = len(self.tokens)
        self.tokens += ids.tolist()
        low, high = self.log.available(self.committed())

        def has_row(j: int) -> bool:  # token j's features come from the target
            return low <= j - 1 < high

        start = before
        if self.exact < before - 1 and has_row(self.exact + 1):
            start = self.exact + 1  # drafts the target has run since: run them again with its states
        start = max(start, 1)
        while start > 1 and not has_row(start) and self.hidden_of != start - 1:
            start -= 1  # the own output this chain continues from is gone: recompute it
        self.head.truncate(start - 1)
        h = None
        stop = start
        while stop < len(self.tokens) and has_row(stop):
            stop += 1
        if stop > start:  # one batched forward over the tokens with target features
            h = self.head.forward(torch.tensor(self.tokens[start:stop]), self.log.rows[start - 1:stop - 1])
            if start - 1 <= self.exact:
                self.exact = stop - 1
            self.hidden, self.hidden_of = h[-1:], stop - 1
        for j in range(stop, len(self.tokens)):  # the drafted chain: one token at a time
            g = self.hidden if self.hidden_of == j - 1 else self.head.embed.local.new_zeros(
                1, self.head.config.hidden_size)
            h = self.head.forward(torch.tensor(self.tokens[j:j + 1]), g)
            self.hidden, self.hidden_of = h, j
        if h is None:  # only token 0 so far: nothing to predict from
            logits = torch.zeros(1, self.head.config.draft_vocab_size)
        else:
            logits = self.head.logits(h[-1:])  # [1, draft_vocab]
        return self._select(logits, head)

    def _select(self, logits: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
        if head is self._draft_rows:
            return logits
        if head is None:
            full = logits.new_full((1, self.vocab_size), float("-inf"))
            full[:, self.draft_target_ids] = logits
            return full
        picked = logits[:, head.clamp_min(0)]
        return picked.masked_fill(head[None] < 0, float("-inf"))
