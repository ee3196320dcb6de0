"""The fast drafter: its weights, a KV cache with sequence slots, and one compiled call per step.

    network = DraftNetwork(weights, slots=8, max_tokens=4096)
    a, b = network.acquire(), network.acquire()
    logits = network.forward(ids, slots=torch.tensor([a, b]))    # one token for each: [2, vocab]
    network.truncate(a, 17); network.release(b)
    view = network.view(a)                                       # the single-sequence DraftModel

Each slot has its own region of the cache ([slots, layers, kv_heads, max_tokens, head_dim]) and
its own length (`slots.SlotTable`). A batched forward's rows carry (slot, position); one call
runs them all through `kernels.drafter_step.DraftStep`, and each row gets exactly the bits it
would get alone. The single-sequence protocol of `drafters.model` (chains, trees for SLRS,
truncate, prune_head) is `fast.FastDraftModel`, a view of one slot.
"""

from __future__ import annotations

import torch

from hetero_run.kernels.drafter_step import DraftStep, Projection, StepWeights, rotary_tables
from hetero_run.runtime.drafters.slots import SlotTable
from hetero_run.runtime.models.kv_cache import KVCacheFull

MAX_EXTRA_HEADS = 4  # pruned heads kept at once (one per algorithm that prunes; TLI has one)


class DraftHead:
    """A head over some vocabulary rows (`prune_head`): what `forward(head=...)` takes."""

    def __init__(self, number: int, rows: torch.Tensor):
        self.number, self.rows = number, rows  # rows [m] int64

    def __repr__(self) -> str:
        return f"DraftHead({self.number}, {self.rows.numel()} rows)"


class DraftNetwork:
    def __init__(self, weights: StepWeights, slots: int = 1, max_tokens: int = 4096,
                 cache_dtype: torch.dtype | None = None, compiled: bool | None = None):
        self.weights = weights
        self.table = SlotTable(slots, max_tokens)
        dtype = cache_dtype or (torch.float32 if weights.embed.dtype == torch.float32 else torch.bfloat16)
        shape = (slots, len(weights.layers), weights.kv_heads, max_tokens, weights.head_dim)
        # empty, not zeros: every index is written before it is read, and untouched pages cost no memory
        self.k_cache = torch.empty(shape, dtype=dtype)  # [slots, layers, kv_heads, max_tokens, head_dim]
        self.v_cache = torch.empty(shape, dtype=dtype)
        cos, sin = rotary_tables(weights.extra["rope_inv_freq"], max_tokens)
        self.step = DraftStep(weights, cos, sin, self.k_cache, self.v_cache, compiled=compiled)
        self._heads: dict[tuple, DraftHead] = {}

    @classmethod
    def from_model(cls, model, slots: int = 1, max_tokens: int | None = None, **kwargs) -> DraftNetwork:
        """From a runtime model at TP size 1 (its layer objects; weights shared, not copied)."""
        from hetero_run.runtime.drafters.weights import from_model, with_fast_activations

        max_tokens = max_tokens or getattr(model, "max_tokens", None) or 4096
        return cls(with_fast_activations(from_model(model)), slots, max_tokens, **kwargs)

    # ---------------------------------------------------------------- slots

    @property
    def num_slots(self) -> int:
        return self.table.count

    @property
    def free_slots(self) -> int:
        return self.table.free

    @property
    def max_tokens(self) -> int:
        return self.table.max_tokens

    @property
    def vocab_size(self) -> int:
        return self.weights.vocab_size

    def acquire(self) -> int:
        return self.table.acquire()

    def release(self, slot: int) -> None:
        self.table.release(slot)

    def length(self, slot: int) -> int:
        return self.table.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        self.table.truncate(slot, length)

    def view(self, slot: int):
        from hetero_run.runtime.drafters.fast import FastDraftModel

        self.table.check(slot)
        return FastDraftModel(self, slot)

    # ---------------------------------------------------------------- forwards

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None = None,
                head: DraftHead | None = None) -> torch.Tensor:
        """Rows (ids[r] at `positions[r]` of slot `slots[r]`; [n] int64 each) -> logits [n, vocab]
        (or [n, len(head.rows)]) float32.

        Rows of one slot are consecutive positions in order, the first at most the slot's length
        (what was cached from there on is dropped); `positions=None` continues each slot. One
        row per running sequence drafts one token for each.
        """
        ids = ids.reshape(-1).long()
        slot_list = slots.reshape(-1).tolist()
        if len(slot_list) != ids.numel() or not slot_list:
            raise ValueError(f"need n >= 1 rows with one slot each, got {ids.numel()} ids and {len(slot_list)} slots")
        rows, spans = self.table.plan(slot_list, None if positions is None else positions.reshape(-1).tolist())
        self._room(spans)
        index = torch.tensor(rows, dtype=torch.long)
        logits = self.step.forward(ids, torch.tensor(slot_list, dtype=torch.long), index, index, None,
                                   0 if head is None else head.number)
        self.table.commit(spans)
        return logits

    def chain(self, slot: int, ids: torch.Tensor, head: DraftHead | None = None, last: bool = False) -> torch.Tensor:
        """ids [n] appended to one slot -> logits [n, vocab] (the single-sequence fast path), or
        [1, vocab] after the last one alone (`last`: the head runs on that row only)."""
        self.table.check(slot)
        start, n = self.table.lengths[slot], ids.numel()
        self._room({slot: (start, start + n)})
        index = torch.arange(start, start + n)
        logits = self.step.forward(ids.reshape(-1).long(), torch.full((n,), slot, dtype=torch.long), index, index,
                                   None, 0 if head is None else head.number, last)
        self.table.lengths[slot] = start + n
        return logits

    def tree(self, slot: int, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             head: DraftHead | None = None) -> torch.Tensor:
        """Tree nodes appended to one slot at the next indices, rotated by `positions` [n],
        attending where mask [n, length + n] (bool) is True -> logits [n, vocab]."""
        self.table.check(slot)
        start, n = self.table.lengths[slot], ids.numel()
        if tuple(mask.shape) != (n, start + n):
            raise ValueError(f"a tree mask for {n} nodes after {start} tokens is [{n}, {start + n}], "
                             f"got {list(mask.shape)}")
        self._room({slot: (start, start + n)})
        logits = self.step.forward(ids.reshape(-1).long(), torch.full((n,), slot, dtype=torch.long),
                                   torch.arange(start, start + n), positions.long(), mask.bool(),
                                   0 if head is None else head.number)
        self.table.lengths[slot] = start + n
        return logits

    def _room(self, spans: dict[int, tuple[int, int]]) -> None:
        for slot, (_, end) in spans.items():
            if end > self.table.max_tokens:
                raise KVCacheFull(f"drafter slot {slot} would reach {end} tokens but its KV cache holds "
                                  f"{self.table.max_tokens}; raise the drafter's max_tokens", field="max_tokens")

    # ---------------------------------------------------------------- heads

    def prune_head(self, rows: torch.Tensor) -> DraftHead:
        """A head computing only vocabulary rows `rows` [m] (TLI drafts over the shared tokens)."""
        rows = rows.reshape(-1).long().cpu()
        key = (rows.numel(), hash(rows.numpy().tobytes()))
        if key not in self._heads:
            if len(self._heads) >= MAX_EXTRA_HEADS:  # the oldest goes
                old = self._heads.pop(next(iter(self._heads)))
                self.step.set_head(old.number, None)
            used = {h.number for h in self._heads.values()}
            number = next(i for i in range(1, MAX_EXTRA_HEADS + 2) if i not in used)
            self.step.set_head(number, self.weights.head.rows(rows))
            self._heads[key] = DraftHead(number, rows)
        return self._heads[key]

    @property
    def head(self) -> Projection:
        return self.weights.head

    # ---------------------------------------------------------------- what a step reads

    def decode_nbytes(self, context: int = 0) -> int:
        """Bytes one decoded token reads: the weights (`StepWeights.decode_nbytes`) and the keys
        and values of `context` cached tokens."""
        w = self.weights
        kv = 2 * len(w.layers) * w.kv_heads * w.head_dim * self.k_cache.element_size() * (context + 1)
        return w.decode_nbytes() + kv
