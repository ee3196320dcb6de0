"""The proposer interface: one class per algorithm, chosen once by `factory.make_proposer`.

A proposer turns the accepted text into a `RoundPlan` (draft target ids, and q where the
algorithm has one) and, after the verifier has spoken, brings the drafter up to date:

    plan = proposer.propose(k, start)        # k: draft length in the algorithm's own unit
    ...target forward, verifier...
    kept = proposer.commit(plan, emitted)    # emitted: accepted + recovered/bonus target ids

`commit` returns how many of the k drafted units were kept, which the adaptive draft length
reads. Proposers of one generation share a `DraftSession`, so `auto` can switch between them
without re-reading the conversation.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from hetero_run.kernels.sampling import SamplingParams, sample, sample_keyed
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.pairing import Pairing
from hetero_run.runtime.speculative.round import RoundPlan


@dataclass
class DraftSession:
    """What the proposers of one generation share."""

    pairing: Pairing
    context: DraftContext | None  # None without a drafter
    target_ids: list[int]  # prompt + generated target tokens, owned by the driver
    target_vocab: int  # width of the target's logits
    sampling: SamplingParams  # the target's: p
    generator: torch.Generator | None  # None when greedy
    keyed_seed: int | None = None  # keyed verification (verifier.KeyedSampler): drafts race over its noise

    @property
    def draft_sampling(self) -> SamplingParams:
        """How q is processed. Any q is lossless; q follows p's temperature and top-k but skips
        top-p, whose sort over the whole vocabulary per drafted token costs more than the few
        tail drafts it would spare."""
        return replace(self.sampling, top_p=1.0)

    def drawer(self, start: int) -> Callable[..., torch.Tensor]:
        """draw(q, ids=None) -> the column drawn from q [m] for the round's next draft, the first
        at position start + 1. Argmax when greedy; under keyed verification the draw races over
        the noise the target's draw at that position uses (`ids` [m]: the target id of each
        column), so drafter and target agree as often as q and p allow; else from the generator."""
        positions = itertools.count(start + 1)

        def draw(q: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
            position = next(positions)
            if self.keyed_seed is None or self.generator is None:
                return sample(q[None], self.generator)[0]
            return sample_keyed(q[None], self.keyed_seed, [position], ids, self.target_vocab)[0]

        return draw


class Proposer(ABC):
    name: ClassVar[str]
    unit: ClassVar[str] = "target tokens"  # what k counts

    def __init__(self, session: DraftSession, config):
        self.session = session
        self.config = config

    def empty(self, start: int) -> RoundPlan:
        return RoundPlan(torch.empty(0, dtype=torch.long), None, start, extras=[])

    @abstractmethod
    def propose(self, k: int, start: int) -> RoundPlan: ...

    @abstractmethod
    def commit(self, plan: RoundPlan, emitted: list[int]) -> int: ...

    def _commit_text(self, drafts: list[int], emitted: list[int]) -> int:
        """Hand the accepted tokens to the drafter; -> how many of its drafts were kept."""
        context = self.session.context
        before = len(context.ids)
        if context.same_vocab:  # the accepted target tokens are drafter tokens
            context.commit_ids(emitted)
        else:
            context.commit_text(drafts, self.session.pairing.target_table.decode(emitted))
        kept = 0
        for token, now in zip(drafts, context.ids[before:], strict=False):
            if token != now:
                break
            kept += 1
        return kept


class NoProposer(Proposer):
    """`none`: the target alone. A drafter, if any, is kept up to date so `auto` can return to it."""

    name = "none"

    def propose(self, k: int, start: int) -> RoundPlan:
        return self.empty(start)

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        if self.session.context is not None:
            self._commit_text([], emitted)
        return 0
