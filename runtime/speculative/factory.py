"""Algorithms by name: the one place that maps `--algorithm` to a proposer class."""

from __future__ import annotations

from hetero_run.runtime.speculative.proposer import DraftSession, NoProposer, Proposer
from hetero_run.runtime.speculative.slem import SlemProposer
from hetero_run.runtime.speculative.slrs import SlrsProposer
from hetero_run.runtime.speculative.standard import StandardProposer
from hetero_run.runtime.speculative.tli import TliProposer
from hetero_run.topology.errors import ConfigError

PROPOSERS: dict[str, type[Proposer]] = {
    cls.name: cls for cls in (NoProposer, StandardProposer, SlemProposer, TliProposer, SlrsProposer)
}


def check_algorithm(name: str, has_drafter: bool, same_vocab: bool) -> None:
    """Raise a one-line ConfigError when `name` cannot run with this drafter."""
    if name in ("none", "auto"):
        return
    if not has_drafter:
        raise ConfigError(f"algorithm {name!r} needs a drafter (--drafter PATH)", field="algorithm")
    if name == "standard" and not same_vocab:
        raise ConfigError("algorithm 'standard' needs a drafter with the target's vocabulary; this drafter's "
                          "differs (use slem, tli, slrs or auto)", field="algorithm")


def candidates(has_drafter: bool, same_vocab: bool, greedy: bool) -> list[str]:
    """What `auto` measures, most promising first; `none` (no speculation) is always last."""
    if not has_drafter:
        return ["none"]
    if same_vocab:
        return ["standard", "slem", "none"]
    return (["slem", "tli", "slrs"] if greedy else ["tli", "slem", "slrs"]) + ["none"]


def make_proposer(name: str, session: DraftSession, config) -> Proposer:
    return PROPOSERS[name](session, config)
