"""Suffix decoding: the shared, bounded, thread-confined cache of earlier generations and each
request's own state; the speculation tree's counts, floor, depth cap and size cap."""

from __future__ import annotations

import threading

import pytest

from hetero_run.runtime.speculative.suffix import UNIGRAM_BUCKETS, SuffixCache, SuffixState, speculation_tree


def test_the_docstring_example_counts_continuations():
    x, y, z, a, b = 1, 2, 3, 4, 5
    history = [x, y, z, a, 9, x, y, z, a, 9, x, y, z, b]
    tree = speculation_tree([(history, 2), (history, 7), (history, 12)], max_nodes=8, max_depth=4, min_prob=0.0)
    nodes = dict(zip(zip(tree.parents, tree.tokens, strict=True), tree.probs, strict=True))
    assert nodes[(-1, z)] == 1.0
    root = tree.tokens.index(z)
    assert abs(nodes[(root, a)] - 2 / 3) < 1e-9 and abs(nodes[(root, b)] - 1 / 3) < 1e-9
    assert tree.buckets[tree.tokens.index(b)] == 3


def test_probability_floor_depth_cap_and_size_cap():
    history = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]
    occ = [(history, p) for p in (2, 8, 14, 20)]
    floor = speculation_tree(occ, max_nodes=10, max_depth=10, min_prob=0.3)
    assert 7 not in floor.tokens  # 1/4 of the continuations: under the floor
    deep = speculation_tree(occ, max_nodes=10, max_depth=2, min_prob=0.0)
    depth = [0] * len(deep)
    for i, p in enumerate(deep.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert max(depth) == 2
    assert len(speculation_tree(occ, max_nodes=3, max_depth=10, min_prob=0.0)) == 3


def test_a_request_finds_its_own_repeats_and_earlier_generations():
    cache = SuffixCache(max_generations=4)
    first = SuffixState(cache, [100, 101], spec_factor=4.0)
    first.extend([1, 2, 3, 4, 5])
    first.finish()
    first.finish()
    assert len(cache.generations) == 1  # once
    second = SuffixState(cache, [200, 1, 2], spec_factor=4.0)
    found = second.propose(4)
    assert found.tokens == [3, 4, 5] and second.last_match == 2
    second.extend([3, 9, 9, 1, 2])
    assert second.propose(4).tokens[0] in (3, 9)  # its own text and the cache both know "1 2"


def test_the_request_and_the_earlier_generations_are_counted_together():
    cache = SuffixCache()
    for generation in ([1, 2, 7, 0], [1, 2, 7, 0], [1, 2, 8, 0]):
        cache.add(generation)
    state = SuffixState(cache, [9, 1, 2, 8, 4, 1, 2], spec_factor=1.0)
    tree = state.propose(8)  # "1 2" followed by 8 here and 7, 7, 8 in the cache: 2/4 each
    assert sorted(tree.tokens) == [7, 8] and tree.probs == [0.5, 0.5] and state.last_match == 2


def test_the_spec_factor_bounds_the_tree_by_the_match_length():
    state = SuffixState(None, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], spec_factor=1.0)
    assert state.propose(8).tokens == [3, 4]  # match of 2 tokens: at most 2 nodes


def test_the_offset_adds_nodes_beyond_the_match_length():
    state = SuffixState(None, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], spec_factor=1.0, spec_offset=3.0)
    assert state.propose(8).tokens == [3, 4, 5, 6, 7]  # match of 2 tokens: at most 2 + 3 nodes


def test_a_last_token_seen_only_alone_proposes_what_followed_it():
    # "7" occurred three times in the prompt (followed by 8 9, 8 9, 8 5), never after a 3
    prompt = [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 5, 3, 7]
    state = SuffixState(None, prompt, spec_factor=1.0, spec_offset=1.0)
    tree = state.propose(8)
    assert state.last_match == 1 and tree.tokens == [8, 9]  # 1 * 1 + 1 nodes, the likeliest
    assert tree.probs[0] == 1.0 and abs(tree.probs[1] - 2 / 3) < 1e-9
    assert all(b >= UNIGRAM_BUCKETS for b in tree.buckets)  # calibrated apart from longer matches
    assert len(SuffixState(None, prompt, spec_offset=2.0, min_match=2).propose(8)) == 0
    # the earlier generations answer a one-token match too, where the request's own text has none
    cache = SuffixCache()
    cache.add([40, 41, 42, 40, 41, 43])
    other = SuffixState(cache, [1, 2, 40], spec_factor=1.0, spec_offset=1.0)
    assert other.propose(8).tokens == [41, 42] or other.propose(8).tokens == [41, 43]
    assert other.last_match == 1
    longer = SuffixState(cache, [1, 42, 40], spec_factor=1.0, spec_offset=1.0)
    assert longer.propose(8).tokens == [41, 43] and longer.last_match == 2  # "42 40": the pair wins


def test_the_cache_is_bounded_and_evicts_the_oldest():
    cache = SuffixCache(max_generations=2, max_tokens=5)
    for g in range(5):
        cache.add([g, g + 1, g + 2, g + 3, g + 4, g + 5, g + 6])
    assert list(cache.generations) == [3, 4] and cache.tokens == 10
    assert cache.matches([3, 4], limit=8, scan=8) == [(cache.generations[3], 2, 2)]
    for g in range(5, 3000):
        cache.add([g % 7, g % 11, g % 13])
    assert cache.entries <= 2 * max(cache.live, 1024)  # evicted entries are compacted away


def test_the_cache_belongs_to_the_thread_that_first_uses_it():
    cache = SuffixCache()
    cache.add([4, 5, 6])  # this thread owns it now
    errors = []

    def other():
        try:
            cache.add([1, 2, 3])
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "thread" in errors[0]


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        SuffixCache(max_generations=-1)
