"""The paged cache and batched forwards (runtime/models/batch.py): rows of several sequences in one
forward, over scattered blocks, each equal bit for bit to that sequence run alone; tree rows equal
to decoding their path; a kept branch continues exactly as decoding it would."""

import pytest
import torch
from tiny_models import tiny_checkpoint

from hetero_run.runtime.models.batch import ForwardBatch, depths, tree_extras
from hetero_run.runtime.models.loader import load_model

BLOCK = 4


def _ids(n, seed):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))


def _alone(model, prompt, decode):
    """Logits of prompt's last token, then of each decode token, the sequence alone."""
    model.truncate(0)
    out = [model.forward(prompt, torch.arange(len(prompt)), num_logits=1)]
    for i, t in enumerate(decode.tolist()):
        out.append(model.forward(torch.tensor([t]), torch.tensor([len(prompt) + i])))
    return torch.cat(out)


class Pages:
    """Sequences over blocks handed out in a scrambled order, and batches of their rows."""

    def __init__(self, model, seqs, seed=0):
        self.model = model
        blocks = torch.randperm(model.kv.num_blocks, generator=torch.Generator().manual_seed(seed))
        width = max(-(-len(s) // BLOCK) for s in seqs)
        self.tables = blocks[:len(seqs) * width].view(len(seqs), width)
        self.seqs, self.done = seqs, [0] * len(seqs)

    def step(self, take):
        """take: {sequence: rows to run} -> {sequence: logits of its last row}."""
        ids, pos, seq, last = [], [], [], {}
        for s, n in take.items():
            first = self.done[s]
            n = min(n, len(self.seqs[s]) - first)
            if n == 0:
                continue
            ids += self.seqs[s][first:first + n].tolist()
            pos += list(range(first, first + n))
            seq += [s] * n
            last[s] = len(ids) - 1
            self.done[s] += n
        if not ids:
            return {}
        logical = torch.tensor(pos)
        batch = ForwardBatch(torch.tensor(ids), logical, torch.tensor(seq), logical, logical + 1, self.tables, BLOCK,
                             torch.tensor(list(last.values())))
        batch.check(self.model.kv.num_slots)
        logits = self.model.forward_batch(batch)
        return {s: logits[i] for i, s in enumerate(last)}


@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_rows_of_several_sequences_equal_each_sequence_alone(arch, quant):
    model = load_model(tiny_checkpoint(arch, quant), dtype=torch.bfloat16, max_tokens=64, kv_tokens=256,
                       block_size=BLOCK)
    prompts = [_ids(n, seed=n) for n in (13, 5, 22)]
    decodes = [_ids(6, seed=100 + i) for i in range(3)]
    alone = [_alone(model, p, d) for p, d in zip(prompts, decodes, strict=True)]
    pages = Pages(model, [torch.cat([p, d]) for p, d in zip(prompts, decodes, strict=True)], seed=len(arch))
    got = {s: [] for s in range(3)}
    # prefill in uneven chunks beside other sequences' decode rows; at most 32 rows a step
    schedule = [{0: 8, 1: 5}, {0: 5, 2: 10, 1: 1}, {2: 12, 0: 1, 1: 1}, {0: 1, 1: 1, 2: 1}, {1: 1, 2: 1},
                {0: 1, 2: 1, 1: 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {2: 1}]
    for take in schedule:
        for s, logits in pages.step(take).items():
            if pages.done[s] >= len(prompts[s]):  # the prompt's last row, or a decode row
                got[s].append(logits)
    assert pages.done == [len(s) for s in pages.seqs]
    for s in range(3):
        assert torch.equal(torch.stack(got[s]), alone[s]), s


def test_tree_rows_equal_decoding_their_paths_and_a_kept_branch_continues_exactly():
    model = load_model(tiny_checkpoint("qwen3", "nvfp4"), dtype=torch.bfloat16, max_tokens=64, block_size=BLOCK)
    prompt, tokens = _ids(11, seed=1), _ids(6, seed=2).tolist()
    parents = [-1, 0, 0, 1, 3, 2]  # row 0 the last prompt token; two branches
    model.truncate(0)
    model.forward(prompt[:-1], torch.arange(10), num_logits=1)
    start = model.length
    ids = torch.tensor([int(prompt[-1])] + tokens[1:])
    tree = model.forward(ids, start + torch.tensor(depths(parents)), parents=parents)
    for row in range(len(parents)):
        path, r = [], row
        while r >= 0:
            path.insert(0, r)
            r = parents[r]
        model.truncate(start)
        decoded = torch.cat([model.forward(ids[i:i + 1], torch.tensor([start + d])) for d, i in enumerate(path)])
        assert torch.equal(tree[row], decoded[-1]), row
    # keep rows 0, 1, 3, 4 (the deeper branch), then decode one more token
    model.truncate(start)
    model.forward(ids, start + torch.tensor(depths(parents)), parents=parents)
    model.keep([0, 1, 3, 4])
    assert model.length == start + 4
    nxt = torch.tensor([7])
    after = model.forward(nxt, torch.tensor([start + 4]))
    model.truncate(start)
    straight = model.forward(torch.cat([ids[[0, 1, 3, 4]], nxt]), torch.arange(start, start + 5))
    assert torch.equal(after[0], straight[-1])


def test_keep_accepts_only_a_path_from_row_zero():
    model = load_model(tiny_checkpoint("qwen2", "bf16"), dtype=torch.float32, max_tokens=32)
    model.forward(_ids(5, 3), torch.arange(5))
    parents = [-1, 0, 0, 2]
    model.forward(_ids(4, 4), torch.tensor([5, 6, 6, 7]), parents=parents)
    for bad in ([1, 3], [0, 1, 3], [0, 3], [0, 2, 9]):
        with pytest.raises(ValueError, match="path of children"):
            model.keep(bad)
    model.keep([0, 2, 3])
    assert model.length == 8
    with pytest.raises(ValueError, match="parents must come first"):
        model.forward(_ids(3, 5), torch.tensor([8, 9, 9]), parents=[-1, 2, 0])


def test_a_batch_crosses_as_integers_and_bad_batches_are_refused():
    offsets, extras = tree_extras(5, [-1, 0, 0, 1])
    assert extras.tolist() == [5, 5, 6, 5, 7, 5, 6, 8] and offsets.tolist() == [0, 1, 3, 5, 8]
    batch = ForwardBatch(torch.tensor([3, 4, 5, 6]), torch.tensor([5, 6, 6, 7]), torch.zeros(4, dtype=torch.long),
                         torch.arange(5, 9), torch.full((4,), 5), torch.tensor([[7, 2, 0]]), 4, torch.arange(4),
                         offsets, extras, torch.tensor([[9], [8]]))
    back = ForwardBatch.from_tensor(batch.to_tensor())
    for name in ("ids", "positions", "seq", "logical", "prefix", "block_tables", "logits_rows", "extra_offsets",
                 "extras", "copies"):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    slots, bounds = batch.key_lists()
    # logical 0..3 live in block 7 (slots 28..31), 4..7 in block 2 (8..11), 8 in block 0; each row
    # reads logical 0..4 and then its ancestors and itself
    assert slots[:5].tolist() == [28, 29, 30, 31, 8] and bounds.tolist() == [0, 6, 13, 20, 28]
    assert slots[20:].tolist() == [28, 29, 30, 31, 8, 9, 10, 0]
    assert batch.write_slots().tolist() == [9, 10, 11, 0]
    batch.check(32)
    with pytest.raises(ValueError, match="outside the cache of 30 slots"):
        batch.check(30)
    bad = ForwardBatch.from_tensor(batch.to_tensor())
    bad.logical = torch.tensor([5, 6, 7, 12])
    with pytest.raises(ValueError, match="0 .. 11"):
        bad.check(32)
