"""bench/speculative.py's foresight bound: what drafting from earlier occurrences could reach."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_speculative",
                                               Path(__file__).parents[1] / "bench" / "speculative.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

VERIFY = {n: 10.0 + n - 1 for n in range(1, 18)}  # ms: one row 10, each further row 1


def test_a_round_takes_the_longest_continuation_of_an_earlier_occurrence():
    # the prompt's last token (5) never occurred before: a plain step emits 3; after it, the
    # earlier 3 continues 4 5 (then 3, not 9): one round emits 4 5 9
    out = bench.foresight([[1, 2, 3, 4, 5]], [[3, 4, 5, 9]], VERIFY)
    assert out["tokens_per_round"] == 2.0
    assert out["decode_speedup"] == pytest.approx(40.0 / (10.0 + 12.0))


def test_earlier_outputs_are_occurrences_too_and_the_depth_caps_a_round():
    first = [7, 8, 9, 10, 11, 12]
    # the second prompt ends in 7; only the first output holds 7's continuation
    out = bench.foresight([[1, 2], [3, 7]], [first, [8, 9, 10, 11, 12, 13]], VERIFY, depth=3)
    # first output: no occurrence of its tokens anywhere before -> 6 plain steps;
    # second: 8 9 10 (depth 3) and the round's own 11 (4 rows), then 12 from the earlier 11 and 13 (2 rows)
    assert out["tokens_per_round"] == pytest.approx(12 / (6 + 2))
    assert out["decode_speedup"] == pytest.approx(120.0 / (6 * 10.0 + 13.0 + 11.0))


def test_nothing_to_copy_is_one_token_a_round_at_the_plain_speed():
    out = bench.foresight([[1, 2, 3]], [[4, 5, 6, 7]], VERIFY)
    assert out == {"tokens_per_round": 1.0, "decode_speedup": 1.0, "depth": 16}


def test_a_row_may_set_speculation_fields_and_a_wrong_one_is_named():
    rows = bench._rows("none,auto[prompt_lookup_min=1,suffix_min_prob=0.05],suffix")
    assert rows == ["none", "auto[prompt_lookup_min=1,suffix_min_prob=0.05]", "suffix"]
    assert bench._overrides(rows[1]) == ("auto", {"prompt_lookup_min": 1, "suffix_min_prob": 0.05})
    assert bench._overrides("none") == ("none", {})
    with pytest.raises(SystemExit, match="'draft_length' in 'auto\\[draft_length=3\\]' is not a speculation field"):
        bench._overrides("auto[draft_length=3]")
    with pytest.raises(SystemExit, match="prompt_lookup_min='x'"):
        bench._overrides("auto[prompt_lookup_min=x]")
    with pytest.raises(SystemExit, match="no closing bracket"):
        bench._overrides("auto[prompt_lookup_min=1")
