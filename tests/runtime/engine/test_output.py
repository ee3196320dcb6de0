"""runtime/engine/output.py: incremental detokenisation and stop strings, on hand-built byte
vocabularies (characters split across tokens) and on real byte-level BPE and SentencePiece
tokenizers."""

from __future__ import annotations

import random

import pytest

from hetero_run.runtime.engine.output import IncrementalDecoder, OutputText, StopStrings

# A byte vocabulary: each id is a byte string; characters may be split across ids.
PIECES = {
    1: b"Hello", 2: b" w", 3: b"orld", 4: "é".encode()[:1], 5: "é".encode()[1:],
    6: "€".encode()[:1], 7: "€".encode()[1:2], 8: "€".encode()[2:], 9: "😀".encode()[:2], 10: "😀".encode()[2:],
    11: b"\n", 12: b"END", 13: b"E", 14: b"ND", 15: b"!", 16: b"a", 17: b"b", 18: b"c", 19: b"d", 20: b"x",
    21: b"\xff",  # never valid UTF-8
}


def byte_decode(ids) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def released(ids_per_step, stops=(), decode=byte_decode) -> tuple[list[str], str, bool]:
    out = OutputText(decode, stops)
    deltas = []
    for ids in ids_per_step:
        deltas.append(out.add(ids))
        if out.stopped:
            break
    return deltas, out.finish(), out.stopped


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    deltas, rest, _ = released([[1], [4], [5], [6], [7], [8], [9], [10]])
    assert deltas == ["Hello", "", "é", "", "", "€", "", "😀"] and rest == ""
    for delta in deltas:
        assert "\ufffd" not in delta


def test_several_characters_in_one_step_and_halves_in_the_next():
    deltas, rest, _ = released([[1, 2, 6], [7, 8, 3, 9], [10, 15]])
    assert deltas == ["Hello w", "€orld", "😀!"] and rest == ""


def test_an_unfinished_character_at_the_end_is_flushed_as_a_replacement():
    deltas, rest, _ = released([[1, 6, 7]])
    assert deltas == ["Hello"] and rest == "\ufffd"


def test_invalid_bytes_in_the_middle_do_not_hold_text_back_forever():
    deltas, rest, _ = released([[1, 21], [2, 3]])
    assert "".join(deltas) + rest == "Hello\ufffd world"
    assert deltas[1] != ""  # released as soon as the text no longer ends in U+FFFD


@pytest.mark.parametrize("stops, steps, expected", [
    (("END",), [[1], [2, 3], [12], [15]], "Hello world"),
    (("END",), [[1, 13], [14, 15]], "Hello"),  # the stop string spans two tokens
    (("END",), [[1, 13], [15]], "HelloE!"),  # a prefix that turned out not to be one is released
    (("abc", "bc"), [[20, 16], [17, 18]], "x"),  # overlapping: the longest completing first wins
    (("abcd", "bc"), [[20, 16, 17, 18, 19]], "xa"),  # "bc" completes before "abcd" would
    (("bc", "abcd"), [[20, 16, 17], [18, 19]], "xa"),
    (("é",), [[1, 4], [5, 15]], "Hello"),  # a multi-byte stop string split across tokens
    (("€!",), [[6, 7], [8], [15]], ""),
    (("\n",), [[1, 11, 2]], "Hello"),
    (("orld", "o"), [[1]], "Hell"),
])
def test_stop_strings_cut_exactly(stops, steps, expected):
    deltas, rest, stopped = released(steps, stops)
    assert "".join(deltas) + rest == expected
    assert stopped is (expected != byte_decode([i for s in steps for i in s]))


def test_text_that_could_start_a_stop_string_is_held_until_it_cannot():
    out = OutputText(byte_decode, ("END!",))
    assert out.add([1, 13]) == "Hello"  # "E" held
    assert out.add([14]) == ""  # "END" held
    assert out.add([2]) == "END w" and not out.stopped
    assert out.finish() == ""


def test_the_final_flush_releases_held_text_when_no_stop_string_came():
    deltas, rest, stopped = released([[1, 13]], ("END",))
    assert deltas == ["Hello"] and rest == "E" and not stopped


def test_nothing_is_released_after_a_stop():
    out = OutputText(byte_decode, ("w",))
    assert out.add([1, 2, 3]) == "Hello " and out.stopped
    assert out.add([15]) == "" and out.finish() == ""


def test_empty_and_duplicate_stop_strings_are_ignored():
    assert StopStrings(("", "a", "a")).stops == ("a",)
    deltas, rest, stopped = released([[1, 2]], ("",))
    assert "".join(deltas) + rest == "Hello w" and not stopped


def test_random_splits_and_stops_match_a_whole_text_reference():
    """Against the plain rule on the whole text: cut at the first stop string to complete."""
    rng = random.Random(0)
    ids = list(PIECES)
    for _ in range(300):
        seq = [rng.choice(ids[:20]) for _ in range(rng.randint(1, 14))]
        whole = byte_decode(seq)
        stops = tuple(whole[a:a + rng.randint(1, 3)] for a in rng.sample(range(len(whole)), min(2, len(whole))))
        stops = tuple(s for s in stops if "\ufffd" not in s)
        cuts = sorted(rng.sample(range(1, len(seq)), min(len(seq) - 1, rng.randint(0, 4))))
        steps = [seq[a:b] for a, b in zip([0, *cuts], [*cuts, len(seq)], strict=True)]
        deltas, rest, _ = released(steps, stops)
        assert "".join(deltas) + rest == reference_cut(whole, stops, steps), (seq, stops, steps)


def reference_cut(whole: str, stops, steps) -> str:
    """Character by character over the text the steps release: end before the first stop string
    to complete (the longest if several complete at once)."""
    for end in range(1, len(whole) + 1):
        done = [s for s in stops if whole[:end].endswith(s)]
        if done:
            return whole[:end - max(len(s) for s in done)]
    return whole


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_deltas_add_up_to_the_tokenizers_own_decode(kind):
    import speculative_support as support

    tokenizer = support.byte_level() if kind == "byte_level" else support.sentencepiece()
    text = "def f(x):\n    return x * 2  # café, naïve, 10€ 😀\nThe cat sat."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(1)
    for _ in range(20):
        decoder = IncrementalDecoder(lambda t: tokenizer.decode(t, skip_special_tokens=True))
        pieces, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            pieces.append(decoder.add(ids[i:i + n]))
            i += n
        pieces.append(decoder.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces)


def _marked(ids_per_step, stops=()):
    """Each token marked with its index: (deltas, rest, stopped, [(step, offset, index)]), step
    -1 for what finish() hands over."""
    out = OutputText(byte_decode, stops)
    deltas, taken, n = [], [], 0
    for step, ids in enumerate(ids_per_step):
        deltas.append(out.add(ids, list(range(n, n + len(ids)))))
        n += len(ids)
        taken += [(step, offset, mark) for offset, mark in out.take()]
        if out.stopped:
            break
    rest = out.finish()
    taken += [(-1, offset, mark) for offset, mark in out.take()]
    return deltas, rest, out.stopped, taken


def test_marked_tokens_come_out_with_their_characters_and_where_they_start():
    # "Hello" " w" "orld" then é in two tokens: the first byte brings no character of its own
    deltas, rest, stopped, taken = _marked([[1, 2], [3, 4], [5, 15]])
    assert deltas == ["Hello w", "orld", "é!"] and rest == "" and not stopped
    assert taken == [(0, 0, 0), (0, 5, 1), (1, 7, 2), (1, 11, 3), (2, 11, 4), (2, 12, 5)]


def test_a_stop_string_keeps_the_marks_of_the_tokens_before_its_cut_only():
    # "Hello" " w" "orld" "\n" "END": the stop "\nEND" cuts after "world"
    deltas, rest, stopped, taken = _marked([[1, 2], [3, 11], [12, 15]], stops=("\nEND",))
    assert "".join(deltas) + rest == "Hello world" and stopped
    assert [mark for _, _, mark in taken] == [0, 1, 2]
    # a token that straddles the cut keeps its mark: "orld\n" ... stop "ld\n"
    deltas, rest, stopped, taken = _marked([[1, 2], [3, 11]], stops=("ld\n",))
    assert "".join(deltas) + rest == "Hello wor" and [mark for _, _, mark in taken] == [0, 1, 2]


def test_marks_follow_the_text_for_random_splits_and_stops():
    """Marks come out once each, in order, never before the text before their token; offsets are
    where each token's text starts; the text is what unmarked tokens give; without a stop every
    mark comes out, with one exactly the tokens that reach before the cut."""
    rng = random.Random(2)
    ids = list(PIECES)[:20]  # no invalid byte: every token's text has a clear start
    for _ in range(300):
        seq = [rng.choice(ids) for _ in range(rng.randint(1, 14))]
        whole = byte_decode(seq)
        stops = tuple(whole[a:a + rng.randint(1, 3)] for a in rng.sample(range(len(whole)), min(2, len(whole))))
        stops = tuple(s for s in stops if "\ufffd" not in s)
        cuts = sorted(rng.sample(range(1, len(seq)), min(len(seq) - 1, rng.randint(0, 4))))
        steps = [seq[a:b] for a, b in zip([0, *cuts], [*cuts, len(seq)], strict=True)]
        deltas, rest, stopped, taken = _marked(steps, stops)
        assert (deltas, rest) == released(steps, stops)[:2], (seq, stops, steps)
        output = "".join(deltas) + rest
        marks = [mark for _, _, mark in taken]
        assert marks == list(range(len(marks))), (seq, stops, steps)
        starts = [len(byte_decode(seq[:j]).rstrip("\ufffd")) for j in range(len(seq))]
        assert [offset for _, offset, _ in taken] == starts[:len(marks)]
        for step, offset, _ in taken:
            if step >= 0:
                assert len("".join(deltas[:step + 1])) >= offset
        if not stopped:
            assert len(marks) == len(seq)
        else:
            ends = [len(byte_decode(seq[:j + 1]).rstrip("\ufffd")) for j in range(len(seq))]
            expect = [j for j in range(len(seq)) if starts[j] < len(output) or ends[j] <= len(output)]
            assert marks == expect, (seq, stops, steps)
