"""SLRS: psi is exactly the distribution of the walk's proposal, over drafter segmentations."""

from __future__ import annotations

from collections import Counter

import pytest
import speculative_support as support
import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.pairing import Pairing
from hetero_run.runtime.speculative.proposer import DraftSession
from hetero_run.runtime.speculative.slrs import SlrsProposer, Tree, proposal, walk


def test_hand_worked_example():
    """Drafter tokens 0="he", 1="y", 2="hey", 3="x"; target tokens 10="he", 11="hey".
    q(root) = he .5, hey .3, x .2; q(after "he") = y .4, the rest .6."""
    tree = Tree()
    he = tree.add(0, -1, b"he", 0.5, 10, False)
    hey = tree.add(2, -1, b"hey", 0.3, 11, False)
    he_y = tree.add(1, he, b"hey", 0.5 * 0.4, 11, False)
    tree.probs = [torch.tensor([0.3, 0.4, 0.0, 0.3]), torch.tensor([0.25] * 4), torch.tensor([0.25] * 4)]
    psi = proposal(tree, 12)
    assert psi[11].item() == pytest.approx(0.5 * 0.4 + 0.3)  # two segmentations of "hey"
    assert psi[10].item() == pytest.approx(0.5 * (1 - 0.4))  # "he" not followed by "y"
    assert psi.sum().item() == pytest.approx(0.8)  # 0.2: the walk proposes nothing ("x")
    root = torch.tensor([0.5, 0.0, 0.3, 0.2])
    gen = torch.Generator().manual_seed(0)
    draws = Counter(walk(tree, root, gen) for _ in range(20000))
    freq = {None: draws[None] / 20000, 10: draws[he] / 20000, 11: (draws[hey] + draws[he_y]) / 20000}
    assert freq[11] == pytest.approx(0.5, abs=0.012)
    assert freq[10] == pytest.approx(0.3, abs=0.012)
    assert freq[None] == pytest.approx(0.2, abs=0.012)


@pytest.mark.parametrize("drafter_name", ["sentencepiece", "trailing_space"])
def test_grown_trees_give_psi_equal_to_the_walk_frequencies(drafter_name):
    target_tok = support.byte_level()
    drafter_tok = support.TOKENIZERS[drafter_name]()
    model, _ = support.restricted_pair_lm(drafter_tok, "the ", seed=5, cls=support.PairDrafter, spread=1.0)
    pairing = Pairing(target_tok, drafter_tok)
    context = DraftContext(model, pairing.drafter_retokenizer, drafter_tok("the t", add_special_tokens=False)
                           ["input_ids"])
    gen = torch.Generator().manual_seed(1)
    session = DraftSession(pairing, context, target_tok("the t")["input_ids"], 400, SamplingParams(temperature=1.0),
                           gen)
    proposer = SlrsProposer(session, SpeculationConfig(algorithm="slrs", slrs_width=6, slrs_depth=3,
                                                        slrs_max_nodes=40))
    root = proposer._probs(context.catch_up()[None])[0]
    tree = proposer._grow(root, [])
    psi = proposal(tree, 400)
    spellings = Counter(tree.target[n] for n in range(len(tree.tokens)) if tree.target[n] is not None)
    assert max(spellings.values()) >= 2, "some target token should have several drafter segmentations"
    runs = 30000
    draws = Counter()
    for _ in range(runs):
        node = walk(tree, root, gen)
        draws[None if node is None else tree.target[node]] += 1
    for target, count in draws.items():
        expected = 1 - psi.sum().item() if target is None else psi[target].item()
        assert count / runs == pytest.approx(expected, abs=0.012), target
    assert set(draws) - {None} <= set(psi.nonzero().flatten().tolist())
