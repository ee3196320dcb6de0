"""Incremental re-tokenisation with a look-behind window: exact bytes, near-canonical tokens."""

from __future__ import annotations

import random

import pytest
import speculative_support as support
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hetero_run.runtime.speculative.retokenize import Retokenizer, utf8_complete
from hetero_run.runtime.speculative.vocab import TokenTable

TEXTS = support.CORPUS[:8] + ["Hello world! naïve 你好 😀 def f(x):\n    return x  \n\n  end"]


def retokenizer(name: str, window: int = 6) -> Retokenizer:
    tokenizer = support.TOKENIZERS[name]()
    return Retokenizer(tokenizer, TokenTable.from_tokenizer(tokenizer), window)


def feed(r: Retokenizer, data: bytes, rewrite: bool, rnd: random.Random) -> tuple[list[int], bytes]:
    """Append `data` in random chunks (split anywhere, even inside a character)."""
    ids, pending, pos = [], b"", 0
    while pos < len(data):
        step = rnd.randint(1, 7)
        buf = pending + data[pos:pos + step]
        pos += step
        n = utf8_complete(buf)
        keep, new = r.extend(ids, buf[:n], rewrite)
        if not rewrite:
            assert keep == len(ids)
        ids = ids[:keep] + new
        pending = buf[n:]
    return ids, pending


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("rewrite", [True, False])
def test_incremental_tokens_spell_the_text_exactly(name, rewrite):
    r, rnd = retokenizer(name), random.Random(0)
    for text in TEXTS:
        for _ in range(10):
            ids, pending = feed(r, text.encode(), rewrite, rnd)
            assert pending == b"" and r.table.decode(ids) == text.encode()


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_rewriting_keeps_the_tokenisation_close_to_canonical(name):
    r, rnd = retokenizer(name), random.Random(1)
    canonical = total = 0
    for text in TEXTS[:8]:
        for _ in range(10):
            ids, _ = feed(r, text.encode(), True, rnd)
            canonical += ids == r.encode(text)
            total += 1
    assert canonical >= 0.9 * total


def test_merge_across_the_boundary():
    r = retokenizer("byte_level")
    context = r.encode("return False")
    head = context[:-1] + r.encode(" Fal")  # the word arrives split: " Fal" + "se"
    assert r.table.decode(head) == b"return Fal"
    keep, new = r.extend(head, b"se", rewrite=True)
    assert head[:keep] + new == context  # " Fal" rewritten into the merged token
    keep, new = r.extend(head, b"se", rewrite=False)
    assert keep == len(head) and r.table.decode(head + new) == b"return False"


def test_no_bos_is_inserted_when_re_encoding():
    r = retokenizer("sentencepiece")
    bos = r.table.specials["<s>"]
    ids, _ = feed(r, b"Hello world, hello there.", True, random.Random(2))
    assert bos not in ids


def test_a_dummy_prefix_space_is_skipped():
    """SentencePiece-style tokenizers that put a space before the text (prepend "always")."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.train_from_iterator(support.CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"],
                                                                show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    r = Retokenizer(wrapped, TokenTable.from_tokenizer(wrapped), window=4)
    assert r.table.decode(r.encode("hello")) == b" hello"  # the prefix this tokenizer adds
    context = r.encode("the dog")
    keep, new = r.extend(context, b" runs", rewrite=True)
    assert r.table.decode(context[:keep] + new) == b" the dog runs"


def test_text_split_inside_a_character_waits():
    data = "你好".encode()
    assert utf8_complete(data[:1]) == 0 and utf8_complete(data[:4]) == 3 and utf8_complete(data) == 6
    assert utf8_complete(b"ab\xff") == 3  # invalid bytes never complete: nothing is held back
    r = retokenizer("byte_level")
    ids, pending = [], b""
    for i in range(len(data)):
        buf = pending + data[i:i + 1]
        n = utf8_complete(buf)
        keep, new = r.extend(ids, buf[:n], rewrite=True)
        ids, pending = ids[:keep] + new, buf[n:]
    assert r.table.decode(ids) == data


def test_continuing_after_a_partial_character_token():
    """A byte-level target may commit a token holding half a character; the rest follows."""
    r = retokenizer("byte_level")
    full = r.encode("x 你好")
    partial = [i for i in full if r.table.pieces[i] and r.table.pieces[i][-1:] >= b"\x80"]
    assert partial  # the trained vocabulary splits these characters
    committed = r.encode("x ") + [r.table.byte_ids[0xE4]]  # "x " + first byte of 你
    keep, new = r.extend(committed, "你好".encode()[1:], rewrite=False)
    assert keep == len(committed) and r.table.decode(committed + new) == "x 你好".encode()
