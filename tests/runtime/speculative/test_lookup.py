"""Prompt lookup: longest earlier match of prompt_lookup_min..max tokens, most recent of equals."""

from __future__ import annotations

from hetero_run.runtime.speculative.lookup import PromptLookup, TokenIndex


def test_the_docstring_example():
    a, b, c, d, x = range(1, 6)
    lookup = PromptLookup([a, b, c, d, x, a, b, c], min_len=2, max_len=5)
    found = lookup.propose(3)
    assert found.tokens == [d, x, a] and found.parents == [-1, 0, 1] and lookup.last_match == 3
    assert found.buckets == [3, 3, 3]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    lookup = PromptLookup([7, 1, 2, 3, 50, 9, 2, 3, 60, 8, 1, 2, 3], min_len=2, max_len=4)
    assert lookup.propose(2).tokens == [50, 9]  # "1 2 3" matched at 1..3; "2 3" alone at 6..7 is shorter


def test_among_equal_matches_the_most_recent():
    lookup = PromptLookup([1, 2, 10, 1, 2, 20, 1, 2], min_len=2, max_len=4)
    assert lookup.propose(1).tokens == [20]


def test_no_match_below_min_and_growth_as_tokens_arrive():
    lookup = PromptLookup([1, 2, 3, 4], min_len=2, max_len=4)
    assert len(lookup.propose(4)) == 0
    lookup.extend([1])
    assert len(lookup.propose(4)) == 0  # one token matches, two are needed
    lookup.extend([2])
    assert lookup.propose(4).tokens == [3, 4, 1, 2]


def test_min_one_uses_single_tokens():
    lookup = PromptLookup([5, 6, 7, 5], min_len=1, max_len=3)
    assert lookup.propose(2).tokens == [6, 7] and lookup.last_match == 1


def test_token_index_positions_and_match_lengths():
    index = TokenIndex([1, 2, 3, 1, 2])
    assert index.pairs[(1, 2)] == [2, 5] and index.singles[2] == [2, 5]
    tokens = index.tokens
    assert index.matches([9, 3, 1, 2], limit=8, scan=4, exclude=5) == [(tokens, 2, 2)]
    assert index.matches([3, 1, 2], limit=8, scan=4) == [(tokens, 5, 3), (tokens, 2, 2)]
    assert index.matches([7, 2], limit=8, scan=4, min_len=1) == [(tokens, 5, 1), (tokens, 2, 1)]
