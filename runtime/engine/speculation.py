"""Speculation per sequence inside the batching engine, sized for the whole step.

Each running request has its own round state (`speculative.sequence.SpeculativeSequence`: its
drafter view, prompt-lookup index, suffix state, verifier and random stream); what they all
learn from lives in one `SpeculativeEngine` (the cost model, draft lengths, the shared suffix
cache) and the drafter's sequence slots are handed out here. Before a step each decoding
sequence proposes its rows (`plan`); after it, each verifies its own rows' logits and commits
(`verify`), exactly the round the one-sequence driver runs.

How much to draft: each sequence's cost model weighs expected tokens against measured cost,
and the cost it is told comes from the step it joins. Steps of decode and verify rows only (no
prompt chunk: a prompt row skips the lm_head and the verifier and would read as a cheap verify
row) are timed by their rows: t(R), per row count R, from the planning of the step's rounds to
the last commit, estimated rising and convex from the measured means (`VerifyCost`). In a step
whose decode rows without drafts are B, beside P rows of prompt chunks, where the D - 1 other
deciding sequences draft d rows and keep e tokens a round as they have lately (exponentially
weighted means over the steps), the step's decoding without this sequence's drafts has
B' = B + (D - 1) d rows and yields 1 + (D - 1) e tokens, and r verify rows cost this sequence

    t(B') / (1 + (D - 1) e) + m (t(B' + P + r - 1) - t(B' + P))

the seconds per token of the step's decoding plus what its extra rows add to the whole step
(m = 1 alone, 1 + BATCH_MARGIN among others, for what the step's time does not show). The cost model's choice
(the most expected tokens per second) then drafts exactly when the tokens its rows add per second
they add beat the step's own rate, the rule that maximises the step's output. Alone (D = 1,
B = 1) that is t(r), the step of r rows: the first row pays for reading every weight and a few
more are nearly free, so drafts pay; among many, every extra row costs compute (from about five
rows on the CPU) and must beat a rate the others' tokens already raise, so drafts shrink toward
none as the batch grows, and when not even r accepted rows drafted for nothing would pay
(`drafts_can_pay`) the step's sequences skip proposing.

Counting the others' drafts matters: priced as if they did not draft, every sequence at 16
clients added rows at about half what they cost once all of them did, and the server served less
than without drafts. Each plan uses the table as measured up to that
step, so a row count measured once under other load is corrected as soon as steps of that size
run again. Each sequence is still handed its share of the forward (`shares`: a fixed part
evenly, the rest by rows, from a line fitted to forward times): its reported verify seconds and
the draft lengths of a fixed algorithm (`DraftLength`) are measured in those.

The pricing is an estimate, and among many sequences it sits near break-even: at 16 clients a
CPU step's rows all cost arithmetic, so a draft row is worth at most the token it may keep, and
proposing itself costs time (16 sequences' proposers, the drafter's forwards). Estimates a few
per cent off there drafted steps that served fewer tokens a second than plain ones (TP=2, 16
clients: a proposing step of 26 rows served its tokens at the plain steps' rate, longer ones
below it). So what proposing did is measured too (`ProposingOutcome`): per count of deciding
sequences (in bands: 1, 2, 3-4, 5-8, 9-16, ...), the seconds per emitted token of steps whose
rounds drafted against those of steps whose rounds did not; where drafting has served slower,
its steps stop proposing (prompt chunks or not) until `PROBE_EVERY` steps have passed without a
draft, which keeps the figure current as the load changes. (It compared steps allowed to propose
with steps that were not, until a Zen 5 host at 16 clients showed why not: nearly every step was
allowed there, the cost model drafted in few of them, and those few served 4.35 ms a token
against the plain steps' 2.7 with nothing to compare them with: docs/serve.md.)

The step table is re-measured only where steps run: alone, once it prices extra rows too high
(one 3-row step of a server's warm-up measured at 99 ms against 35 for one row, and the line
through them priced 8 rows at 260 ms), no round drafts, no step of several rows runs again, and
the figure never heals (a server served 1.3x the target alone at one client instead of 2.4-3.2x).
So with at most two deciding sequences (`EXPLORE_BANDS`), after `PROBE_EVERY` steps without a
draft row, one step prices extra rows at the prior's share of a row (`PRIOR_ROW_SHARE` of the
one-row step each), which lets a round draft and the table measure several rows again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.engine.lockstep import Lockstep
from hetero_run.runtime.speculative.adaptive import _Line, _Mean
from hetero_run.runtime.speculative.config import MODEL_FREE, SpeculationConfig
from hetero_run.runtime.speculative.cost import PRIOR_ROW_SHARE, VerifyCost
from hetero_run.runtime.speculative.round import RoundPlan, Verdict

log = logging.getLogger("hetero_run.runtime.engine.speculation")

# Among other sequences, extra verify rows are charged this much more than the step time they
# add: longer steps also delay what the step's accounting does not see (the next requests'
# prefill, the turnover of finishing ones); at 16 clients a tie by that accounting served less.
BATCH_MARGIN = 0.25
EXPLORE_BANDS = (1, 2)  # load bands (`load_band`) in which a step without drafts for long re-prices rows


def load_band(deciding: int) -> int:
    """The band of a count of deciding sequences: 1, 2, then 3-4, 5-8, 9-16, ... (named by their
    top). Sequences come and go between steps, so at 16 clients a step decides for 12 to 16 of
    them: one band pools what those steps measured."""
    return 1 << max(0, deciding - 1).bit_length()


class ProposingOutcome:
    """Seconds per emitted token of decode-and-verify steps (their seconds over their tokens), by
    the band of how many sequences decided in the step (`load_band`) and whether their rounds
    drafted (`proposed`: verified draft rows): proposing stays on in a band unless both are
    measured (`MIN_STEPS` each) and the drafting steps were the slower."""

    MIN_STEPS = 4
    PROBE_EVERY = 16  # while proposing is off in a band, it may propose again after this many steps without a draft

    def __init__(self):
        self.seconds: dict[tuple[int, bool], _Mean] = {}
        self.tokens: dict[tuple[int, bool], _Mean] = {}
        self.steps: dict[tuple[int, bool], int] = {}
        self.since_proposing: dict[int, int] = {}
        self.without_drafts: dict[int, int] = {}  # band -> its steps since one verified draft rows

    def record(self, deciding: int, proposed: bool, seconds: float, tokens: int) -> None:
        if deciding < 1 or tokens < 1:
            return
        band = load_band(deciding)
        key = (band, proposed)
        self.seconds.setdefault(key, _Mean()).add(seconds)
        self.tokens.setdefault(key, _Mean()).add(tokens)
        self.steps[key] = self.steps.get(key, 0) + 1
        self.since_proposing[band] = 0 if proposed else self.since_proposing.get(band, 0) + 1

    def drafted(self, deciding: int, any_rows: bool) -> None:
        """A step's rounds (prompt chunks or not) verified draft rows, or none."""
        band = load_band(deciding)
        self.without_drafts[band] = 0 if any_rows else self.without_drafts.get(band, 0) + 1

    def explores(self, deciding: int) -> bool:
        """Alone or with one other (`EXPLORE_BANDS`), after PROBE_EVERY steps without a draft row:
        this step re-prices rows (see the module's docstring). Starts the count again."""
        band = load_band(deciding)
        if band not in EXPLORE_BANDS or self.without_drafts.get(band, 0) < self.PROBE_EVERY:
            return False
        self.without_drafts[band] = 0
        return True

    def seconds_per_token(self, deciding: int, proposed: bool) -> float:
        """The steps' seconds over their tokens (weighted means of each) in this count's band: a
        step counts by its length, so one 900 ms step that served 95 tok/s outweighs several short ones."""
        key = (load_band(deciding), proposed)
        return self.seconds[key].value / self.tokens[key].value

    def pays(self, deciding: int) -> bool | None:
        """Whether proposing served tokens faster in this count's band; None until both are measured."""
        band = load_band(deciding)
        if min(self.steps.get((band, p), 0) for p in (True, False)) < self.MIN_STEPS:
            return None
        return self.seconds_per_token(deciding, True) < self.seconds_per_token(deciding, False)

    def allows(self, deciding: int) -> bool:
        """Whether this step's rounds may propose (the cost model still decides what)."""
        if self.pays(deciding) is not False:
            return True
        return self.since_proposing.get(load_band(deciding), 0) + 1 >= self.PROBE_EVERY

    def summary(self, deciding: int) -> str:
        band, parts = load_band(deciding), []
        for proposed, name in ((True, "drafting"), (False, "plain")):
            measured = (band, proposed) in self.steps
            parts.append(f"{name} {self.seconds_per_token(deciding, proposed) * 1e3:.2f} ms/token over "
                         f"{self.steps[band, proposed]} steps" if measured else f"{name} unmeasured")
        return f"{band // 2 + 1}-{band} deciding: " + ", ".join(parts) if band > 2 else ", ".join(parts)


def drafts_can_pay(estimate, max_rows: int) -> bool:
    """Whether any round of 2..max_rows verify rows could yield more tokens per second than one row
    in this step, were every row accepted and drafted for nothing: r tokens in estimate(r) seconds
    against one in estimate(1). No draft can do better than that, so when none of them can pay, the
    step's rounds skip proposing altogether (16 sequences' proposers and cost model: 1.5 ms of a
    120 ms step at TP=1, 35 ms of 140 at TP=2 with debug logging, whose summaries they format)."""
    one = estimate(1)
    return any(r * one > estimate(r) * (1 + 1e-9) for r in range(2, max_rows + 1))  # a tie does not pay


class DrafterSlots:
    """The drafter's per-sequence views: slots of its network (drafters.network / hf), else its
    one model (an EAGLE-3 head), lent to one sequence at a time."""

    def __init__(self, drafter):
        self.network = getattr(drafter, "network", None) if drafter is not None else None
        self.model = None
        if drafter is not None:
            self.model = self.network if self.network is not None else drafter.model
        self.lent = False  # the one model, when there is no network
        self.lockstep = Lockstep(self.network) if self.network is not None else None

    @property
    def free(self) -> int:
        if self.model is None:
            return 0
        if self.network is not None:
            return self.network.free_slots
        return 0 if self.lent else 1

    def acquire(self):
        """A view for one sequence, or None when none is free."""
        if self.free == 0:
            return None
        if self.network is not None:
            return self.lockstep.view(self.network.view(self.network.acquire()))
        self.lent = True
        return self.model

    def release(self, view) -> None:
        if self.network is not None:
            self.network.release(view.slot)  # a LockstepView or the plain view: the same slot
        else:
            self.lent = False


@dataclass
class _Round:
    plan: RoundPlan
    before: int  # generated tokens before the round


class Speculation:
    def __init__(self, runner, tokenizer, drafter=None, config: SpeculationConfig | None = None):
        config = config or SpeculationConfig(algorithm="auto" if drafter is not None else "none")
        self.shared = SpeculativeEngine(runner, tokenizer, drafter, config)
        self.config = config
        self.slots = DrafterSlots(drafter if config.algorithm not in ("none", *MODEL_FREE) else None)
        self.views: dict[int, object] = {}  # sequence number -> its drafter view
        self.step_cost = _Line()  # a step's seconds over its rows
        self.step_seconds = VerifyCost()  # a step's seconds by its row count
        self.drafts_per_round = _Mean(0.0, 1e-9)  # draft rows a deciding sequence verified lately
        self.tokens_per_round = _Mean(1.0, 1e-9)  # and the tokens it kept
        self.outcome = ProposingOutcome()
        self.deciding = 0  # the step being run: how many of its sequences decide a round
        self.step_drafted = False  # whether the step being run verified draft rows

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    @property
    def eagle3(self) -> bool:
        return self.shared.eagle3

    @property
    def free_slots(self) -> int:
        return self.slots.free

    # -- the step's cost -------------------------------------------------------------------------

    def measured_forward(self, rows: int, seconds: float) -> None:
        """The target forward of a step (what `shares` splits)."""
        self.step_cost.add(rows, seconds)

    def measured_step(self, rows: int, seconds: float, tokens: int) -> None:
        """A whole step of decode and verify rows that emitted `tokens`: the rounds' planning
        (proposers, drafter), the forward, verifying and committing every sequence's rows (what
        the step pricing charges, and what proposing did)."""
        self.step_seconds.record(rows, seconds)
        self.outcome.record(self.deciding, self.step_drafted, seconds, tokens)

    def measured_rounds(self, draft_rows: list[int], kept: list[int]) -> None:
        """A step's rounds: each deciding sequence's draft rows and the tokens it kept."""
        self.step_drafted = any(draft_rows)
        if draft_rows:
            self.drafts_per_round.add(sum(draft_rows) / len(draft_rows))
            self.tokens_per_round.add(sum(kept) / len(kept))
            self.outcome.drafted(len(draft_rows), any(draft_rows))

    def verify_estimate(self, base_rows: int, deciding: int, prompt_rows: int = 0):
        """Seconds that r verify rows cost one of `deciding` sequences in a step whose decode rows
        without drafts are `base_rows`, beside `prompt_rows` rows of prompt chunks, the others
        drafting as they have lately: the seconds per token of the step's decoding without this
        sequence's drafts, plus what its extra rows add to the whole step.

        Prompt rows make the step longer but bring no token now (their worth is the tokens
        their sequences will decode): counted in the rate a draft must beat, they priced it as
        if the step served a token every few hundred ms, and at 16 clients a new request's first
        round then chose the drafter with its whole prompt to catch up (350-470 ms of planning
        in a step of 16 sequences). They count where they belong: in the step's size, which
        sets what extra rows add."""
        t = self.step_seconds
        others = deciding - 1
        rows0 = base_rows + round(others * self.drafts_per_round.value)
        per_token = t(rows0) / (1 + others * self.tokens_per_round.value)
        total = rows0 + prompt_rows
        base = t(total)
        extra = 1.0 + (BATCH_MARGIN if others else 0.0)
        return lambda rows: per_token + extra * max(0.0, t(total + rows - 1) - base)

    def shares(self, rows: list[int], seconds: float) -> list[float]:
        """The step's seconds split over its sequences: the fixed part evenly, the rest by rows."""
        total = sum(rows)
        fixed = min(seconds, max(0.0, self.step_cost(0, seconds / max(1, total))))
        per_row = (seconds - fixed) / max(1, total)
        return [fixed / len(rows) + per_row * r for r in rows]

    # -- a sequence's life ---------------------------------------------------------------------

    def admit(self, seq) -> None:
        """`seq` runs for the first time: its round state, and a drafter slot when one is free."""
        if seq.speculation is not None:
            return  # readmitted after a preemption: its state goes on
        request = seq.request
        view = self.slots.acquire() if self.slots.model is not None else None
        if view is not None:
            self.views[seq.number] = view
        state = self.shared.sequence(request.prompt, request.max_new_tokens, request.sampling,
                                     stop_ids=set(request.stop_ids),
                                     drafter_model=view if view is not None else (False if self.slots.model else None))
        seq.token_ids = state.target_ids  # one list: the round state appends what the target emits
        seq.speculation = state
        if self.eagle3 and view is not None:
            view.bind(-1, lambda: 0)

    def release(self, seq) -> None:
        """The sequence is done: its drafter slot returns, the suffix cache learns its text."""
        state = seq.speculation
        if state is not None and getattr(state, "session", None) is not None:
            state.finish()
        view = self.views.pop(seq.number, None)
        if view is not None:
            if self.eagle3:
                view.bind(-1, lambda: 0)
            self.slots.release(view)
        seq.speculation = None

    # -- before a step -------------------------------------------------------------------------

    def plan(self, scheduled, scheduler) -> dict[int, _Round]:
        """Rounds for the sequences whose next token this step decides, within the step's token
        budget and the free blocks (a sequence still prefilling decides nothing). Their drafter
        forwards run together (lockstep.py)."""
        blocks = scheduler.blocks
        deciding = []
        for i, item in enumerate(scheduled):
            seq = item.seq
            self.admit(seq)
            view = self.views.get(seq.number)
            if self.eagle3 and view is not None:  # the head reads this sequence's target states
                view.bind(i, lambda seq=seq: seq.computed)
            if item.decides and getattr(seq.speculation, "session", None) is not None:
                deciding.append(i)  # not a prompt chunk, nor the prompt's last row (`first` decides that one)
        self.deciding, self.step_drafted = len(deciding), False
        if not deciding:
            return {}
        step_rows = sum(item.rows for item in scheduled)
        base_rows = sum(scheduled[i].rows for i in deciding)  # the rest are prompt chunks
        budget = scheduler.max_num_batched_tokens - step_rows
        # rows each may add past its own blocks: whole free blocks each, within the step's budget
        share = min(budget // len(deciding), blocks.num_free // len(deciding) * blocks.block_size)
        estimate = self.verify_estimate(base_rows, len(deciding), step_rows - base_rows)
        explore = self.outcome.explores(len(deciding))
        if explore:
            one = estimate(1)
            estimate = lambda rows: one * (1 + PRIOR_ROW_SHARE * (rows - 1))  # noqa: E731
            log.debug("%d deciding sequences: %d steps without a draft row; this one prices rows at the prior's "
                      "share", len(deciding), ProposingOutcome.PROBE_EVERY)
        can_pay = drafts_can_pay(estimate, self.shared.config.max_verify_rows)
        if can_pay and not explore and not self.outcome.allows(len(deciding)):
            can_pay = False
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%d deciding sequences: not proposing, drafting served slower (%s)", len(deciding),
                          self.outcome.summary(len(deciding)))
        for i in deciding:
            item = scheduled[i]
            item.seq.speculation.verify_estimate = estimate
            item.seq.speculation.drafts_can_pay = can_pay
            own = item.seq.table.capacity(blocks.block_size) - (item.seq.computed + item.rows)
            item.seq.speculation.room_cap = 1 + (own + share if item.rows == 1 else 0)  # a recompute: one token
        run = self.slots.lockstep.run if self.slots.lockstep is not None else (lambda jobs: [j() for j in jobs])
        plans = run([scheduled[i].seq.speculation.propose for i in deciding])
        rounds: dict[int, _Round] = {}
        for i, plan in zip(deciding, plans, strict=True):
            seq = scheduled[i].seq
            blocks.grow(seq.table, seq.computed + scheduled[i].rows + plan.k)
            rounds[i] = _Round(plan, len(seq.speculation.token_ids))
        return rounds

    # -- after a step --------------------------------------------------------------------------

    def first(self, seq, logits) -> list[int]:
        """The prompt's last row [1, vocab] -> the first tokens the sequence emits."""
        state = seq.speculation
        state.start(logits, catch_up=False)  # the drafter reads the prompt when it first drafts
        return list(state.token_ids)

    def verify(self, seq, r: _Round, logits, seconds: float) -> tuple[Verdict, list[int]]:
        """The round's rows' logits [1 + k, vocab] -> (the verdict, the tokens it emits)."""
        state = seq.speculation
        verdict = state.verify(logits)
        state.commit(verdict, seconds)
        return verdict, state.token_ids[r.before:]

