"""Drafting for several sequences in lockstep (runtime/engine/lockstep.py): their drafter forwards
meet in one batched forward per step, and every sequence drafts exactly what it drafts alone."""

from __future__ import annotations

import functools

import speculative_support as support
import torch

from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.runtime.drafters.network import DraftNetwork
from hetero_run.runtime.engine.lockstep import Lockstep
from hetero_run.runtime.models.loader import load_model

PROMPTS = [[1, 5, 9, 20, 33], [7, 3], [40, 41, 42, 43, 44, 45, 46]]
STEPS = [4, 1, 3]


@functools.cache
def weights():
    model = support.trained_model(support.sentencepiece(), "llama", seed=1)
    return draft_weights.cast(draft_weights.from_model(load_model(model, max_tokens=64, dtype=torch.float32)),
                              torch.bfloat16)


class Counting(DraftNetwork):
    forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return super().forward(*args, **kwargs)


def draft(view, prompt, steps):
    """A proposer's use of its slot: read the prompt, then draft greedily `steps` tokens."""
    logits = view.forward(torch.tensor(prompt))[-1]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = view.forward(torch.tensor([tokens[-1]]))[-1]
    return tokens, logits


def test_sequences_drafting_together_share_forwards_and_draft_what_they_draft_alone():
    alone = []
    for prompt, steps in zip(PROMPTS, STEPS, strict=True):
        network = Counting(weights(), slots=1, max_tokens=64)
        alone.append(draft(network.view(network.acquire()), prompt, steps))
    network = Counting(weights(), slots=3, max_tokens=64)
    lockstep = Lockstep(network)
    views = [lockstep.view(network.view(network.acquire())) for _ in PROMPTS]
    jobs = [lambda v=v, p=p, s=s: draft(v, p, s) for v, p, s in zip(views, PROMPTS, STEPS, strict=True)]
    together = lockstep.run(jobs)
    assert network.forwards == 1 + max(STEPS)  # the prompts in one forward, then one per drafted depth
    for (tokens, logits), (want_tokens, want_logits) in zip(together, alone, strict=True):
        assert tokens == want_tokens and torch.equal(logits, want_logits)
    assert [network.length(v.slot) for v in views] == [len(p) + s for p, s in zip(PROMPTS, STEPS, strict=True)]
    # outside a run, a view's forward goes straight to its slot (the one-slot fast path)
    out = views[1].forward(torch.tensor([9]))
    assert out.shape[0] == 1 and network.forwards == 1 + max(STEPS) and network.length(views[1].slot) == 4


def test_an_error_in_one_sequence_reaches_the_engine():
    network = DraftNetwork(weights(), slots=2, max_tokens=8)
    lockstep = Lockstep(network)
    views = [lockstep.view(network.view(network.acquire())) for _ in range(2)]
    jobs = [lambda: draft(views[0], [1, 2], 1), lambda: draft(views[1], list(range(3, 12)), 1)]  # 9 > 8 tokens
    try:
        lockstep.run(jobs)
    except Exception as exc:  # the cache overflow of the second sequence, raised in the engine's greenlet
        assert "drafter slot" in str(exc)
    else:
        raise AssertionError("the overflow must reach the caller")
    assert not lockstep.active
