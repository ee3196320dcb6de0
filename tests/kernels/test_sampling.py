import pytest
import torch

from hetero_run.kernels.sampling import SamplingParams, logits_to_probs, sample
from hetero_run.topology.errors import ConfigError


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]
    assert sample(probs, None).tolist() == [1, 0]


def test_temperature_matches_softmax():
    logits = torch.randn(4, 50)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs_in = torch.tensor([[0.5, 0.2, 0.3]])
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.0, 0.375]]))
    # Exactly reaching p keeps no more tokens than needed.
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked: the nucleus is in the candidates; flat: it is not
def test_top_p_over_a_large_vocabulary_equals_the_full_sort(scale):
    torch.manual_seed(0)
    logits = torch.randn(5, 151936) * scale
    got = logits_to_probs(logits, SamplingParams(temperature=0.7, top_p=0.9))
    probs = torch.softmax(logits / 0.7, dim=-1)
    values, order = torch.sort(probs, dim=-1, descending=True)
    values = values.masked_fill(values.cumsum(-1) - values >= 0.9, 0.0)
    expected = torch.zeros_like(probs).scatter_(-1, order, values)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.equal(got, expected)
    kept = (got > 0).sum(-1)
    assert (kept < 1024).all() if scale > 1 else (kept > 1024).all()  # both paths ran


def test_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    torch.testing.assert_close(probs[0, [1, 2]], expected)
    assert probs[0, 0] == 0 and probs[0, 3] == 0


def test_seeded_sampling_repeats_and_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.6, 0.3]]).repeat(20000, 1)
    a = sample(probs, SamplingParams(temperature=1, seed=3).generator())
    b = sample(probs, SamplingParams(temperature=1, seed=3).generator())
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.015, rtol=0)


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                           ({"top_k": -2}, "top_k")])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_keyed_draws_follow_p_and_depend_only_on_seed_and_position():
    from hetero_run.kernels.sampling import keyed_noise, sample_keyed

    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]])
    draws = torch.cat([sample_keyed(p, seed, [7]) for seed in range(4000)])
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[5] == 0
    expected = p[0, :5].double() * 4000
    assert ((counts[:5] - expected) ** 2 / expected).sum() < 18.47  # chi-square, 4 degrees of freedom, p = 0.001
    assert torch.equal(keyed_noise(3, 9, 10), keyed_noise(3, 9, 10))
    assert not torch.equal(keyed_noise(3, 9, 10), keyed_noise(3, 10, 10))
    assert not torch.equal(keyed_noise(3, 9, 10), keyed_noise(4, 9, 10))
    # a drafter over part of the vocabulary races over the target's noise for those ids
    q, ids = torch.tensor([[0.6, 0.4]]), torch.tensor([4, 1])
    for seed in range(50):
        noise = keyed_noise(seed, 2, 5)
        assert int(ids[sample_keyed(q, seed, [2], ids, vocab=5)]) == int(ids[torch.argmax(q[0] / noise[ids])])


def test_keyed_noise_for_part_of_the_vocabulary_needs_the_whole_width():
    from hetero_run.kernels.sampling import sample_keyed

    with pytest.raises(ValueError, match="outside the vocabulary of 2"):
        sample_keyed(torch.tensor([[0.6, 0.4]]), 1, [2], torch.tensor([4, 1]))


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 1000, 151936])
def test_argmax_rows_is_torch_argmax(row_ops, vocab):
    """The compiled scan returns torch.argmax's index on every kind of row: random, ties within a
    lane and across lanes (the first index wins), the maximum in the tail, all -inf, NaN (the
    first NaN, as torch), +inf."""
    from hetero_run.kernels.sampling import argmax_rows

    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) for _ in range(3)]
    tie = torch.randn(vocab, generator=g)
    tie[[i for i in (3, 19, 35, vocab - 1) if i < vocab]] = 10.0  # same lane (3, 19, 35) and others
    rows.append(tie)
    tail = torch.randn(vocab, generator=g)
    tail[-1] = 50.0
    rows.append(tail)
    rows.append(torch.full((vocab,), float("-inf")))
    for special in (float("nan"), float("inf")):
        row = torch.randn(vocab, generator=g)
        row[[i for i in (vocab // 2, vocab - 1) if i < vocab]] = special
        rows.append(row)
    x = torch.stack(rows)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax_rows(x[2:5]), x[2:5].argmax(-1))  # a slice of rows, as the engine passes
