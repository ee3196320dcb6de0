"""How the driver speculates: algorithm, draft lengths, model-free proposers, caps (`SpeculationConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from hetero_run.topology.errors import ConfigError

ALGORITHMS = ("auto", "none", "standard", "slem", "tli", "slrs", "eagle3", "ngram", "suffix")
MODEL_FREE = ("ngram", "suffix")  # proposers that need no drafter
VERIFY_MAX_ROWS = 32  # kernels/batch_invariance.py: forwards up to this many rows decode's bits


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
    drafter_threads: int = 0  # torch threads while drafting; 0: measure at start which is faster
    # model-free proposers (target vocabulary, no drafter)
    modelfree: tuple[str, ...] = MODEL_FREE  # what auto and hybrid rounds draw candidates from
    hybrid: bool = False  # a drafter algorithm also verifies the model-free candidates each round
    prompt_lookup_min: int = 2  # ngram: shortest match that proposes
    prompt_lookup_max: int = 5  # ngram: longest match looked for
    modelfree_max_nodes: int = 16  # model-free nodes per round at most (ngram: tokens; suffix: tree nodes)
    suffix_max_depth: int = 24  # suffix: longest match and deepest continuation
    suffix_spec_factor: float = 1.0  # suffix: tree nodes per matched token at most
    suffix_spec_offset: float = 5.0  # suffix: tree nodes beyond spec_factor * match length (SuffixDecoding's offset)
    suffix_min_match: int = 1  # suffix: shortest match that proposes (1: the last token alone)
    suffix_min_prob: float = 0.1  # suffix: nodes below this estimated probability are not proposed
    suffix_max_generations: int = 256  # suffix: earlier generations kept (oldest evicted)
    suffix_max_tokens: int = 4096  # suffix: tokens kept per earlier generation
    max_verify_rows: int = VERIFY_MAX_ROWS  # target rows per round at most (row 0 included)
    auto_explore_every: int = 32  # auto: rounds between re-measurements of a drafter it does not pick
    auto_probe_rounds: int = 6  # selector.Selector (per-algorithm turns): rounds each candidate is measured for
    auto_reprobe_every: int = 96  # selector.Selector: rounds between re-measurements of the other candidates
    # seeded sampled requests: "keyed" draws each token from noise keyed by (seed, position), so the
    # output is the target alone's for that seed under any speculation and batching; "rejection":
    # rejection sampling against q (accepts more drafts; the output then depends on the drafts)
    sampled_verification: str = "keyed"

    def __post_init__(self):
        if self.sampled_verification not in ("keyed", "rejection"):
            raise ConfigError(f"must be keyed or rejection, got {self.sampled_verification!r}",
                              field="sampled_verification")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm {self.algorithm!r} (choose from {', '.join(ALGORITHMS)})",
                              field="algorithm")
        if not 1 <= self.min_draft_len <= self.max_draft_len:
            raise ConfigError(f"need 1 <= min_draft_len <= max_draft_len, got {self.min_draft_len} and "
                              f"{self.max_draft_len}", field="min_draft_len")
        if not self.min_draft_len <= self.draft_len <= self.max_draft_len:
            raise ConfigError(f"must be within {self.min_draft_len}..{self.max_draft_len}, got {self.draft_len}",
                              field="draft_len")
        for name in ("max_target_draft", "window", "slrs_width", "slrs_depth", "slrs_max_nodes",
                     "auto_explore_every", "auto_probe_rounds", "auto_reprobe_every", "prompt_lookup_min",
                     "modelfree_max_nodes", "suffix_max_depth", "suffix_min_match",
                     "suffix_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ConfigError(f"must be >= prompt_lookup_min ({self.prompt_lookup_min}), got "
                              f"{self.prompt_lookup_max}", field="prompt_lookup_max")
        if not 2 <= self.max_verify_rows <= VERIFY_MAX_ROWS:
            raise ConfigError(f"must be within 2..{VERIFY_MAX_ROWS}, got {self.max_verify_rows}",
                              field="max_verify_rows")
        if not self.suffix_spec_factor > 0:
            raise ConfigError(f"must be > 0, got {self.suffix_spec_factor}", field="suffix_spec_factor")
        if not self.suffix_spec_offset >= 0:
            raise ConfigError(f"must be >= 0, got {self.suffix_spec_offset}", field="suffix_spec_offset")
        if not 0 <= self.suffix_min_prob < 1:
            raise ConfigError(f"must be in [0, 1), got {self.suffix_min_prob}", field="suffix_min_prob")
        if self.suffix_max_generations < 0:
            raise ConfigError(f"must be >= 0, got {self.suffix_max_generations}", field="suffix_max_generations")
        unknown = [m for m in self.modelfree if m not in MODEL_FREE]
        if unknown:
            raise ConfigError(f"unknown model-free proposer {unknown[0]!r} (choose from {', '.join(MODEL_FREE)})",
                              field="modelfree")
        if self.drafter_threads < 0:
            raise ConfigError(f"must be >= 0 (0: measure), got {self.drafter_threads}", field="drafter_threads")
        if self.hybrid and self.algorithm in ("none", "auto", *MODEL_FREE):
            raise ConfigError(f"hybrid rounds need a drafter algorithm, not {self.algorithm!r} (auto tries them "
                              "itself)", field="hybrid")

    @property
    def sources(self) -> tuple[str, ...]:
        """The model-free proposers this configuration runs."""
        if self.algorithm in MODEL_FREE:
            return (self.algorithm,)
        if self.algorithm == "auto" or self.hybrid:
            return self.modelfree
        return ()
