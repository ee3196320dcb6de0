"""The cost model behind `auto` and the model-free tree sizes: measured seconds and measured
acceptance -> the round with the most expected tokens per second.

A round may verify any of: nothing (the target alone, one row), the model-free candidates
(prompt lookup and suffix tree, the most likely m nodes), the model drafter's chain of k units,
or both in one tree (the hybrid). For each choice

    expected tokens  E = 1 + sum over depths d of (A_d + B_d - A_d * B_d)
    expected seconds C = draft(k) + catch_up(pending) [when k > 0] + verify(rows)

A_d = a^d is the chance that the drafter's chain is still right at depth d (a: its measured
per-row acceptance), B_d the summed reach of the chosen model-free nodes at depth d (each
node's reach is the product of the calibrated acceptance estimates on its path); the two are
treated as independent guesses. Rows are 1 + rows(k) + m in a tree, 1 + max(rows(k), m) when
the target verifies chains only. Every figure is measured as the rounds run:

- verify(n): the seconds of each target forward by its row count (exponentially weighted per n,
  made rising and convex in n, interpolated between counts, beyond them extended along the
  fitted line; `VerifyCost`);
- draft(k) = d0 + d1 k, catch-up seconds per drafter token, target rows per drafted unit;
- acceptance per (proposer, bucket): the share of tested rows that were accepted, a row being
  tested when the walk reached its parent; buckets are the match length (prompt lookup) and
  tenths of the count estimate (suffix tree), so the estimates are calibrated, not trusted.

The drafter reads what it has not seen before it drafts (`pending`: the prompt, the first time;
the tokens of rounds it sat out), at its measured seconds per token. A long backlog is paid once
and every later round drafts from there, so when the drafter would win a round with its backlog
read (STEADY_PENDING tokens behind), the model reads the backlog as soon as what the tokens the
sequence is likely still to emit save at that rate covers it CATCH_UP_MARGIN times over: a round
priced with the whole backlog never looks worth it, and the drafter would never run on long prompts.

A drafter the model does not pick is re-measured every `auto_explore_every` rounds, while
what these rounds are expected to lose stays under EXPLORE_SHARE of the time measured so far
and of what the sequence has still to emit at the best rate (its first catch-up reads the whole
prompt, so on a short run that rule alone would never let it be measured).
Until the first measurements the model starts from a 30 ms step, rows costing 15% of a step and
60% acceptance; the first rounds replace them. The search is exhaustive over k and m (one
incremental pass per k), well under a millisecond for the usual sizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import pairwise

from hetero_run.runtime.speculative.adaptive import _Line, _Mean
from hetero_run.runtime.speculative.tree import MODEL, SUFFIX

log = logging.getLogger("hetero_run.runtime.speculative.cost")

PRIOR_STEP_S = 0.03
PRIOR_ROW_SHARE = 0.15
PRIOR_ACCEPT = 0.6
PRIOR_CATCH_UP_S = 0.01  # pessimistic until measured: the first re-measurement reads the whole prompt
EXPLORE_SHARE = 0.02  # re-measuring a drafter auto does not pick may cost this share of the time at most
STEADY_PENDING = 8  # tokens a drafter that drafts round after round reads before each draft, about
CATCH_UP_HORIZON = 64  # tokens a sequence is taken to go on for at least (more once it has emitted more)
CATCH_UP_MARGIN = 2.0  # a backlog is read when the tokens ahead save this many times its cost


def _cross(a: tuple[float, float], b: tuple[float, float], c: tuple[float, float]) -> float:
    """> 0 when a, b, c turn counter-clockwise (b lies below the line from a to c)."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


class VerifyCost:
    """Seconds of a target forward of n rows.

    A forward's time never falls as its rows grow, and what one more row adds never shrinks (the
    first rows ride on reading the weights, later ones pay for their arithmetic). Measured means
    need not show either: a row count measured once or twice under other load can read below a
    smaller one (at 16 clients, steps of 144 rows were measured at 1084 ms, of 160 rows at 1069 ms
    and of 200 at 1082 ms), and differences read from such figures price extra rows at nothing.
    So the estimate follows the measured means made rising (adjacent counts pooled, weighted by
    their samples, where the means fall) and then convex (the lower convex hull of those points):
    measured figures that already rise at a rising rate are kept as they are.
    """

    def __init__(self, fallback: VerifyCost | None = None):
        self.by_rows: dict[int, _Mean] = {}
        self.line = _Line()
        self.fallback = fallback  # tree forwards: the chain figures where their own are missing
        self.records = 0
        self._table: dict[int, float] = {}
        self._fallback_records = 0  # the fallback's records when the table was made
        self._points: list[tuple[float, float]] = []

    def record(self, rows: int, seconds: float) -> None:
        self.by_rows.setdefault(rows, _Mean()).add(seconds)
        self.line.add(rows, seconds)
        self.records += 1
        self._table.clear()
        self._points = []

    @property
    def measured(self) -> bool:
        return bool(self.by_rows)

    def __call__(self, rows: int) -> float:
        if self.fallback is not None and self.fallback.records != self._fallback_records:
            self._table.clear()  # estimates made from the fallback's older figures
            self._fallback_records = self.fallback.records
        value = self._table.get(rows)
        if value is None:
            value = self._table[rows] = self._estimate(rows)
        return value

    def _pooled(self) -> list[tuple[float, float]]:
        """(row count, seconds) points rising at a rising rate, from the measured means: adjacent
        counts pooled where the means fall (weighted by each count's samples), then the lower
        convex hull of the pooled points."""
        if not self._points:
            blocks: list[list[float]] = []  # [sum of weight * rows, sum of weight * seconds, weight]
            for n in sorted(self.by_rows):
                mean = self.by_rows[n]
                blocks.append([mean.weight * n, mean.weight * mean.value, mean.weight])
                while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
                    last = blocks.pop()
                    for i in range(3):
                        blocks[-1][i] += last[i]
            hull: list[tuple[float, float]] = []
            for x, y, w in blocks:
                point = (x / w, y / w)
                while len(hull) > 1 and _cross(hull[-2], hull[-1], point) <= 0:
                    hull.pop()  # hull[-1] lies on or above the line from hull[-2] to this point
                hull.append(point)
            self._points = hull
        return self._points

    def _estimate(self, rows: int) -> float:
        if not self.by_rows:
            if self.fallback is not None and self.fallback.measured:
                return self.fallback(rows)
            return PRIOR_STEP_S * (1 + PRIOR_ROW_SHARE * (rows - 1))
        points = self._pooled()
        if rows < points[0][0] and self.fallback is not None and self.fallback.measured:
            # fewer rows than any measured here (a tree round that verifies one row is a decode):
            # the fallback's figure, never above the fewest rows measured here; the line through
            # noisy larger counts, extended downwards, can price one row at half a decode
            return min(self.fallback(rows), points[0][1])
        for (x0, y0), (x1, y1) in pairwise(points):
            if x0 <= rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        if len(points) > 1:  # beyond them: the fitted line's slope, else the nearest segment's
            line = self.line(2.0, 0.0) - self.line(1.0, 0.0)
            (x0, y0), (x1, y1) = points[:2] if rows < points[0][0] else points[-2:]
            slope = line if line > 0 else (y1 - y0) / (x1 - x0)
        else:
            slope = PRIOR_ROW_SHARE * points[0][1]
        x, y = points[0] if rows < points[0][0] else points[-1]
        return max(1e-6, y + slope * (rows - x))


class Acceptance:
    """Measured conditional acceptance per (proposer, bucket)."""

    def __init__(self):
        self.cells: dict[tuple[int, int], _Mean] = {}

    def prob(self, source: int, bucket: int, raw: float = PRIOR_ACCEPT) -> float:
        cell = self.cells.get((source, bucket))
        if cell is not None:
            return cell.value
        if source == SUFFIX:  # the count estimate, until measured
            return raw
        return PRIOR_ACCEPT

    def record(self, cells_by_row: list[list[tuple[int, int]]], parents: list[int], path: list[int]) -> None:
        """Every row whose parent the walk reached was tested: accepted when on the path."""
        on_path = set(path)
        for row in range(1, len(parents)):
            if parents[row] in on_path:
                accepted = 1.0 if row in on_path else 0.0
                for cell in cells_by_row[row]:
                    mean = self.cells.get(cell)
                    if mean is None:
                        mean = self.cells[cell] = _Mean(self.prob(*cell), 2.0)
                    mean.add(accepted)


@dataclass(frozen=True)
class Choice:
    k: int  # drafter units (0: the drafter does not run)
    m: int  # model-free nodes, the most likely first
    expected: float  # tokens this round is expected to emit
    seconds: float  # what it is expected to cost
    rows: int  # target rows it verifies

    @property
    def rate(self) -> float:
        return self.expected / self.seconds

    def label(self, model: str) -> str:
        if self.k and self.m:
            return f"hybrid {model} k={self.k} + model-free m={self.m}"
        if self.k:
            return f"{model} k={self.k}"
        return f"model-free m={self.m}" if self.m else "none"


class CostModel:
    """What one engine measured (kept from prompt to prompt, per sampling mode)."""

    def __init__(self, config, catch_up_s: float | None = None):
        """`catch_up_s`: drafter seconds per token of a prompt read, measured when the engine started
        (the prior until catch-ups are measured; PRIOR_CATCH_UP_S without it)."""
        self.config = config
        self.verify = VerifyCost()
        self.tree_verify = VerifyCost(self.verify)
        self.acceptance = Acceptance()
        self.draft = _Line()  # drafter seconds (catch-up excluded) over units drafted
        self.catch_up = _Mean(catch_up_s or PRIOR_CATCH_UP_S, 0.5)  # drafter seconds per caught-up token
        self.rows_per_unit = _Mean(1.0, 1.0)  # target rows per drafted unit (slem: per drafter token)
        self.modelfree_seconds = _Mean(0.0, 1e-9)
        self.rounds = 0
        self.last_model_round = -10**9
        self.elapsed = 0.0  # seconds of every round measured
        self.explore_loss = 0.0  # what re-measuring the drafter was expected to cost, in seconds

    # -- measurements ---------------------------------------------------------------------------
    def record_verify(self, rows: int, seconds: float, tree: bool) -> None:
        (self.tree_verify if tree else self.verify).record(rows, seconds)
        self.elapsed += seconds

    def record_round(self, draft_seconds: float) -> None:
        self.elapsed += draft_seconds

    def record_draft(self, k: int, seconds: float, catch_up_tokens: int, catch_up_seconds: float,
                     rows: int) -> None:
        if k <= 0:
            return
        self.draft.add(k, max(0.0, seconds - catch_up_seconds))
        if catch_up_tokens > 0:
            self.catch_up.add(catch_up_seconds / catch_up_tokens)
        self.rows_per_unit.add(rows / k)
        self.last_model_round = self.rounds

    def draft_seconds(self, k: int, pending: int) -> float:
        if k <= 0:
            return 0.0
        slope = self.draft.y.value / max(1.0, self.draft.x.value) if self.draft.x.weight > 0.5 else 0.3 * PRIOR_STEP_S
        return self.draft(k, slope) + self.catch_up.value * pending

    # -- the choice -----------------------------------------------------------------------------
    def choose(self, modelfree: list[tuple[int, float]], model: bool, tree: bool, pending: int = 0,
               k_range: tuple[int, int] | None = None, allow_none: bool = True, max_rows: int = 32,
               verify=None, remaining: int = 0, generated: int = 0) -> Choice:
        """modelfree: (depth, reach) of the model-free nodes in the order they would be added
        (most likely first, parents before children); model: the drafter may run, with k in
        k_range (default min_draft_len..max_draft_len, or not at all); pending: tokens the drafter
        must read before it drafts; verify: seconds of n verify rows when the caller knows better
        than this model's forwards (a batching engine: the sequence's share of its step);
        remaining: tokens the sequence may still emit (what re-measuring the drafter may cost
        counts them at the best rate); generated: tokens it has emitted (with remaining, how long
        it is likely to go on, which a backlog read is weighed against)."""
        self.rounds += 1
        v = verify or (self.tree_verify if tree else self.verify)  # seconds by rows
        best, best_model = self._search(modelfree, model, tree, pending, k_range, allow_none, max_rows, v)
        ahead = min(remaining, max(CATCH_UP_HORIZON, generated))  # tokens it is likely still to emit
        steady = min(pending, STEADY_PENDING)
        if model and best.k == 0 and pending > steady and ahead > 0:
            # Catching the drafter up on a long backlog (a prompt it never read) is paid once, and
            # every later round drafts from there: a round priced with the whole backlog never
            # looks worth it. Price the drafter as it runs once caught up; pay the backlog when
            # what the remaining tokens save at that rate covers it CATCH_UP_MARGIN times.
            caught_up, _ = self._search(modelfree, model, tree, steady, k_range, allow_none, max_rows, v)
            if caught_up.k and caught_up.rate > best.rate:
                backlog = self.catch_up.value * (pending - steady)
                saving = ahead * (1.0 / best.rate - 1.0 / caught_up.rate)
                if saving >= CATCH_UP_MARGIN * backlog:
                    log.debug("auto: catching the drafter up on %d tokens (%.2f s) for %s at %.1f tok/s against "
                              "%s at %.1f tok/s over %d tokens", pending, backlog, caught_up.label("drafter"),
                              caught_up.rate, best.label("drafter"), best.rate, ahead)
                    best = Choice(caught_up.k, caught_up.m, caught_up.expected, caught_up.seconds + backlog,
                                  caught_up.rows)
        if best_model is not None and best.k == 0 and self.rounds - self.last_model_round >= \
                self.config.auto_explore_every:
            drafter = Choice(best_model[1], 0, best_model[3], best_model[4], 1 + best_model[2])
            loss = max(0.0, drafter.seconds - drafter.expected / best.rate)  # expected, in seconds
            # the share of this engine's measured time and of what this sequence has still to emit
            if self.explore_loss + loss <= EXPLORE_SHARE * (self.elapsed + remaining / best.rate):
                log.debug("auto: re-measuring the drafter (%s expected %.1f tok/s, best %s %.1f tok/s)",
                          drafter.label("drafter"), drafter.rate, best.label("drafter"), best.rate)
                self.explore_loss += loss
                best = drafter
        if best.k:
            self.last_model_round = self.rounds
        return best

    def _search(self, modelfree, model, tree, pending, k_range, allow_none, max_rows, v):
        """The best choice with the drafter `pending` tokens behind, and the drafter's best chain
        alone as (rate, k, rows, expected, seconds) (None when it may not run)."""
        a = min(self.acceptance.prob(MODEL, 0), 0.995)
        per_unit = self.rows_per_unit.value
        best_model = None  # (rate, k, rows, expected, seconds): the drafter's chain alone
        if model:
            lo, hi = k_range or (self.config.min_draft_len, self.config.max_draft_len)
            for k in range(lo, hi + 1):
                rows = min(max(1, round(per_unit * k)), max_rows - 1)
                expected = 1.0 + a * (1 - a ** rows) / (1 - a)
                seconds = self.draft_seconds(k, pending) + v(1 + rows)
                if best_model is None or expected / seconds > best_model[0]:
                    best_model = (expected / seconds, k, rows, expected, seconds)
        ks = ([] if k_range is not None and best_model else [0]) + ([best_model[1]] if best_model else [])
        best = None
        for k in ks:
            model_rows = 0 if k == 0 else best_model[2]
            expected = 1.0 if k == 0 else best_model[3]
            base = 0.0 if k == 0 else best_model[4] - v(1 + model_rows)
            b = [0.0] * (max_rows + 1)
            longest = 0
            for m in range(0, len(modelfree) + 1):
                if m:
                    depth, reach = modelfree[m - 1]
                    if depth >= max_rows:
                        break
                    old = b[depth]
                    b[depth] = min(1.0, old + reach)
                    ad = a ** depth if depth <= model_rows else 0.0
                    if tree:
                        expected += (b[depth] - old) * (1.0 - ad)
                    else:  # one chain: the likelier of the two at each depth
                        expected += max(ad, b[depth]) - max(ad, old)
                    longest = max(longest, depth)
                rows = 1 + (model_rows + m if tree else max(model_rows, longest))
                if rows > max_rows:
                    break
                if k == 0 and m == 0 and not allow_none:
                    continue
                rate = expected / (base + v(rows))
                if best is None or rate > best.rate:
                    best = Choice(k, m, expected, base + v(rows), rows)
        if best is None:
            best = Choice(0, 0, 1.0, v(1), 1)
        return best, best_model

    def summary(self, verify=None) -> str:
        cells = ", ".join(f"{'model' if s == MODEL else 'ngram' if s == 2 else 'suffix'}[{b}] {m.value:.2f}"
                          for (s, b), m in sorted(self.acceptance.cells.items()))
        v, what = (verify, "share of the step") if verify else (self.verify, "verify")
        return (f"{what}: 1 row {1e3 * v(1):.1f} ms, 8 rows {1e3 * v(8):.1f} ms; "
                f"acceptance {cells or 'not measured'}")


def reach_order(tree, rows: list[int] | None = None) -> list[int]:
    """Rows of a tree (all but row 0, or these) in the order the cost model adds them: most
    likely first, a parent before its children."""
    rows = range(1, len(tree)) if rows is None else rows
    return sorted(rows, key=lambda r: (-tree.reach[r], r))

