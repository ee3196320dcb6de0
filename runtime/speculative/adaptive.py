"""The draft length of each round, from measured acceptance and measured cost.

Model (per algorithm): each drafted unit is kept with probability alpha given the ones before
it were, so k drafted units keep E(k) = alpha + alpha^2 + ... + alpha^k of them on average and
the round emits 1 + rho * E(k) target tokens (rho: target tokens per kept unit; 1 except for
slem, whose unit is a drafter token). A round costs draft(k) = d0 + d1 * k and
verify(n) = v0 + v1 * n for the n = 1 + r * k target tokens run (r: target tokens per drafted
unit). Each round takes the k in [min_draft_len, max_draft_len] with the most tokens per
second. Every figure is an exponentially weighted mean (about 12 rounds of memory), so the
choice follows the text; every 8th round tries k + 1 or k - 1 so that both lines stay fitted.
"""

from __future__ import annotations

import logging

log = logging.getLogger("hetero_run.runtime.speculative.adaptive")

DECAY = 0.92  # weight of the past per round
EXPLORE_EVERY = 8


class _Mean:
    def __init__(self, prior: float = 0.0, weight: float = 1e-9):
        self.total, self.weight = prior * weight, weight

    def add(self, value: float) -> None:
        self.total = self.total * DECAY + value
        self.weight = self.weight * DECAY + 1.0

    @property
    def value(self) -> float:
        return self.total / self.weight


class _Line:
    """y = a + b x, fitted by exponentially weighted least squares."""

    def __init__(self):
        self.x, self.y, self.xx, self.xy = _Mean(), _Mean(), _Mean(), _Mean()

    def add(self, x: float, y: float) -> None:
        for mean, value in ((self.x, x), (self.y, y), (self.xx, x * x), (self.xy, x * y)):
            mean.add(value)

    def __call__(self, x: float, default_slope: float) -> float:
        mx, my = self.x.value, self.y.value
        var = self.xx.value - mx * mx
        slope = (self.xy.value - mx * my) / var if var > 0.1 else default_slope
        slope = max(slope, 0.0)
        return max(1e-6, my + slope * (x - mx))


class DraftLength:
    def __init__(self, config, name: str = ""):
        self.config, self.name = config, name
        self.k = config.draft_len
        self.kept = _Mean(0.6, 3.0)  # alpha = kept / (kept + stops): the geometric model's estimate
        self.stops = _Mean(0.4, 3.0)
        self.rho = _Mean(1.0, 1.0)
        self.target_per_unit = _Mean(1.0, 1.0)
        self.draft = _Line()
        self.verify = _Line()
        self.rounds = 0

    @property
    def alpha(self) -> float:
        return self.kept.value / max(1e-9, self.kept.value + self.stops.value)

    def record(self, k: int, kept: int, target_run: int, emitted: int, draft_s: float, verify_s: float) -> None:
        """One round: k units drafted, `kept` kept, `target_run` target tokens verified, `emitted` emitted."""
        self.rounds += 1
        if k > 0:
            self.kept.add(kept)
            self.stops.add(1.0 if kept < k else 0.0)
            self.target_per_unit.add((target_run - 1) / k)
            if kept > 0:
                self.rho.add((emitted - 1) / kept)
            self.draft.add(k, draft_s)
        self.verify.add(target_run, verify_s)

    def expected_rate(self, k: int) -> float:
        """Expected target tokens per second at draft length k."""
        a = min(self.alpha, 0.995)
        kept = a * (1 - a**k) / (1 - a)
        draft_slope = self.draft.y.value / max(1.0, self.draft.x.value)
        seconds = self.draft(k, draft_slope) + self.verify(1 + self.target_per_unit.value * k, 0.0)
        return (1 + self.rho.value * kept) / seconds

    def next(self) -> int:
        if not self.config.adaptive or self.rounds < 2:  # measure before steering
            return self.k
        lo, hi = self.config.min_draft_len, self.config.max_draft_len
        best = max(range(lo, hi + 1), key=self.expected_rate)
        if best != self.k:
            log.debug("%s: draft length %d -> %d (acceptance %.2f, %.2f tok/s expected)", self.name, self.k, best,
                      self.alpha, self.expected_rate(best))
        self.k = best
        if self.rounds % EXPLORE_EVERY == 0:
            step = 1 if (self.rounds // EXPLORE_EVERY) % 2 else -1
            return min(hi, max(lo, best + step))
        return best
