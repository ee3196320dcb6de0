"""Who runs in the next step, and how many of their pending positions.

Each step carries at most `max_num_batched_tokens` rows and `max_num_seqs` sequences.
Decoding sequences come first, oldest first, one row each (their pending token; the
speculation planner may add draft rows after); then prefilling ones, oldest first, each a chunk
of its prompt from what is left of the budget, so a long prompt never stalls the others'
decoding. Then waiting sequences are admitted in arrival order while
the budget, the sequence cap and the free blocks allow, each starting from the longest prefix
the prefix cache holds. A waiting sequence whose next prompt block a running one is computing
now (the same system prompt arriving twice at once, `n` choices of one prompt) waits until that
block is cached rather than compute it a second time: the queue stays in order, and the one it
waits for is running, so it moves on within that prefill. When a running sequence cannot get a
block, the newest running
sequence is preempted (its blocks freed; it is recomputed from its tokens when readmitted, at
the front of the queue), so the oldest always progress and no request starves.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from hetero_run.runtime.engine.blocks import BlockManager, OutOfBlocks
from hetero_run.runtime.engine.sequence import Sequence, Status

log = logging.getLogger("hetero_run.runtime.engine.scheduler")


@dataclass
class Scheduled:
    seq: Sequence
    rows: int  # pending positions run this step: computed .. computed + rows - 1

    @property
    def decides(self) -> bool:
        """Whether this step decides the sequence's next token (its last pending position runs)."""
        return self.rows == self.seq.pending


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        decoding = [s for s in self.running if s.pending == 1]
        for seq in decoding + [s for s in self.running if s.pending > 1]:
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted for an older one this step, or no rows left
            rows = min(seq.pending, budget)
            if not self._make_room(seq, seq.computed + rows):
                continue  # it was the newest: preempted itself
            out.append(Scheduled(seq, rows))
            budget -= rows
        out = [x for x in out if x.seq.status is Status.RUNNING]  # a later one may have preempted an earlier
        computing = self._computing()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a prompt whose log-probabilities are asked reuses no cached block past the rows read
            limit = len(seq.prompt_entries) if seq.prompt_rows_wanted else len(seq.token_ids) - 1
            table = self.blocks.match(seq.token_ids, limit=limit)
            keys = self._prompt_keys(seq)
            if not seq.prompt_rows_wanted and len(table.blocks) < len(keys) and keys[len(table.blocks)] in computing:
                self.blocks.release(table)  # its next block is being computed: take it from the cache later
                break
            cached = len(table.blocks) * self.blocks.block_size
            rows = min(len(seq.token_ids) - cached, budget)
            try:
                self.blocks.grow(table, cached + rows)
            except OutOfBlocks:
                self.blocks.release(table)
                break
            self.waiting.popleft()
            seq.table, seq.computed, seq.status = table, cached, Status.RUNNING
            if not seq.admitted_once:
                seq.cached_tokens, seq.admitted_once = cached, True
            self.running.append(seq)
            out.append(Scheduled(seq, rows))
            budget -= rows
            computing.update(keys[cached // self.blocks.block_size:])  # what it computes from now on
        return out

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        if not self.blocks.prefix_caching:
            return []
        if seq.prompt_keys is None:
            seq.prompt_keys = self.blocks.prefix_keys(seq.token_ids, seq.prompt_len)
        return seq.prompt_keys

    def _computing(self) -> set[bytes]:
        """Keys of the full prompt blocks that running sequences have yet to commit."""
        keys: set[bytes] = set()
        for seq in self.running:
            if seq.computed < seq.prompt_len:
                keys.update(self._prompt_keys(seq)[len(seq.table.keys):])
        return keys

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """Grow seq's table to `tokens` positions, preempting the newest running sequences as
        needed; False when seq itself had to go."""
        while True:
            try:
                self.blocks.grow(seq.table, tokens)
                return True
            except OutOfBlocks:
                victim = max(self.running, key=lambda s: s.number)
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        log.debug("preempting request %s (%d tokens) for lack of KV blocks", seq.request_id, len(seq.token_ids))
        self.preemptions += 1
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.computed, seq.status = 0, Status.WAITING
        # back in arrival order, ahead of everything that came later
        index = next((i for i, s in enumerate(self.waiting) if s.number > seq.number), len(self.waiting))
        self.waiting.insert(index, seq)

    def finish(self, seq: Sequence) -> None:
        """The sequence is done (finished, cancelled, failed): it leaves and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.table)
        seq.status = Status.FINISHED
