"""How the driver speculates: algorithm, draft lengths, caps (`SpeculationConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from hetero_run.topology.errors import ConfigError

ALGORITHMS = ("auto", "none", "standard", "slem", "tli", "slrs", "eagle3")


@dataclass(frozen=True)
class SpeculationConfig:
    """How the driver speculates. Draft lengths count the algorithm's own unit: drafter
    tokens for slem, target tokens otherwise."""

    algorithm: str = "auto"  # one of ALGORITHMS
    draft_len: int = 4  # the first round's draft length (every round's, when not adaptive)
    adaptive: bool = True  # choose the draft length each round from measured acceptance and cost
    min_draft_len: int = 1
    max_draft_len: int = 12
    max_target_draft: int = 24  # slem: target tokens verified per round at most
    window: int = 8  # look-behind tokens when re-tokenising across vocabularies
    slrs_width: int = 8  # slrs: drafter tree nodes added per level (most probable first)
    slrs_depth: int = 2  # slrs: drafter tokens one target token may span in the tree
    slrs_max_nodes: int = 24  # slrs: drafter tree nodes per position (the cap; hitting it is counted)
    auto_probe_rounds: int = 6  # auto: rounds each candidate is measured for
    auto_reprobe_every: int = 96  # auto: rounds between re-measurements of the other candidates
    drafter_threads: int = 0  # torch threads while drafting; 0: measure at start which is faster

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm {self.algorithm!r} (choose from {', '.join(ALGORITHMS)})",
                              field="algorithm")
        if not 1 <= self.min_draft_len <= self.max_draft_len:
            raise ConfigError(f"need 1 <= min_draft_len <= max_draft_len, got {self.min_draft_len} and "
                              f"{self.max_draft_len}", field="min_draft_len")
        if not self.min_draft_len <= self.draft_len <= self.max_draft_len:
            raise ConfigError(f"must be within {self.min_draft_len}..{self.max_draft_len}, got {self.draft_len}",
                              field="draft_len")
        for name in ("max_target_draft", "window", "slrs_width", "slrs_depth", "slrs_max_nodes", "auto_probe_rounds",
                     "auto_reprobe_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.drafter_threads < 0:
            raise ConfigError(f"must be >= 0 (0: measure), got {self.drafter_threads}", field="drafter_threads")
