"""One sequence's model-free proposers (prompt lookup, suffix tree): candidates in the target's
own vocabulary that cost no drafter, kept up to date with every committed token."""

from __future__ import annotations

import time

from hetero_run.runtime.speculative.lookup import PromptLookup
from hetero_run.runtime.speculative.suffix import SuffixCache, SuffixState
from hetero_run.runtime.speculative.tree import Candidates


class ModelFree:
    def __init__(self, sources: tuple[str, ...], prompt_ids: list[int], config, cache: SuffixCache | None):
        self.lookup = PromptLookup(prompt_ids, config.prompt_lookup_min, config.prompt_lookup_max) \
            if "ngram" in sources else None
        self.suffix = SuffixState(cache, prompt_ids, config.suffix_max_depth, config.suffix_spec_factor,
                                  config.suffix_min_prob, spec_offset=config.suffix_spec_offset,
                                  min_match=config.suffix_min_match) if "suffix" in sources else None
        self.max_nodes = config.modelfree_max_nodes
        self.propose_seconds = 0.0
        self.update_seconds = 0.0
        self.rounds = 0

    def propose(self, max_nodes: int | None = None) -> list[Candidates]:
        begin = time.perf_counter()
        n = min(self.max_nodes, max_nodes if max_nodes is not None else self.max_nodes)
        out = []
        if n > 0:
            for proposer in (self.lookup, self.suffix):
                if proposer is not None:
                    found = proposer.propose(n)
                    if len(found):
                        out.append(found)
        self.rounds += 1
        self.propose_seconds += time.perf_counter() - begin
        return out

    def extend(self, tokens: list[int]) -> None:
        begin = time.perf_counter()
        for proposer in (self.lookup, self.suffix):
            if proposer is not None:
                proposer.extend(tokens)
        self.update_seconds += time.perf_counter() - begin

    def finish(self) -> None:
        if self.suffix is not None:
            begin = time.perf_counter()
            self.suffix.finish()
            spent = time.perf_counter() - begin
            self.update_seconds += spent
            self.suffix.update_seconds += spent  # adding the generation to the shared cache

    @property
    def counters(self) -> dict[str, float]:
        rounds = max(1, self.rounds)
        out = {"propose_us_per_round": round(1e6 * self.propose_seconds / rounds, 1),
               "update_us_per_round": round(1e6 * self.update_seconds / rounds, 1)}
        if self.suffix is not None:
            out["suffix_update_us_per_round"] = round(1e6 * self.suffix.update_seconds / rounds, 1)
        return out
