"""The cost model: measured verify costs by row count, calibrated acceptance, and the round it
chooses (none, model-free, the drafter, the hybrid) from them."""

from __future__ import annotations

from itertools import pairwise

import pytest

from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.cost import CostModel, VerifyCost
from hetero_run.runtime.speculative.tree import MODEL, NGRAM

CONFIG = SpeculationConfig(auto_explore_every=1000)


def measured(step: float = 0.024, per_row: float = 0.004, draft_unit: float = 0.008) -> CostModel:
    cost = CostModel(CONFIG)
    for n in (1, 2, 4, 8, 16):
        for _ in range(5):
            cost.record_verify(n, step + per_row * (n - 1), tree=False)
    for k in (2, 4):
        for _ in range(5):
            cost.record_draft(k, draft_unit * k, 0, 0.0, k)
    return cost


def test_verify_cost_interpolates_and_extends_the_measured_rows():
    v = VerifyCost()
    v.record(1, 1.0)
    v.record(5, 2.0)
    assert v(3) == pytest.approx(1.5)
    assert v(9) == pytest.approx(3.0)  # along the fitted line
    assert VerifyCost()(4) > VerifyCost()(1) > 0  # before any measurement: the starting assumption


def test_verify_cost_never_prices_more_rows_below_fewer():
    v = VerifyCost()
    for rows, seconds in ((1, 0.034), (8, 0.060), (16, 0.110), (144, 1.084), (160, 1.069), (200, 1.082)):
        for _ in range(30 if rows <= 16 else 1):
            v.record(rows, seconds)
    estimates = [v(r) for r in range(1, 221)]
    extra = [b - a for a, b in pairwise(estimates)]
    assert all(e > 0 for e in extra)  # each extra row costs something
    assert all(b >= a - 1e-12 for a, b in pairwise(extra))  # and no less than the one before
    assert [v(r) for r in (1, 8, 200)] == pytest.approx([0.034, 0.060, 1.082])  # on the hull: kept
    assert 0.9 * 0.110 < v(16) <= 0.110  # above it (8 -> 16 rose faster than 16 -> 200): the hull's figure
    # the noisy counts between: no longer a flat stretch, every row priced at the rate from 8 to 200
    assert v(180) - v(170) == pytest.approx(10 * (1.082 - 0.060) / (200 - 8))
    # figures that rise at a rising rate are kept as measured
    w = VerifyCost()
    for rows in (1, 2, 5, 9, 16):
        w.record(rows, 0.02 + 0.001 * rows * rows)
    assert [w(r) for r in (1, 2, 5, 9, 16)] == pytest.approx([0.02 + 0.001 * r * r for r in (1, 2, 5, 9, 16)])


def test_tree_costs_follow_the_chain_figures_until_measured_and_below_their_rows():
    """A tree forward's estimate takes the chain's figures where it has none of its own: from
    the chain's latest records (not from what the chain said when it was first asked), and for
    fewer rows than any tree measured (a one-row round is a decode, whatever the tree line
    through larger, noisier counts would say when extended downwards)."""
    chain = VerifyCost()
    tree = VerifyCost(chain)
    assert tree(1) == pytest.approx(0.03)  # the starting assumption, asked before anything ran
    for _ in range(5):
        chain.record(1, 0.040)
        chain.record(5, 0.048)
    assert tree(1) == pytest.approx(0.040) and tree(5) == pytest.approx(0.048)
    for seconds in (0.060, 0.050):  # trees of 9 and 17 rows, noisy: their line falls steeply to 1 row
        tree.record(9, seconds)
        tree.record(17, seconds + 0.035)
    assert tree(1) == pytest.approx(0.040) and tree(2) == pytest.approx(chain(2))
    assert tree(9) == pytest.approx(0.055, rel=0.02) and tree(17) == pytest.approx(0.090, rel=0.02)
    rows = [tree(r) for r in range(1, 33)]
    assert all(b >= a for a, b in pairwise(rows))
    fast = VerifyCost(chain)
    fast.record(9, 0.030)  # trees measured cheaper than the chain's one row: never priced above them
    assert fast(1) == pytest.approx(0.030)


def _drafter_measured(acceptance: float, catch_up_s: float) -> CostModel:
    """A step of 40 ms + 2 ms a row, a drafter step of 5 ms, `catch_up_s` a token of backlog."""
    cost = CostModel(CONFIG, catch_up_s=catch_up_s)
    for n in (1, 2, 4, 8, 16):
        for _ in range(5):
            cost.record_verify(n, 0.040 + 0.002 * (n - 1), tree=False)
    for k in (2, 4):
        for _ in range(5):
            cost.record_draft(k, 0.005 * k, 0, 0.0, k)
    for i in range(200):  # accepted in that share of the rows, spread evenly
        cost.acceptance.record([[], [(MODEL, 0)]], [-1, 0], [0, 1] if i % 10 < acceptance * 10 else [0])
    return cost


def test_a_backlog_is_read_once_when_the_tokens_ahead_repay_it():
    """A drafter that wins every round once caught up, 300 tokens behind (a long prompt it never
    read): priced with the whole backlog no round looks worth it; auto reads it when what the
    sequence is likely still to emit saves the backlog's cost twice over, and not otherwise."""
    cost = _drafter_measured(acceptance=0.8, catch_up_s=0.0006)  # backlog: 0.18 s
    caught_up = cost.choose([], model=True, tree=True, pending=4, remaining=100)
    assert caught_up.k > 0 and caught_up.rate > 1.5 / 0.040  # well above the target alone
    behind = cost.choose([], model=True, tree=True, pending=300, remaining=100)
    assert behind.k > 0 and behind.seconds > 0.18  # read, and priced with the backlog
    assert cost.choose([], model=True, tree=True, pending=300, remaining=3).k == 0  # too few tokens ahead
    # an open-ended request (max_tokens far away) counts what it has emitted so far, 64 at least
    assert cost.choose([], model=True, tree=True, pending=300, remaining=10_000, generated=0).k > 0
    slow = _drafter_measured(acceptance=0.8, catch_up_s=0.003)  # backlog: 0.9 s, more than 64 tokens save
    assert slow.choose([], model=True, tree=True, pending=300, remaining=10_000, generated=10).k == 0
    assert slow.choose([], model=True, tree=True, pending=300, remaining=10_000, generated=2000).k > 0
    poor = _drafter_measured(acceptance=0.1, catch_up_s=0.0006)  # loses even when caught up
    assert poor.choose([], model=True, tree=True, pending=300, remaining=1000).k == 0


def test_no_candidates_and_a_poor_drafter_choose_the_target_alone():
    cost = measured(draft_unit=0.012)
    for _ in range(20):
        cost.acceptance.record([[], [(MODEL, 0)]], [-1, 0], [0])  # the drafter's rows are rejected
    choice = cost.choose([], model=True, tree=True)
    assert (choice.k, choice.m) == (0, 0)


def test_likely_model_free_candidates_are_verified_and_sized_by_cost():
    cost = measured()
    chain = [(d, 0.9 ** d) for d in range(1, 13)]
    choice = cost.choose(chain, model=False, tree=True)
    assert choice.k == 0 and 4 <= choice.m <= 12
    expensive = measured(per_row=0.02)
    assert expensive.choose(chain, model=False, tree=True).m < choice.m


def test_a_cheap_accurate_drafter_is_chosen_with_a_long_draft():
    cost = measured(draft_unit=0.0005)
    for _ in range(30):
        cost.acceptance.record([[], [(MODEL, 0)], [(MODEL, 0)]], [-1, 0, 1], [0, 1, 2])
    choice = cost.choose([], model=True, tree=True)
    assert choice.k >= 6


def test_calibrated_acceptance_replaces_the_prior():
    cost = CostModel(CONFIG)
    assert cost.acceptance.prob(NGRAM, 3) == pytest.approx(0.6)
    for _ in range(40):
        cost.acceptance.record([[], [(NGRAM, 3)]], [-1, 0], [0])
    assert cost.acceptance.prob(NGRAM, 3) < 0.05


def test_the_drafter_is_re_measured_every_explore_rounds():
    cost = measured(draft_unit=0.02)
    for _ in range(20):
        cost.acceptance.record([[], [(MODEL, 0)]], [-1, 0], [0])
    explorer = CostModel(SpeculationConfig(auto_explore_every=5))
    explorer.__dict__.update({k: v for k, v in cost.__dict__.items() if k != "config"})
    explorer.elapsed = 0.0
    assert not any(explorer.choose([], model=True, tree=True).k for _ in range(20)), "no time spent: no budget"
    explorer.elapsed = 100.0  # seconds measured: 2% of them may go to re-measuring
    picks = [explorer.choose([], model=True, tree=True).k for _ in range(20)]
    assert picks.count(0) >= 15 and any(picks)


def test_a_sequence_drafts_fewer_rows_the_more_sequences_share_its_steps():
    """A batched step's fixed cost (reading the weights) is split over its sequences and its
    per-row cost by rows (engine.speculation.Speculation.shares), so in a step of S sequences a
    sequence's own verify rows cost relatively more: the same candidates get fewer rows, and
    none once a row costs about what it is expected to bring."""
    from hetero_run.runtime.engine.speculation import Speculation
    from hetero_run.runtime.speculative.adaptive import _Line

    fixed, per_row = 0.024, 0.004  # a step: 24 ms of weights, 4 ms a row
    chain = [(d, 0.8 ** d) for d in range(1, 13)]
    rows = []
    for seqs in (1, 4, 16):
        planner = Speculation.__new__(Speculation)  # only its step-cost split is used here
        planner.step_cost = _Line()
        for per_seq in (1, 2, 3, 5):  # steps of `seqs` sequences, each with per_seq rows
            planner.step_cost.add(seqs * per_seq, fixed + per_row * seqs * per_seq)
        cost = CostModel(CONFIG)
        for n in (1, 2, 4, 8, 16):
            step_rows = [n] + [1] * (seqs - 1)  # this sequence verifies n rows, the others decode
            seconds = fixed + per_row * sum(step_rows)
            share = planner.shares(step_rows, seconds)[0]
            assert share == pytest.approx(fixed / seqs + per_row * n, rel=1e-3)
            for _ in range(5):
                cost.record_verify(n, share, tree=False)
        rows.append(cost.choose(chain, model=False, tree=True).m)
    assert rows[0] > rows[1] > rows[2], rows
    assert rows[2] <= 1, rows


def _step_seconds(rows: int) -> float:
    """A step: 40 ms of weights, 2 ms a row."""
    return 0.040 + 0.002 * (rows - 1)


def _step_planner():
    """engine.speculation.Speculation with only its step timing (no runner, tokenizer or drafter)."""
    from hetero_run.runtime.engine.speculation import ProposingOutcome, Speculation
    from hetero_run.runtime.speculative.adaptive import _Line, _Mean

    planner = Speculation.__new__(Speculation)
    planner.step_cost, planner.step_seconds = _Line(), VerifyCost()
    planner.drafts_per_round, planner.tokens_per_round = _Mean(0.0, 1e-9), _Mean(1.0, 1e-9)
    planner.outcome, planner.deciding, planner.step_drafted = ProposingOutcome(), 0, False
    return planner


def test_a_batched_sequence_prices_its_rows_from_the_step_it_joins():
    """engine.speculation: in a step of D deciding sequences bringing B rows without drafts, r
    verify rows cost a sequence t(B') / (1 + (D - 1) e) + t(B' + r - 1) - t(B'), from steps timed
    by their row count, B' = B + (D - 1) d counting the others' recent drafts (d rows, e tokens
    kept a round). Its own
    verify figures mix steps of every batch size: a figure measured for 8 rows when 8 rows ran
    among slower steps stays while no sequence drafts 8 rows again, and priced by it sequences
    draft short (a server at 4 clients chose the target alone with 0.92 acceptance that way)."""
    from hetero_run.runtime.engine.speculation import BATCH_MARGIN

    planner = _step_planner()
    for _ in range(3):
        for rows in range(1, 200):
            planner.measured_step(rows, _step_seconds(rows), rows)
    alone = planner.verify_estimate(1, 1)
    assert [alone(r) for r in (1, 5, 9)] == pytest.approx([_step_seconds(r) for r in (1, 5, 9)])
    four = planner.verify_estimate(4, 4)  # among others, extra rows carry the margin
    assert four(1) == pytest.approx(_step_seconds(4) / 4)
    assert four(8) == pytest.approx(_step_seconds(4) / 4 + (1 + BATCH_MARGIN) * (_step_seconds(11) - _step_seconds(4)))

    stale = CostModel(CONFIG)  # its own figures: a share of 13 ms for one row, 80 ms for eight
    for n, seconds in ((1, 0.013), (8, 0.080)):
        for _ in range(5):
            stale.record_verify(n, seconds, tree=False)
    chain = [(d, 0.9 ** d) for d in range(1, 13)]
    short = stale.choose(chain, model=False, tree=True).m
    rows = [stale.choose(chain, model=False, tree=True, verify=planner.verify_estimate(s, s)).m for s in (1, 4, 16)]
    assert rows[0] >= rows[1] > short, (rows, short)
    assert rows[1] > rows[2], rows

    # the others drafting 6 rows a round and keeping 5 tokens: the step without this sequence's
    # drafts has 16 + 15 * 6 rows and yields 1 + 15 * 5 tokens, a rate its rows must beat
    for _ in range(50):
        planner.measured_rounds([6] * 16, [5] * 16)
    crowded = planner.verify_estimate(16, 16)
    assert crowded(1) == pytest.approx(_step_seconds(106) / 76, rel=1e-3)
    assert crowded(4) == pytest.approx(_step_seconds(106) / 76 + (1 + BATCH_MARGIN) * (_step_seconds(109)
                                       - _step_seconds(106)), rel=1e-3)
    assert stale.choose(chain, model=False, tree=True, verify=crowded).m < rows[2], rows


def test_a_step_where_no_draft_can_pay_skips_proposing():
    """engine.speculation.drafts_can_pay: r rows can yield r tokens at most, so when r tokens in
    estimate(r) never beat one token in estimate(1), no proposal can be chosen and none is made."""
    from hetero_run.runtime.engine.speculation import BATCH_MARGIN, drafts_can_pay

    def planner_for(step_seconds):
        planner = _step_planner()
        for _ in range(3):
            for rows in range(1, 80):
                planner.measured_step(rows, step_seconds(rows), rows)
        return planner

    cheap = planner_for(_step_seconds)  # rows 2 ms over a 40 ms step: drafts pay alone and at 16
    assert drafts_can_pay(cheap.verify_estimate(1, 1), 17)
    assert drafts_can_pay(cheap.verify_estimate(16, 16), 17)
    # every row 6 ms and nothing fixed (a CPU step of 16 rows is all arithmetic): among others a
    # row costs (1 + margin) x 6 ms and yields at most the 6 ms token it stands for: nothing pays
    compute = planner_for(lambda rows: 0.006 * rows)
    assert not drafts_can_pay(compute.verify_estimate(16, 16), 17)
    assert BATCH_MARGIN > 0
    # alone the same rows tie at best (r tokens in r x 6 ms): not worth proposing either
    assert not drafts_can_pay(compute.verify_estimate(1, 1), 17)


def test_proposing_that_served_slower_stops_but_for_probes():
    """engine.speculation.ProposingOutcome: per band of deciding sequences (1, 2, 3-4, 5-8, 9-16),
    steps whose rounds proposed are compared with steps whose rounds did not, by seconds per
    emitted token; where the proposing ones were slower, proposing stops there, one step in
    PROBE_EVERY excepted."""
    from hetero_run.runtime.engine.speculation import ProposingOutcome

    outcome = ProposingOutcome()
    for _ in range(ProposingOutcome.MIN_STEPS - 1):
        outcome.record(16, True, 0.130, 16)  # 8.1 ms a token
        outcome.record(16, False, 0.112, 16)  # 7.0 ms a token
    assert outcome.pays(16) is None and outcome.allows(16), "not measured enough to judge"
    outcome.record(16, True, 0.190, 25)  # 7.6 ms a token: still slower
    outcome.record(16, False, 0.112, 16)
    assert outcome.pays(16) is False
    allowed = []
    for _ in range(3 * ProposingOutcome.PROBE_EVERY):
        allowed.append(outcome.allows(16))
        outcome.record(16, allowed[-1], 0.140 if allowed[-1] else 0.112, 16)
    probes = [i for i, allow in enumerate(allowed) if allow]
    # one plain step was recorded last: the first probe comes PROBE_EVERY steps after it, then every PROBE_EVERY
    assert probes[0] == ProposingOutcome.PROBE_EVERY - 2, allowed
    gaps = [b - a for a, b in zip(probes[:-1], probes[1:], strict=True)]
    assert gaps == [ProposingOutcome.PROBE_EVERY] * (len(probes) - 1), allowed
    assert outcome.allows(1) and outcome.pays(1) is None, "another count of sequences has its own figures"
    # 9-16 deciding sequences are one band (at 16 clients a step decides for 12-16 of them); 5-8 another
    assert outcome.pays(12) is False and outcome.pays(9) is False and outcome.pays(8) is None

    faster = ProposingOutcome()  # alone, drafts pay: proposing stays on
    for _ in range(2 * ProposingOutcome.MIN_STEPS):
        faster.record(1, True, 0.045, 3)
        faster.record(1, False, 0.025, 1)
    assert faster.pays(1) and all(faster.allows(1) for _ in range(40))
    for _ in range(30):  # the load changes: proposing's figure turns slower, and it stops
        faster.record(1, True, 0.080, 2)
    assert faster.pays(1) is False and not faster.allows(1)
    faster.record(1, False, 0.025, 1)
    assert not faster.allows(1)


def test_prompt_rows_lengthen_the_step_but_do_not_lower_the_rate_a_draft_must_beat():
    """engine.speculation.verify_estimate: beside P rows of prompt chunks, the seconds per token a
    draft must beat are the step's decoding's, t(B') / (1 + (D - 1) e); what r rows add is read
    at the whole step's size, t(B' + P + r - 1) - t(B' + P)."""
    from hetero_run.runtime.engine.speculation import BATCH_MARGIN

    planner = _step_planner()
    for _ in range(3):
        for rows in range(1, 200):
            planner.measured_step(rows, _step_seconds(rows), rows)
    plain, mixed = planner.verify_estimate(4, 4), planner.verify_estimate(4, 4, prompt_rows=80)
    assert mixed(1) == pytest.approx(plain(1)) == pytest.approx(_step_seconds(4) / 4)
    assert mixed(6) == pytest.approx(_step_seconds(4) / 4 + (1 + BATCH_MARGIN) * (_step_seconds(89)
                                     - _step_seconds(84)))
    # a convex step (rows cost more as the step grows): the same draft costs more beside the prompt
    convex = _step_planner()
    for _ in range(3):
        for rows in range(1, 200):
            convex.measured_step(rows, 0.04 + 0.002 * rows + 1e-5 * rows * rows, rows)
    assert convex.verify_estimate(4, 4, prompt_rows=80)(6) > convex.verify_estimate(4, 4)(6)


def test_a_long_slow_proposing_step_counts_by_its_length():
    """ProposingOutcome compares seconds over tokens: three short proposing steps at 5.5 ms a token
    and one of 900 ms serving 88 tokens (10.2 ms a token) serve slower together than plain steps at
    7 ms a token, although the mean of the four steps' own figures (6.7 ms) is below 7."""
    from hetero_run.runtime.engine.speculation import ProposingOutcome

    outcome = ProposingOutcome()
    for _ in range(ProposingOutcome.MIN_STEPS):
        outcome.record(16, False, 0.112, 16)
    steps = [(0.088, 16)] * 3 + [(0.900, 88)]
    for seconds, tokens in steps:
        outcome.record(16, True, seconds, tokens)
    assert sum(s / t for s, t in steps) / len(steps) < 0.007
    assert outcome.seconds_per_token(16, True) > outcome.seconds_per_token(16, False) == pytest.approx(0.007)
    assert outcome.pays(16) is False
