"""Sampled generations follow the target's distribution exactly, for every algorithm with a q.

Tiny vocabularies inside real (trained) tokenizers: target and drafter put all probability on
tokens spelled with the letters of "the " (12 target tokens, 8-14 drafter tokens, multi-token
strings such as " the" / " th" + "e" included). The target's first generated token is forced,
so the next two are the first speculative ones; their joint frequency over thousands of
seeded generations is compared with the exact joint p(t2) p(t3 | t2) by a chi-square test.
The same test run against a verifier with the textbook bug (recovered tokens drawn from p
instead of the residual max(0, p - q)) must fail, which shows the test can see a wrong verifier.

Both sampled verifications are tested: rejection sampling against q, and keyed verification
(verifier.KeyedSampler, the default for seeded requests), whose tokens must in addition be
the target alone's for the same seed, whatever the algorithm drafted.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import speculative_support as support
import torch

from hetero_run.kernels.sampling import SamplingParams, logits_to_probs
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.speculative import verifier
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.verifier import KeyedSampler, RejectionSampler
from hetero_run.runtime.speculative.vocab import Intersection, TokenTable

ALPHABET = "the "
PLAIN = SamplingParams(temperature=1.0)
PROMPT = "the t"
RUNS = 2000
BROKEN_RUNS = 1200


class ResidualIsP(RejectionSampler):
    """The classic mistake: at a rejection, draw from p instead of norm(max(0, p - q))."""

    @staticmethod
    def _residual(p_row, q_row):
        return p_row


def chi_square_p_value(counts: Counter, expected: dict, runs: int) -> float:
    """P-value of observed `counts` against probabilities `expected` (cells with an expected
    count under 5 are pooled)."""
    cells, pooled_e, pooled_o = [], 0.0, 0
    for cell, prob in expected.items():
        e = prob * runs
        if e < 5:
            pooled_e += e
            pooled_o += counts.get(cell, 0)
        else:
            cells.append((counts.get(cell, 0), e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    unexpected = sum(n for cell, n in counts.items() if cell not in expected)
    if unexpected:
        return 0.0  # an outcome the target gives probability 0
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def build(algorithm: str, drafter_tokenizer: str, sampling: SamplingParams = PLAIN, verification: str = "rejection"):
    target_tok = support.byte_level()
    target, allowed = support.restricted_pair_lm(target_tok, ALPHABET, seed=11, cls=support.PairTarget)
    prompt_ids = target_tok(PROMPT)["input_ids"]
    forced = int(allowed.nonzero()[3])
    target.a[prompt_ids[-1]] = float("-inf")
    target.a[prompt_ids[-1], forced] = 0.0
    p2 = logits_to_probs((target.a[forced] + target.b[prompt_ids[-1]])[None], sampling)[0]
    expected = {}
    for t2 in p2.nonzero().flatten().tolist():
        p3 = logits_to_probs((target.a[t2] + target.b[forced])[None], sampling)[0]
        for t3 in p3.nonzero().flatten().tolist():
            expected[(t2, t3)] = float(p2[t2] * p3[t3])
    tokenizer = target_tok if drafter_tokenizer == "same" else support.TOKENIZERS[drafter_tokenizer]()
    model, _ = support.restricted_pair_lm(tokenizer, ALPHABET, seed=5, cls=support.PairDrafter)
    imitate(model, target, tokenizer, target_tok)
    engine = SpeculativeEngine(target, target_tok, Drafter(model, tokenizer, "pair-drafter"),
                               SpeculationConfig(algorithm=algorithm, draft_len=3, adaptive=False,
                                                 sampled_verification=verification))
    return engine, forced, expected


def imitate(drafter, target, drafter_tok, target_tok) -> None:
    """Give the drafter the target's preferences (plus noise) on the tokens they share, so that
    drafts are accepted often (and still rejected sometimes)."""
    shared = Intersection.build(TokenTable.from_tokenizer(drafter_tok), TokenTable.from_tokenizer(target_tok))
    d, t = shared.draft_ids, shared.target_ids
    keep = drafter.a[0, d] > float("-inf")  # tokens of the tiny vocabulary only
    d, t = d[keep], t[keep]
    gen = torch.Generator().manual_seed(9)
    drafter.a[d[:, None], d[None, :]] = target.a[t[:, None], t[None, :]] + 0.7 * torch.randn(len(d), len(d),
                                                                                            generator=gen)
    drafter.b[d[:, None], d[None, :]] = target.b[t[:, None], t[None, :]]


def sample_pairs(engine, forced: int, runs: int, sampling: SamplingParams = PLAIN) -> tuple[Counter, float]:
    counts, accepted, drafted = Counter(), 0, 0
    for seed in range(runs):
        result = engine.generate(PROMPT, max_new_tokens=3, sampling=replace(sampling, seed=seed), stop_ids=set())
        assert result.token_ids[0] == forced
        counts[tuple(result.token_ids[1:3])] += 1
        accepted += result.accepted
        drafted += result.drafted
    return counts, accepted / max(1, drafted)


CASES = [("standard", "same"), ("tli", "sentencepiece"), ("slrs", "sentencepiece"), ("slrs", "trailing_space")]


@pytest.mark.parametrize("algorithm, drafter_tokenizer", CASES)
def test_sampled_tokens_follow_the_target_distribution(algorithm, drafter_tokenizer):
    engine, forced, expected = build(algorithm, drafter_tokenizer)
    counts, acceptance = sample_pairs(engine, forced, RUNS)
    p_value = chi_square_p_value(counts, expected, RUNS)
    assert acceptance > 0.25, "the drafts must be accepted often enough for the test to mean something"
    assert p_value > 1e-3, (p_value, acceptance)


def test_top_p_and_top_k_sampling_is_exact_too():
    """p after top-k / top-p, q without top-p: the distribution is still exactly p."""
    sampling = SamplingParams(temperature=0.8, top_p=0.85, top_k=6)
    engine, forced, expected = build("tli", "sentencepiece", sampling)
    counts, acceptance = sample_pairs(engine, forced, RUNS, sampling)
    assert acceptance > 0.25
    assert chi_square_p_value(counts, expected, RUNS) > 1e-3


@pytest.mark.parametrize("algorithm, drafter_tokenizer", CASES[:3])
def test_a_broken_verifier_fails_the_same_test(monkeypatch, algorithm, drafter_tokenizer):
    monkeypatch.setattr(verifier, "RejectionSampler", ResidualIsP)
    engine, forced, expected = build(algorithm, drafter_tokenizer)
    counts, _ = sample_pairs(engine, forced, BROKEN_RUNS)
    assert chi_square_p_value(counts, expected, BROKEN_RUNS) < 1e-6


def test_chi_square_helper_accepts_exact_samples_and_rejects_skewed_ones():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = torch.multinomial(probs, 4000, replacement=True, generator=gen).tolist()
    expected = {(i,): float(p) for i, p in enumerate(probs)}
    assert chi_square_p_value(Counter((d,) for d in draws), expected, 4000) > 1e-3
    skewed = torch.multinomial(torch.tensor([0.45, 0.35, 0.15, 0.05]), 4000, replacement=True, generator=gen)
    assert chi_square_p_value(Counter((d,) for d in skewed.tolist()), expected, 4000) < 1e-3
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-6)


def test_slrs_with_psi_missing_its_stay_factor_fails_the_same_test(monkeypatch):
    """psi(t) must count only walks that pass no longer candidate; counting every walk through
    t (psi summed over segmentations alone) over-states it and the output drifts from p."""
    from hetero_run.runtime.speculative import slrs

    def reach_only(tree, target_vocab):
        psi = torch.zeros(target_vocab)
        for n, target in enumerate(tree.target):
            if target is not None:
                psi[target] += tree.reach[n]
        return psi

    monkeypatch.setattr(slrs, "proposal", reach_only)
    engine, forced, expected = build("slrs", "sentencepiece")
    counts, _ = sample_pairs(engine, forced, BROKEN_RUNS)
    assert chi_square_p_value(counts, expected, BROKEN_RUNS) < 1e-6


class Recording(RejectionSampler):
    """The real verifier, noting the widest row of every tree it walks."""

    widest: list[int] = []

    def __call__(self, plan, target_logits):
        parents = plan.parent_rows()
        Recording.widest.append(max([parents[1:].count(r) for r in range(len(parents))], default=0))
        return super().__call__(plan, target_logits)


class BranchesIndependently(Recording):
    """The usual multi-candidate mistake: each fixed child is tried with probability r(child),
    independently, in order; when none is taken the recovered token is drawn from r as it was."""

    def _choose(self, r, children):
        for token in children:
            if float(torch.rand((), generator=self.generator)) < float(r[token]):
                return token
        return int(torch.multinomial(r, 1, generator=self.generator)[0])


class FrozenSuffixCache:
    """Earlier generations that several continuations of the prompt's end went through, kept
    as they are (generations of the test itself are not added)."""

    def __new__(cls, generations):
        from hetero_run.runtime.speculative.suffix import SuffixCache

        cache = SuffixCache(max_generations=len(generations))
        for tokens in generations:
            cache.add(tokens)
        cache.add = lambda tokens: None
        return cache


def build_tree(algorithm: str, drafter_tokenizer: str | None, sampling: SamplingParams = PLAIN,
               verification: str = "rejection"):
    """As `build`, on a target that verifies trees, with a suffix cache whose continuations of
    the prompt's last token and the forced token branch three ways, then two."""
    target_tok = support.byte_level()
    target, allowed = support.restricted_pair_lm(target_tok, ALPHABET, seed=11, cls=support.TreePairTarget)
    prompt_ids = target_tok(PROMPT)["input_ids"]
    tokens = allowed.nonzero().flatten().tolist()
    forced = tokens[3]
    target.a[prompt_ids[-1]] = float("-inf")
    target.a[prompt_ids[-1], forced] = 0.0
    p2 = logits_to_probs((target.a[forced] + target.b[prompt_ids[-1]])[None], sampling)[0]
    likely = p2.argsort(descending=True).tolist()
    expected = {}
    for t2 in p2.nonzero().flatten().tolist():
        p3 = logits_to_probs((target.a[t2] + target.b[forced])[None], sampling)[0]
        for t3 in p3.nonzero().flatten().tolist():
            expected[(t2, t3)] = float(p2[t2] * p3[t3])
    history = [[prompt_ids[-1], forced, likely[i % 3], likely[(i + 1) % 4]] for i in range(6)]
    drafter = None
    if drafter_tokenizer is not None:
        tokenizer = target_tok if drafter_tokenizer == "same" else support.TOKENIZERS[drafter_tokenizer]()
        model, _ = support.restricted_pair_lm(tokenizer, ALPHABET, seed=5, cls=support.PairDrafter)
        imitate(model, target, tokenizer, target_tok)
        drafter = Drafter(model, tokenizer, "pair-drafter")
    config = SpeculationConfig(algorithm=algorithm, draft_len=2, adaptive=False, hybrid=drafter is not None,
                               modelfree=("suffix",), suffix_spec_factor=4.0, suffix_min_prob=0.05,
                               suffix_spec_offset=0.0, suffix_min_match=2,  # the trees drawn above, no others
                               sampled_verification=verification)
    engine = SpeculativeEngine(target, target_tok, drafter, config, suffix_cache=FrozenSuffixCache(history))
    assert engine.trees
    return engine, forced, expected


TREE_CASES = [("suffix", None), ("tli", "sentencepiece"), ("standard", "same")]


@pytest.mark.parametrize("algorithm, drafter_tokenizer", TREE_CASES)
def test_sampled_trees_with_several_branches_follow_the_target_distribution(monkeypatch, algorithm,
                                                                           drafter_tokenizer):
    monkeypatch.setattr(verifier, "RejectionSampler", Recording)
    Recording.widest = []
    engine, forced, expected = build_tree(algorithm, drafter_tokenizer)
    counts, acceptance = sample_pairs(engine, forced, RUNS)
    assert max(Recording.widest) >= 3, "the trees must branch for the test to mean something"
    assert acceptance > 0.05  # accepted per verified row: a tree verifies several rows per depth
    assert chi_square_p_value(counts, expected, RUNS) > 1e-3


@pytest.mark.parametrize("algorithm, drafter_tokenizer", TREE_CASES[:2])
def test_a_tree_verifier_taking_branches_independently_fails_the_same_test(monkeypatch, algorithm,
                                                                           drafter_tokenizer):
    monkeypatch.setattr(verifier, "RejectionSampler", BranchesIndependently)
    engine, forced, expected = build_tree(algorithm, drafter_tokenizer)
    counts, _ = sample_pairs(engine, forced, RUNS)
    assert chi_square_p_value(counts, expected, RUNS) < 1e-6


# -- keyed verification ------------------------------------------------------------------------

class KeyedRecording(KeyedSampler):
    widest: list[int] = []

    def __call__(self, plan, target_logits):
        parents = plan.parent_rows()
        KeyedRecording.widest.append(max([parents[1:].count(r) for r in range(len(parents))], default=0))
        return super().__call__(plan, target_logits)


class KeyedOnSeedOnly(KeyedSampler):
    """The mistake keyed sampling must not make: one noise vector for every position of a
    request (keyed by the seed alone), so consecutive tokens are drawn from dependent noise."""

    @staticmethod
    def _position(plan, depth):
        return 0


@pytest.mark.parametrize("algorithm, drafter_tokenizer", CASES[:3])
def test_keyed_sampled_tokens_follow_the_target_distribution(algorithm, drafter_tokenizer):
    engine, forced, expected = build(algorithm, drafter_tokenizer, verification="keyed")
    counts, acceptance = sample_pairs(engine, forced, RUNS)
    assert acceptance > 0.25, "the drafts must be accepted often enough for the test to mean something"
    assert chi_square_p_value(counts, expected, RUNS) > 1e-3


def test_keyed_sampled_trees_follow_the_target_distribution(monkeypatch):
    monkeypatch.setattr(verifier, "KeyedSampler", KeyedRecording)
    KeyedRecording.widest = []
    engine, forced, expected = build_tree("tli", "sentencepiece", verification="keyed")
    counts, _ = sample_pairs(engine, forced, RUNS)
    assert max(KeyedRecording.widest) >= 3, "the trees must branch for the test to mean something"
    assert chi_square_p_value(counts, expected, RUNS) > 1e-3


def test_keyed_noise_shared_by_every_position_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(verifier, "KeyedSampler", KeyedOnSeedOnly)
    engine, forced, expected = build("standard", "same", verification="keyed")
    counts, _ = sample_pairs(engine, forced, BROKEN_RUNS)
    assert chi_square_p_value(counts, expected, BROKEN_RUNS) < 1e-6


def test_a_seed_gives_the_target_alones_tokens_whatever_was_drafted():
    """Keyed: the same seed, the same tokens, for the target alone and every algorithm (chains
    and trees, drafts of every length); rejection sampling's output depends on the drafts."""
    sampling = replace(PLAIN, temperature=0.9)
    engines = {name: build(name, tok, sampling, verification="keyed")[0]
               for name, tok in [("none", "same"), ("standard", "same"), ("tli", "sentencepiece"),
                                 ("slrs", "sentencepiece")]}
    engines["suffix tree"] = build_tree("suffix", None, sampling, verification="keyed")[0]
    engines["tli+suffix tree"] = build_tree("tli", "sentencepiece", sampling, verification="keyed")[0]
    rejection = build("standard", "same", sampling)[0]
    differs = 0
    for seed in range(40):
        alone = engines["none"].generate(PROMPT, max_new_tokens=8, sampling=replace(sampling, seed=seed),
                                         stop_ids=set())
        for name, engine in engines.items():
            got = engine.generate(PROMPT, max_new_tokens=8, sampling=replace(sampling, seed=seed), stop_ids=set())
            assert got.token_ids == alone.token_ids, (name, seed)
        other = rejection.generate(PROMPT, max_new_tokens=8, sampling=replace(sampling, seed=seed), stop_ids=set())
        differs += other.token_ids != alone.token_ids
    assert differs > 0, "rejection sampling draws other streams: the keyed test above is not vacuous"
