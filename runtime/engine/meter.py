"""Counting what a decoder does with the target, round by round, without looking inside it.

`RoundMeter` stands in for the `TargetRunner` a decoder drives and passes every call through.
Every decoder follows the runner contract (docs/generate.md): a prompt is one forward with
`num_logits=1`; a decode step forwards one token; a verify step forwards [last token] + k draft
tokens and then truncates the cache to what it keeps, so

    rounds            target forwards that decided tokens (the prompt's included)
    draft tokens      k of each verify forward (its rows beyond the first)
    accepted tokens   kept - 1 of each verify forward (the last kept token is the target's own)

The same counts hold for the target alone (k = 0 every step) and for every speculative
algorithm, so a request's speculation summary and the server's counters come from one place.
"""

from __future__ import annotations

from hetero_run.runtime.engine.api import SpeculationSummary


class RoundMeter:
    def __init__(self, target):
        self.target = target
        self.reset()

    def reset(self) -> None:
        self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self._verify: tuple[int, int] | None = None  # (cache length before, rows) of the last verify

    @property
    def length(self) -> int:
        return self.target.length

    @property
    def max_tokens(self) -> int:
        return self.target.max_tokens

    def forward(self, input_ids, positions, num_logits=None):
        start = self.target.length
        logits = self.target.forward(input_ids, positions, num_logits)
        self.rounds += 1
        rows = int(input_ids.shape[0])
        self._verify = None
        if num_logits is None and rows > 1:
            self.drafts += 1
            self.draft_tokens += rows - 1
            self._verify = (start, rows)
        return logits

    def truncate(self, length: int) -> None:
        if self._verify is not None:
            start, rows = self._verify
            self.accepted_tokens += max(0, min(length - start, rows) - 1)
            self._verify = None
        self.target.truncate(length)

    def summary(self, algorithm: str) -> SpeculationSummary:
        return SpeculationSummary(algorithm, self.rounds, self.drafts, self.draft_tokens, self.accepted_tokens)
