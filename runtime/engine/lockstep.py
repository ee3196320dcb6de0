"""Drafting for many sequences at once: their drafter forwards meet in one batched forward.

Each sequence's proposer runs exactly as it would alone, in a greenlet of its own (cooperative
switches: no threads, no locks). When it asks its drafter slot for a chain forward, the slot
switches back to the engine, which lets every other proposer run until it asks too (or
finishes), runs all the asks as one forward of the drafter network (rows of many slots), and
hands each its own rows' logits:

    step 1:  A catches up 12 prompt tokens, B and C draft their first token   -> 14 rows, 1 forward
    step 2:  A, B and C draft their next token                                -> 3 rows, 1 forward
    step 3:  B stopped (its cost model asked for 2), A and C go on            -> 2 rows, 1 forward

The network gives every row the bits it gets alone, so each sequence drafts the same tokens it
would draft by itself; only the number of drafter forwards (and their fixed cost) changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from greenlet import greenlet


class Lockstep:
    def __init__(self, network):
        self.network = network
        self._main: greenlet | None = None  # the engine's greenlet while `run` is running

    def view(self, slot_view) -> LockstepView:
        return LockstepView(slot_view, self)

    @property
    def active(self) -> bool:
        return self._main is not None and greenlet.getcurrent() is not self._main

    def run(self, jobs: list[Callable[[], object]]) -> list[object]:
        """Run every job to its end, their drafter forwards batched -> their results, in order."""
        if len(jobs) <= 1:
            return [job() for job in jobs]
        self._main = greenlet.getcurrent()
        try:
            workers = [greenlet(job) for job in jobs]
            results: list[object] = [None] * len(jobs)
            asks: dict[int, tuple] = {}
            for i, worker in enumerate(workers):
                self._resume(i, worker, (), results, asks)
            while asks:
                for i, logits in self._forward(asks).items():
                    del asks[i]
                    self._resume(i, workers[i], (logits,), results, asks)
            return results
        finally:
            self._main = None

    def ask(self, view, ids: torch.Tensor, head) -> torch.Tensor:
        """From inside a job: wait for the next batched forward -> logits [len(ids), vocab]."""
        view.length  # noqa: B018  (a view of a released slot refuses here, in its own job)
        return self._main.switch(("ask", view.slot, ids.reshape(-1).long(), head))

    def _resume(self, i: int, worker: greenlet, value: tuple, results: list, asks: dict) -> None:
        out = worker.switch(*value)
        if worker.dead:
            results[i] = out
        else:
            asks[i] = out

    def _forward(self, asks: dict[int, tuple]) -> dict[int, torch.Tensor]:
        """One network forward per head asked for: the rows of every ask, each ask's rows together."""
        out: dict[int, torch.Tensor] = {}
        by_head: dict[int, list[int]] = {}
        for i, (_, _, _, head) in asks.items():
            by_head.setdefault(id(head), []).append(i)
        for group in by_head.values():
            head = asks[group[0]][3]
            ids = torch.cat([asks[i][2] for i in group])
            slots = torch.cat([torch.full((asks[i][2].numel(),), asks[i][1], dtype=torch.long) for i in group])
            logits = self.network.forward(ids, slots, head=head)
            first = 0
            for i in group:
                n = asks[i][2].numel()
                out[i] = logits[first:first + n]
                first += n
        return out


class LockstepView:
    """A drafter slot's single-sequence view whose chain forwards join the engine's batched
    forward while a `Lockstep.run` is under way (and run at once otherwise)."""

    def __init__(self, view, lockstep: Lockstep):
        self.view, self.lockstep = view, lockstep

    @property
    def slot(self) -> int:
        return self.view.slot

    @property
    def length(self) -> int:
        return self.view.length

    @property
    def vocab_size(self) -> int:
        return self.view.vocab_size

    def prune_head(self, rows: torch.Tensor):
        return self.view.prune_head(rows)

    def truncate(self, length: int) -> None:
        self.view.truncate(length)

    def forward(self, ids: torch.Tensor, parents: torch.Tensor | None = None, head=None,
                last: bool = False) -> torch.Tensor:
        if parents is not None or not self.lockstep.active or getattr(self.view, "tree", None) is not None:
            return self.view.forward(ids, parents, head, last)  # trees (SLRS) and lone calls run at once
        logits = self.lockstep.ask(self.view, ids, head)  # a batched forward's rows: the head ran on all
        return logits[-1:] if last else logits
