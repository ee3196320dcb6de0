"""Sequence slots of a drafter: which are in use, and how many tokens each one's KV cache holds.

An engine drafting for several running sequences gives each one a slot for its lifetime:

    slot = network.acquire()          # the lowest free slot; NoFreeSlot when all are taken
    ... network.forward(ids, slots, positions) ...
    network.release(slot)             # its cache is forgotten; the slot is free again

A slot's cache holds tokens at indices 0 .. length - 1. A row appended at `position` p writes
index p and drops whatever the slot held from p on, so p may be anything from 0 to length.
"""

from __future__ import annotations


class NoFreeSlot(RuntimeError):
    """Every slot is in use: release one (a finished sequence) first."""


class SlotTable:
    def __init__(self, count: int, max_tokens: int):
        if count < 1:
            raise ValueError(f"a drafter needs at least one sequence slot, got {count}")
        if max_tokens < 1:
            raise ValueError(f"a slot must hold at least one token, got {max_tokens}")
        self.count, self.max_tokens = count, max_tokens
        self.lengths = [0] * count  # tokens in each slot's cache
        self.busy = [False] * count
        self.generation = [0] * count  # counts acquisitions: a view of an earlier owner is refused

    @property
    def free(self) -> int:
        """How many slots are free."""
        return self.busy.count(False)

    def in_use(self) -> list[int]:
        return [s for s, b in enumerate(self.busy) if b]

    def acquire(self) -> int:
        for slot, busy in enumerate(self.busy):
            if not busy:
                self.busy[slot], self.lengths[slot] = True, 0
                self.generation[slot] += 1
                return slot
        raise NoFreeSlot(f"all {self.count} drafter slots are in use")

    def release(self, slot: int) -> None:
        self.check(slot)
        self.busy[slot], self.lengths[slot] = False, 0

    def check(self, slot: int, generation: int | None = None) -> None:
        """A slot in use (and, given its `generation`, still held by the same owner)."""
        if not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not in 0..{self.count - 1}")
        if not self.busy[slot]:
            raise ValueError(f"slot {slot} is not in use (acquire it first)")
        if generation is not None and generation != self.generation[slot]:
            raise ValueError(f"slot {slot} was released and acquired again since this view was made")

    def truncate(self, slot: int, length: int) -> None:
        self.check(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of {self.lengths[slot]} tokens to {length}")
        self.lengths[slot] = length

    def plan(self, slots: list[int], positions: list[int] | None) -> tuple[list[int], dict[int, tuple[int, int]]]:
        """Check a batched forward's rows -> (each row's position, {slot: (first, last + 1)}).

        Rows of one slot must be consecutive positions, in order, starting at or before the
        slot's length (None: each row continues its slot). Nothing changes until `commit`.
        """
        spans: dict[int, tuple[int, int]] = {}
        out = []
        for r, slot in enumerate(slots):
            if slot not in spans:
                self.check(slot)
            first, end = spans.get(slot, (None, self.lengths[slot]))
            p = end if positions is None else positions[r]
            if first is None:
                if not 0 <= p <= self.lengths[slot]:
                    raise ValueError(f"row {r}: position {p} of slot {slot} is past its {self.lengths[slot]} "
                                     "cached tokens")
                first = p
            elif p != end:
                raise ValueError(f"row {r}: position {p} of slot {slot} does not follow its previous row ({end - 1})")
            spans[slot] = (first, p + 1)
            out.append(p)
        return out, spans

    def commit(self, spans: dict[int, tuple[int, int]]) -> None:
        for slot, (_, end) in spans.items():
            self.lengths[slot] = end
