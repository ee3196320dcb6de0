"""What a generation reports: per-round figures for live display and the final result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundStats:
    """Passed to `on_round` after every round (cumulative figures for live display)."""

    round: int
    algorithm: str
    draft_len: int  # k asked for this round (the algorithm's unit)
    drafted: int  # draft target tokens verified this round
    accepted: int  # of them accepted
    token_ids: list[int]  # target tokens emitted this round (after stop / length cuts; the first round's
    # start with the token the prompt's forward decided)
    text: str  # their text (whole characters only; a split character waits for the next round)
    new_tokens: int  # so far
    seconds: float  # since the first round started
    acceptance_rate: float  # so far: accepted / drafted target tokens
    tokens_per_round: float  # so far

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated target tokens (the prompt excluded)
    text: str
    prompt_tokens: int
    rounds: int
    drafted: int  # draft target tokens verified
    accepted: int  # of them accepted
    seconds: float  # the decode loop (after prefill)
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    algorithm: str  # the configured one ("auto" included)
    algorithms: list[str] = field(default_factory=list)  # per round
    draft_lengths: list[int] = field(default_factory=list)  # per round
    counters: dict[str, int] = field(default_factory=dict)  # e.g. slrs capped / unmatched positions
    stop_reason: str = "length"  # "length" | "stop_token"

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def rounds_by_algorithm(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in self.algorithms:
            out[name] = out.get(name, 0) + 1
        return out

    def to_json(self) -> dict:
        return {
            "text": self.text, "token_ids": self.token_ids, "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens, "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4), "tokens_per_second": round(self.tokens_per_second, 3),
            "algorithm": self.algorithm, "rounds": self.rounds, "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4), "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4), "rounds_by_algorithm": self.rounds_by_algorithm(),
            "draft_lengths": self.draft_lengths, "counters": self.counters, "stop_reason": self.stop_reason,
        }
