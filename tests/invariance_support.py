"""The batch-invariance check shared by the in-process test and the `mpirun -np 2` job.

After a prompt, a forward of n tokens must give every row the logits n one-token forwards
give (torch.equal), and leave the same KV cache bits; also after a rollback and re-append.
Every rank of a group calls `mismatches` with the same arguments; logits exist on rank 0 only,
each rank compares its own KV cache shard.
"""

import torch

SIZES = (2, 3, 5, 9, 13, 17, 25, 32)


def _cache(model, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return model.kv.k[:, :, :length].clone(), model.kv.v[:, :, :length].clone()


def _one_by_one(model, ids: torch.Tensor, start: int) -> torch.Tensor | None:
    rows = [model.forward(ids[i:i + 1], torch.tensor([start + i])) for i in range(len(ids))]
    return None if rows[0] is None else torch.cat(rows)


def _compare(model, ids: torch.Tensor, start: int, what: str) -> list[str]:
    """Forward ids at slots start.. at once, then one by one from the same cache; the differences."""
    n = len(ids)
    together = model.forward(ids, torch.arange(start, start + n))
    cache = _cache(model, start + n)
    model.truncate(start)
    alone = _one_by_one(model, ids, start)
    bad = []
    if together is not None and not torch.equal(together, alone):
        diff = (together - alone).abs().max().item()
        bad.append(f"{what} n={n}: logits differ (max {diff:.3g})")
    if not all(torch.equal(a, b) for a, b in zip(cache, _cache(model, start + n), strict=True)):
        bad.append(f"{what} n={n}: KV cache differs")
    return bad


def mismatches(model, seed: int = 0, prompt: int = 40, sizes=SIZES) -> list[str]:
    """Every way a multi-token forward of `model` differs from one-token forwards (empty: none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompt + 2 * max(sizes),), generator=g)
    bad = []
    for n in sizes:
        model.truncate(0)
        model.forward(ids[:prompt], torch.arange(prompt), num_logits=1)  # prefill: any path
        bad += _compare(model, ids[prompt:prompt + n], prompt, "after the prompt")
        keep = prompt + n // 2  # roll back part of the verified tokens, then append others
        model.truncate(keep)
        bad += _compare(model, ids[prompt + n:prompt + 2 * n], keep, "after a rollback")
    return bad
