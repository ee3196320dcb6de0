"""The block manager (runtime/engine/blocks.py): allocation, release, prefix keys, LRU eviction."""

import random

import pytest

from hetero_run.runtime.engine.blocks import BlockManager, BlockTable, OutOfBlocks


def test_blocks_grow_shrink_and_return():
    m = BlockManager(8, 4)
    t = BlockTable()
    m.grow(t, 9)
    assert len(t.blocks) == 3 and m.num_free == 5
    m.grow(t, 12)
    assert len(t.blocks) == 3
    m.shrink(t, 5)  # a rejected draft's blocks come back
    assert len(t.blocks) == 2 and m.num_free == 6
    with pytest.raises(OutOfBlocks):
        m.grow(t, 4 * 9)
    assert len(t.blocks) == 2  # unchanged on failure
    m.release(t)
    assert m.num_free == 8 and t.blocks == []


def test_a_shared_prefix_is_reused_block_for_block():
    m = BlockManager(16, 4)
    first = BlockTable()
    tokens = [5, 6, 7, 8, 9, 1, 2, 3, 4]
    m.grow(first, len(tokens))
    m.commit(first, tokens, 9)  # two full blocks keyed, the partial third is not
    again = m.match([5, 6, 7, 8, 9, 1, 2, 3, 7, 7], limit=9)
    assert again.blocks == first.blocks[:2]
    assert m.match([5, 6, 7, 8, 0, 1, 2, 3], limit=8).blocks == first.blocks[:1]  # the chain breaks at block 2
    assert m.match([9, 1, 2, 3], limit=4).blocks == []  # same tokens, other prefix: another key
    assert m.match(tokens, limit=7).blocks == first.blocks[:1]  # limit in tokens, whole blocks only
    assert m.refs[first.blocks[0]] == 4


def test_cached_blocks_survive_release_and_are_evicted_oldest_first():
    m = BlockManager(4, 2)
    a, b = BlockTable(), BlockTable()
    m.grow(a, 4)
    m.commit(a, [1, 2, 3, 4], 4)
    m.release(a)
    assert m.num_free == 4 and len(m.cached) == 2
    m.grow(b, 4)
    m.commit(b, [9, 9, 8, 8], 4)
    m.release(b)
    hit = m.match([1, 2, 3, 4], limit=4)  # still there
    assert len(hit.blocks) == 2
    m.release(hit)
    c = BlockTable()
    m.grow(c, 4)  # evicts the least recently used: b's blocks
    assert m.match([9, 9], limit=2).blocks == []
    assert len(m.match([1, 2, 3, 4], limit=4).blocks) == 2


def test_no_block_leaks_over_many_random_sequences():
    rng = random.Random(0)
    m = BlockManager(64, 4)
    live = []
    prompts = [[rng.randrange(5) for _ in range(12)] for _ in range(6)]
    for _ in range(2000):
        if live and (rng.random() < 0.3 or m.num_free < 8):
            table = live.pop(rng.randrange(len(live)))
            m.release(table)
            continue
        prompt = prompts[rng.randrange(len(prompts))] + [rng.randrange(100) for _ in range(rng.randrange(10))]
        table = m.match(prompt, limit=len(prompt) - 1)
        try:
            m.grow(table, len(prompt) + rng.randrange(8))
        except OutOfBlocks:
            m.release(table)
            continue
        m.commit(table, prompt, len(prompt))
        m.shrink(table, len(prompt))
        live.append(table)
        assert all(r >= 0 for r in m.refs)
    for table in live:
        m.release(table)
    assert m.num_free == 64 and all(r == 0 for r in m.refs)
    assert len(m.free) + len(m.cached) == 64


def test_prefix_caching_off_shares_nothing():
    m = BlockManager(8, 2, enable_prefix_caching=False)
    t = BlockTable()
    m.grow(t, 4)
    m.commit(t, [1, 2, 3, 4], 4)
    m.release(t)
    assert m.match([1, 2, 3, 4], limit=4).blocks == [] and len(m.cached) == 0
