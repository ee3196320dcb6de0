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


def fused_and_plain(model) -> tuple[list, list]:
    """The logits of one script (a prompt, a 5-row verify, a rollback, 3 one-token decodes, a 2-row
    tree) with the model's decoder layers fused (kernels/decoder_layer.py), then again with them
    run operation by operation. Tiny models start with unit norms and zero biases, which would hide
    a mixed-up norm or a missing bias, so those are randomised first, in place (both paths share
    them). Every rank of a group calls it alike."""
    g = torch.Generator().manual_seed(2)
    for layer in model.layers:
        a = layer.attention
        for t in (layer.input_norm, layer.post_norm, a.qk_norm, a.qkv.bias, a.o.bias):
            if t is not None:
                t.copy_(1 + 0.5 * torch.randn(t.shape, generator=g))
    ids = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1))

    def script() -> list:
        model.truncate(0)
        out = [model.forward(ids[:17], torch.arange(17)), model.forward(ids[17:22], torch.arange(17, 22))]
        model.truncate(19)
        out += [model.forward(ids[22 + i:23 + i], torch.tensor([19 + i])) for i in range(3)]
        out.append(model.forward(ids[25:28], torch.tensor([22, 23, 23]), parents=[-1, 0, 0]))
        return out

    fused = script()
    for layer in model.layers:
        layer.fused = None
    return fused, script()
