"""Speculation per sequence inside the batching engine, sized for the whole step.

Each sequence keeps its own proposer state (drafter context, model-free tables), verifier and
measurements (`_SequenceRound`); the engine holds what they share (the tokenizer pairing, the
drafter's sequence slots, the step's cost line). Before a step, `plan` asks each decoding
sequence's proposer for draft rows; after it, `verify` decides every sequence's tokens from
its own rows' logits and commits them to its proposer.

How long each draft is: a draft token j deep in sequence i is kept with probability
alpha_i^j (its measured acceptance) and costs the step b seconds more (the slope of the step's
measured time over its rows) plus the drafter's time for one token. Starting from no drafts,
the planner adds the draft token with the most expected tokens per second while that beats the
step's rate so far (tokens / seconds). One sequence alone: a step's fixed cost (reading the
weights) dominates, extra rows are nearly free and drafts pay. Many sequences: every row
already emits a token, the rate nears 1 / b and a draft token pays only if alpha^j / (b + d)
beats it, so drafts shrink toward none as the batch grows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hetero_run.runtime.eagle3 import is_eagle3
from hetero_run.runtime.speculative.adaptive import DraftLength, _Line
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.factory import candidates, check_algorithm, make_proposer
from hetero_run.runtime.speculative.pairing import Pairing
from hetero_run.runtime.speculative.proposer import DraftSession, NoProposer
from hetero_run.runtime.speculative.round import RoundPlan
from hetero_run.runtime.speculative.selector import Selector
from hetero_run.runtime.speculative.verifier import RejectionSampler, read_emitted

log = logging.getLogger("hetero_run.runtime.engine.speculation")


@dataclass
class RoundRows:
    """The draft rows one sequence adds to a step, after its pending token (row 0)."""

    name: str  # the algorithm that drafted them
    k: int  # draft length asked for, in the algorithm's unit
    plan: RoundPlan
    draft_seconds: float
    parents: list[int] | None = None  # over row 0 and the drafts: a tree; None: a chain

    @property
    def ids(self) -> list[int]:
        return self.plan.draft_target_ids.tolist()

    @property
    def positions(self) -> list[int]:
        start = self.plan.start
        if self.parents is None:
            return list(range(start + 1, start + 1 + self.plan.k))
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return [start + d for d in depth[1:]]

    def paths(self, start: int) -> list[list[int]]:
        """Per row: the logical positions of its ancestors and itself, root first."""
        out: list[list[int]] = []
        for i, p in enumerate(self.parents):
            out.append((out[p] if p >= 0 else []) + [start + i])
        return out


@dataclass
class _SequenceRound:
    """One sequence's speculation state."""

    session: DraftSession
    verifier: RejectionSampler
    proposers: dict
    selector: Selector
    lengths: dict[str, DraftLength]
    slot: object = None  # the drafter slot it holds, if any
    first: bool = True  # the prompt's token is still to come


@dataclass
class _Candidate:
    index: int
    depth: int
    gain: float
    cost: float


class Speculation:
    def __init__(self, tokenizer, target_vocab: int, drafter=None, config: SpeculationConfig | None = None):
        self.drafter, self.target_vocab = drafter, target_vocab
        self.config = config or SpeculationConfig(algorithm="auto" if drafter is not None else "none")
        self.pairing = Pairing(tokenizer, drafter.tokenizer if drafter is not None else None, self.config.window)
        self.eagle3 = is_eagle3(drafter)
        check_algorithm(self.config.algorithm, drafter is not None, self.pairing.same_vocab, self.eagle3)
        self.free_slots = [drafter.model] if drafter is not None and self.config.algorithm != "none" else []
        self.step_cost = _Line()  # seconds of a step over its rows

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    # -- the step's cost ---------------------------------------------------------------------

    def measured_step(self, rows: int, seconds: float) -> None:
        self.step_cost.add(rows, seconds)

    def _row_cost(self, rows: int) -> float:
        """Seconds one more row adds to a step of `rows` rows."""
        return max(1e-6, self.step_cost(rows + 1, 0.0) - self.step_cost(rows, 0.0))

    # -- before a step -------------------------------------------------------------------------

    def plan(self, scheduled, scheduler) -> dict[int, RoundRows]:
        """Draft rows for the decoding sequences of this step, within its token budget and the free blocks."""
        budget = scheduler.max_num_batched_tokens - sum(item.rows for item in scheduled)
        blocks = scheduler.blocks
        rounds: dict[int, RoundRows] = {}
        wanted: dict[int, int] = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.speculation is None:
                self.start(seq)
            if self.eagle3 and seq.speculation.slot is not None:  # the head reads this sequence's target states
                seq.speculation.slot.bind(i, lambda seq=seq: seq.computed)
            if not item.decides or seq.pending != 1 or seq.speculation.first:
                continue
            state = seq.speculation
            name = state.selector.current()
            cap = min(seq.room - 1, scheduler_room(seq, blocks))
            k = 0 if name == "none" or cap <= 0 else min(state.lengths[name].next(), cap)
            wanted[i] = k
            rounds[i] = RoundRows(name, k, state.proposers["none"].empty(seq.computed), 0.0)
        sizes = self._sizes(scheduled, rounds, wanted, budget)
        for i, r in rounds.items():
            seq = scheduled[i].seq
            state = seq.speculation
            k = sizes.get(i, 0)
            if r.name == "none" or k == 0:  # this round decodes its pending token only
                rounds[i] = RoundRows("none", 0, state.proposers["none"].empty(seq.computed), 0.0)
                continue
            begin = time.perf_counter()
            plan = state.proposers[r.name].propose(k, seq.computed)
            limit = min(budget, scheduler_room(seq, blocks))
            if plan.k > limit:  # a proposer may draft more target tokens than units asked (slem)
                probs = plan.draft_probs
                if probs is not None:  # q for the kept drafts, then no proposal at the position after them
                    probs = torch.cat([probs[:limit], probs.new_zeros(1, probs.shape[1])])
                plan = RoundPlan(plan.draft_target_ids[:limit], probs, plan.start, plan.extras)
            blocks.grow(seq.table, seq.computed + 1 + plan.k)
            budget -= plan.k
            rounds[i] = RoundRows(r.name, k, plan, time.perf_counter() - begin)
        return rounds

    def _sizes(self, scheduled, rounds: dict[int, RoundRows], wanted: dict[int, int], budget: int) -> dict[int, int]:
        """Draft length per sequence: the most expected tokens per second for the step."""
        if len(rounds) <= 1 or not self.config.adaptive:  # one sequence: its own cost model already weighs
            out = {}                                           # drafts against the verify; fixed: as asked
            for i, k in wanted.items():
                out[i], budget = min(k, budget), budget - min(k, budget)
            return out
        rows = sum(item.rows for item in scheduled)
        tokens = float(sum(1 for item in scheduled if item.decides))
        seconds = self.step_cost(rows, 0.0)
        candidates_: list[_Candidate] = []
        for i, k in wanted.items():
            state = scheduled[i].seq.speculation
            lengths = state.lengths[rounds[i].name]
            alpha = min(lengths.alpha, 0.99)
            per_unit = lengths.draft.y.value / max(1.0, lengths.draft.x.value)
            for depth in range(1, k + 1):
                candidates_.append(_Candidate(i, depth, alpha ** depth, per_unit))
        sizes = dict.fromkeys(wanted, 0)
        # deeper tokens of one sequence come after its shallower ones: gains fall with depth
        candidates_.sort(key=lambda c: -c.gain / (c.cost + self._row_cost(rows)))
        for c in candidates_:
            if budget == 0:
                break
            if sizes[c.index] != c.depth - 1:
                continue
            cost = c.cost + self._row_cost(rows)
            if c.gain / cost <= tokens / max(seconds, 1e-9):
                break
            sizes[c.index] = c.depth
            tokens, seconds, rows, budget = tokens + c.gain, seconds + cost, rows + 1, budget - 1
        if any(sizes.values()) or wanted:
            log.debug("draft lengths for %d sequences: %s", len(wanted), sizes)
        return sizes

    # -- after a step ----------------------------------------------------------------------------

    def start(self, seq) -> None:
        """Give `seq` its proposers, verifier and, when one is free, the drafter's slot (before
        its first forward)."""
        config, pairing = self.config, self.pairing
        sampling = seq.request.sampling
        generator = None if sampling.greedy else sampling.generator()
        slot = self.free_slots.pop() if self.free_slots else None
        context = None
        prompt = seq.request.prompt
        if slot is not None:
            context = DraftContext(slot, pairing.drafter_retokenizer,
                                   prompt.for_drafter(pairing.drafter_tokenizer, pairing.target_tokenizer),
                                   pairing.same_vocab)
        session = DraftSession(pairing, context, seq.token_ids, self.target_vocab, sampling, generator)
        if context is None:
            names = ["none"]
        elif config.algorithm == "auto":
            names = candidates(True, pairing.same_vocab, sampling.greedy, self.eagle3)
        else:
            names = [config.algorithm]
        proposers = {n: make_proposer(n, session, config) for n in names}
        proposers.setdefault("none", NoProposer(session, config))
        selector = Selector(names, config, auto=config.algorithm == "auto" and len(names) > 1)
        lengths = {n: DraftLength(config, n) for n in proposers}
        seq.speculation = _SequenceRound(session, RejectionSampler(sampling, generator), proposers, selector, lengths,
                                         slot)

    def verify(self, seq, r: RoundRows | None, logits: torch.Tensor,
               verify_seconds: float) -> tuple[list[int], list[int]]:
        """logits [1 + drafts, vocab] of the sequence's rows -> (emitted target tokens, kept rows)."""
        state = seq.speculation
        if state.first:  # the prompt's last row decides the first token
            state.first = False
            n = len(seq.token_ids)
            emitted = read_emitted(state.verifier(RoundPlan(torch.empty(0, dtype=torch.long), None, n - 1), logits))
            state.proposers["none"].commit(RoundPlan(torch.empty(0, dtype=torch.long), None, n), emitted)
            if state.session.context is not None:
                state.session.context.catch_up()
            return emitted, [0]
        if r is None:
            r = RoundRows("none", 0, RoundPlan(torch.empty(0, dtype=torch.long), None, seq.computed), 0.0)
        emitted = read_emitted(state.verifier(r.plan, logits))  # the round's one host sync
        proposer = state.proposers[r.name]
        begin = time.perf_counter()
        kept = proposer.commit(r.plan, emitted)
        draft_seconds = r.draft_seconds + time.perf_counter() - begin
        state.lengths[r.name].record(r.k, kept, r.plan.k + 1, len(emitted), draft_seconds, verify_seconds)
        state.selector.record(r.name, len(emitted), draft_seconds + verify_seconds)
        return emitted, list(range(len(emitted)))

    def release(self, seq) -> None:
        """The sequence is done or preempted: its drafter slot returns."""
        state = seq.speculation
        if state is not None and state.slot is not None:
            if self.eagle3:
                state.slot.bind(-1, lambda: 0)  # no sequence: nothing recorded until the next one binds
            self.free_slots.append(state.slot)
        seq.speculation = None


def scheduler_room(seq, blocks) -> int:
    """Draft tokens the sequence's blocks (and the free ones) can hold after its pending token."""
    return seq.table.capacity(blocks.block_size) - (seq.computed + 1) + blocks.num_free * blocks.block_size
