"""Which algorithm runs each round: the configured one, or for `auto` the fastest measured.

`auto` measures its candidates online, no speculation included: each runs for
`auto_probe_rounds` rounds in turn (the first round of each turn is not counted: it pays for
catching the drafter up), then the fastest by emitted tokens per second runs alone; every
`auto_reprobe_every` rounds the others get a shorter turn again, so the choice follows the
task. Every decision is logged.
"""

from __future__ import annotations

import logging

log = logging.getLogger("hetero_run.runtime.speculative.selector")


class Selector:
    def __init__(self, names: list[str], config, auto: bool):
        self.names, self.config, self.auto = names, config, auto
        self.tokens = dict.fromkeys(names, 0.0)
        self.seconds = dict.fromkeys(names, 0.0)
        self.best = names[0]
        self.plan: list[str] = []  # the coming measurement rounds
        self.counting = False  # the first round of a turn is not measured
        self.since_decision = 0
        if auto:
            self.plan = [n for n in names for _ in range(config.auto_probe_rounds)]
            log.info("auto: measuring %s for %d rounds each", ", ".join(names), config.auto_probe_rounds)

    def current(self) -> str:
        return self.plan[0] if self.plan else self.best

    def speed(self, name: str) -> float:
        return self.tokens[name] / self.seconds[name] if self.seconds[name] > 0 else 0.0

    def record(self, name: str, emitted: int, seconds: float) -> None:
        if not self.auto:
            return
        measuring = bool(self.plan)
        if measuring:
            self.plan.pop(0)
        if self.counting:
            self.tokens[name] += emitted
            self.seconds[name] += seconds
        self.counting = self.current() == name
        self.since_decision += 1
        if measuring and not self.plan:
            self._decide()
        elif not measuring and self.since_decision >= self.config.auto_reprobe_every:
            others = [n for n in self.names if n != self.best]
            for n in others:  # older figures count half: the text may have changed
                self.tokens[n] *= 0.5
                self.seconds[n] *= 0.5
            self.plan = [n for n in others for _ in range(max(2, self.config.auto_probe_rounds // 2))]
            self.counting = False
            log.info("auto: re-measuring %s", ", ".join(others))

    def _decide(self) -> None:
        measured = {n: self.speed(n) for n in self.names if self.seconds[n] > 0}
        self.since_decision = 0
        if not measured:
            return
        choice = max(measured, key=measured.get)
        figures = ", ".join(f"{n} {v:.2f} tok/s" for n, v in sorted(measured.items(), key=lambda kv: -kv[1]))
        log.info("auto: measured %s -> %s", figures, choice)
        self.best = choice
        self.counting = False
