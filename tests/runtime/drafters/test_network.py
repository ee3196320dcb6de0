"""Sequence slots of the fast drafter and of the transformers fallback: batched forwards whose
rows equal each row alone bit for bit, positions that roll back, slot accounting without leaks."""

from __future__ import annotations

import functools
import random

import pytest
import speculative_support as support
import torch

from hetero_run.runtime.drafters import weights as draft_weights
from hetero_run.runtime.drafters.hf import HFDraftNetwork
from hetero_run.runtime.drafters.network import DraftNetwork
from hetero_run.runtime.drafters.slots import NoFreeSlot
from hetero_run.runtime.models.kv_cache import KVCacheFull
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.retokenize import Retokenizer
from hetero_run.runtime.speculative.vocab import TokenTable

PROMPTS = [[1, 5, 9, 20, 33], [7, 3], [40, 41, 42, 43, 44, 45, 46], [2]]


@functools.cache
def hf_model():
    return support.trained_model(support.sentencepiece(), "llama", seed=1)


@functools.cache
def step_weights(kind: str):
    dense = draft_weights.from_model(load_model(hf_model(), max_tokens=64, dtype=torch.float32))
    if kind == "nvfp4":
        return draft_weights.quantize(dense)
    return draft_weights.cast(dense, torch.bfloat16) if kind == "bf16" else dense


def network(kind: str = "bf16", slots: int = 4, max_tokens: int = 64):
    if kind == "hf":
        return HFDraftNetwork(hf_model(), slots, max_tokens)
    return DraftNetwork(draft_weights.with_fast_activations(step_weights(kind)), slots, max_tokens)


def prefill(net, prompts=PROMPTS) -> list[int]:
    slots = [net.acquire() for _ in prompts]
    for slot, prompt in zip(slots, prompts, strict=True):
        net.forward(torch.tensor(prompt), torch.full((len(prompt),), slot))
    return slots


@pytest.mark.parametrize("kind", ["fp32", "bf16", "nvfp4", "hf"])
def test_one_batched_step_drafts_for_every_sequence_with_each_rows_own_bits(kind):
    batched, alone = network(kind), network(kind)
    slots, other = prefill(batched), prefill(alone)
    assert slots == other
    tokens = torch.tensor([11, 12, 13, 14])
    for _ in range(3):  # three draft steps, one token per running sequence each
        logits = batched.forward(tokens, torch.tensor(slots))
        assert logits.shape == (4, batched.vocab_size) and logits.dtype == torch.float32
        for r, slot in enumerate(slots):
            assert torch.equal(logits[r], alone.forward(tokens[r:r + 1], torch.tensor([slot]))[0]), (kind, r)
        tokens = logits.argmax(-1)
    assert [batched.length(s) for s in slots] == [len(p) + 3 for p in PROMPTS]


@pytest.mark.parametrize("kind", ["nvfp4", "hf"])
def test_rows_may_catch_a_sequence_up_and_roll_another_back(kind):
    net, fresh = network(kind), network(kind)
    a, b = prefill(net, PROMPTS[:2])
    # slot a catches up three tokens while slot b rewrites its last token: one forward
    logits = net.forward(torch.tensor([50, 51, 52, 60]), torch.tensor([a, a, a, b]), torch.tensor([5, 6, 7, 1]))
    assert net.length(a) == 8 and net.length(b) == 2
    c, d = prefill(fresh, [PROMPTS[0] + [50, 51, 52], [7, 60]])
    want_a = fresh.forward(torch.tensor([52]), torch.tensor([c]), torch.tensor([7]))
    want_b = fresh.forward(torch.tensor([60]), torch.tensor([d]), torch.tensor([1]))
    assert torch.equal(logits[3], want_b[0])
    if kind == "hf":  # transformers runs a slot's three rows as one product, which sums in another order
        torch.testing.assert_close(logits[2], want_a[0], atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(logits[2], want_a[0])


@pytest.mark.parametrize("kind", ["bf16", "hf"])
def test_bad_rows_are_refused_before_anything_changes(kind):
    net = network(kind, slots=2, max_tokens=8)
    a = net.acquire()
    net.forward(torch.tensor([1, 2]), torch.tensor([a, a]))
    with pytest.raises(ValueError, match="past its 2 cached tokens"):
        net.forward(torch.tensor([3]), torch.tensor([a]), torch.tensor([3]))
    with pytest.raises(ValueError, match="does not follow"):
        net.forward(torch.tensor([3, 4]), torch.tensor([a, a]), torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="not in use"):
        net.forward(torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(ValueError, match="not in 0..1"):
        net.forward(torch.tensor([3]), torch.tensor([5]))
    with pytest.raises(KVCacheFull, match="holds 8"):
        net.forward(torch.arange(7), torch.full((7,), a))
    assert net.length(a) == 2


@pytest.mark.parametrize("kind", ["bf16", "hf"])
def test_slots_are_acquired_released_and_never_leak(kind):
    net = network(kind, slots=3)
    tokenizer = support.sentencepiece()
    retokenizer = Retokenizer(tokenizer, TokenTable.from_tokenizer(tokenizer))
    rng = random.Random(0)
    running: list[tuple[int, DraftContext]] = []
    for request in range(40):  # requests arrive and finish in random order, at most three at once
        if len(running) == 3 or (running and rng.random() < 0.4):
            slot, _ = running.pop(rng.randrange(len(running)))
            net.release(slot)
            continue
        slot = net.acquire()
        context = DraftContext(net.view(slot), retokenizer, PROMPTS[request % 4])
        tokens, _ = context.draft(3, lambda logits: (logits.argmax(), None))
        assert len(tokens) == 3 and net.length(slot) == len(PROMPTS[request % 4]) + 2
        running.append((slot, context))
        assert net.free_slots == 3 - len(running)
    for slot, _ in running:
        net.release(slot)
    assert net.free_slots == net.num_slots == 3


@pytest.mark.parametrize("kind", ["bf16", "hf"])
def test_a_full_table_and_stale_views_are_errors(kind):
    net = network(kind, slots=2)
    a, b = net.acquire(), net.acquire()
    with pytest.raises(NoFreeSlot, match="all 2 drafter slots"):
        net.acquire()
    view = net.view(a)
    view.forward(torch.tensor([1, 2, 3]))
    net.release(a)
    with pytest.raises(ValueError, match="not in use"):
        view.forward(torch.tensor([4]))
    assert net.acquire() == a and net.length(a) == 0
    with pytest.raises(ValueError, match="released and acquired again"):
        view.forward(torch.tensor([4]))
    net.release(b)
    with pytest.raises(ValueError, match="not in use"):
        net.release(b)


@pytest.mark.parametrize("kind", ["nvfp4", "hf"])
def test_a_view_is_the_single_sequence_drafter_of_its_slot(kind):
    net, alone = network(kind, slots=2), network(kind, slots=1)
    net.acquire()  # another sequence holds slot 0
    view, single = net.view(net.acquire()), alone.view(alone.acquire())
    for model in (view, single):
        model.forward(torch.tensor(PROMPTS[0]))
    trees = [model.forward(torch.tensor([40, 41, 42]), torch.tensor([-1, 0, 0])) for model in (view, single)]
    assert torch.equal(trees[0], trees[1])
    for model in (view, single):
        model.truncate(len(PROMPTS[0]) + 1)
    rows = torch.tensor([3, 9, 27])
    chains = [model.forward(torch.tensor([8]), head=model.prune_head(rows)) for model in (view, single)]
    assert torch.equal(chains[0], chains[1]) and chains[0].shape == (1, 3)
