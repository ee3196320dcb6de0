"""Algorithms by name: the one place that maps `--algorithm` to a proposer class."""

from __future__ import annotations

from hetero_run.runtime.speculative.config import MODEL_FREE
from hetero_run.runtime.speculative.eagle3 import Eagle3Proposer
from hetero_run.runtime.speculative.proposer import DraftSession, NoProposer, Proposer
from hetero_run.runtime.speculative.slem import SlemProposer
from hetero_run.runtime.speculative.slrs import SlrsProposer
from hetero_run.runtime.speculative.standard import StandardProposer
from hetero_run.runtime.speculative.tli import TliProposer
from hetero_run.topology.errors import ConfigError

PROPOSERS: dict[str, type[Proposer]] = {
    cls.name: cls for cls in (NoProposer, StandardProposer, SlemProposer, TliProposer, SlrsProposer, Eagle3Proposer)
}
EAGLE3_ALGORITHMS = ("eagle3", "standard", "slem")  # what an EAGLE-3 head (target vocabulary, chains) can run


def check_algorithm(name: str, has_drafter: bool, same_vocab: bool, eagle3: bool = False) -> None:
    """Raise a one-line ConfigError when `name` cannot run with this drafter (`eagle3`: the
    drafter is an EAGLE-3 head)."""
    if name in ("none", "auto", *MODEL_FREE):
        return
    if not has_drafter:
        raise ConfigError(f"algorithm {name!r} needs a drafter (--drafter PATH)", field="algorithm")
    if name == "eagle3" and not eagle3:
        raise ConfigError("algorithm 'eagle3' needs an EAGLE-3 head as the drafter (--drafter eagle3:PATH)",
                          field="algorithm")
    if eagle3 and name not in EAGLE3_ALGORITHMS:
        raise ConfigError(f"an EAGLE-3 head drafts chains of target tokens: algorithm {name!r} cannot use it "
                          f"(use {', '.join(EAGLE3_ALGORITHMS)} or auto)", field="algorithm")
    if name == "standard" and not same_vocab:
        raise ConfigError("algorithm 'standard' needs a drafter with the target's vocabulary; this drafter's "
                          "differs (use slem, tli, slrs or auto)", field="algorithm")


def candidates(has_drafter: bool, same_vocab: bool, greedy: bool, eagle3: bool = False) -> list[str]:
    """The drafter algorithms a per-algorithm selector (`selector.Selector`) measures, most
    promising first; `none` (no speculation) is always last."""
    if not has_drafter:
        return ["none"]
    if eagle3:
        return ["eagle3", "none"]
    if same_vocab:
        return ["standard", "slem", "none"]
    return (["slem", "tli", "slrs"] if greedy else ["tli", "slem", "slrs"]) + ["none"]


def model_algorithm(has_drafter: bool, same_vocab: bool, greedy: bool, eagle3: bool = False) -> str | None:
    """The drafter algorithm `auto` runs when its cost model picks the drafter: the paper's and
    transformers' defaults (slem when greedy, tli when sampling) for another vocabulary,
    standard for the same one, the head's own for EAGLE-3."""
    if not has_drafter:
        return None
    if eagle3:
        return "eagle3"
    if same_vocab:
        return "standard"
    return "slem" if greedy else "tli"


def make_proposer(name: str, session: DraftSession, config) -> Proposer:
    return PROPOSERS[name](session, config)
