"""The exact distribution of a tiny target's first three sampled tokens, and a chi-square test
against observed counts (shared by the TP=1 test and the mpirun job)."""

from __future__ import annotations

from collections import Counter

import torch

from hetero_run.kernels.sampling import SamplingParams, logits_to_probs

SAMPLING = SamplingParams(temperature=1.0, top_k=3)
PROMPT = "The cat"


@torch.inference_mode()
def exact_joint(runner, prompt_ids: list[int], sampling: SamplingParams = SAMPLING) -> dict[tuple, float]:
    """p(t1) p(t2 | t1) p(t3 | t1, t2) for every triple the target can sample, target alone."""
    n = len(prompt_ids)
    out = {}
    runner.truncate(0)
    p1 = logits_to_probs(runner.forward(torch.tensor(prompt_ids), torch.arange(n))[-1:], sampling)[0]
    for t1 in p1.nonzero().flatten().tolist():
        runner.truncate(n)
        p2 = logits_to_probs(runner.forward(torch.tensor([t1]), torch.tensor([n])), sampling)[0]
        for t2 in p2.nonzero().flatten().tolist():
            runner.truncate(n + 1)
            p3 = logits_to_probs(runner.forward(torch.tensor([t2]), torch.tensor([n + 1])), sampling)[0]
            for t3 in p3.nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    runner.truncate(0)
    return out


def chi_square_p_value(counts: Counter, expected: dict, runs: int) -> float:
    """P-value of `counts` against probabilities `expected` (cells expecting < 5 pooled); 0 when
    an outcome of probability 0 was seen."""
    if any(cell not in expected for cell in counts):
        return 0.0
    cells, pooled_e, pooled_o = [], 0.0, 0
    for cell, prob in expected.items():
        e = prob * runs
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + counts.get(cell, 0)
        else:
            cells.append((counts.get(cell, 0), e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_triples(engine, runs: int, sampling: SamplingParams = SAMPLING,
                   first_seed: int = 0) -> tuple[Counter, float]:
    from dataclasses import replace

    counts, accepted, drafted = Counter(), 0, 0
    for seed in range(first_seed, first_seed + runs):
        result = engine.generate(PROMPT, 3, replace(sampling, seed=seed), stop_ids=set())
        counts[tuple(result.token_ids)] += 1
        accepted, drafted = accepted + result.accepted, drafted + result.drafted
    return counts, accepted / max(1, drafted)
