"""Token bytes across space conventions and byte fallback; same-vocabulary and intersection."""

from __future__ import annotations

import json

import pytest
import speculative_support as support
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from hetero_run.runtime.speculative.vocab import Intersection, TokenTable, same_vocabulary

TEXT = "Hello world! def f(x):\n    return x  # naïve café 你好 😀"


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_token_bytes_spell_the_text_exactly(name):
    tokenizer = support.TOKENIZERS[name]()
    table = TokenTable.from_tokenizer(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert table.decode(ids) == TEXT.encode()


def test_space_markers_and_byte_fallback_become_plain_bytes():
    byte_level = TokenTable.from_tokenizer(support.byte_level())
    assert byte_level.kind == "byte_level"
    assert byte_level.pieces[byte_level.vocab["Ġthe"]] == b" the"
    assert byte_level.pieces[byte_level.vocab["Ċ"]] == b"\n"
    sentencepiece = TokenTable.from_tokenizer(support.sentencepiece())
    assert sentencepiece.kind == "metaspace"
    assert sentencepiece.pieces[sentencepiece.vocab["\u2581the"]] == b" the"
    assert sentencepiece.pieces[sentencepiece.vocab["<0xE4>"]] == b"\xe4"
    assert sentencepiece.byte_ids[0xE4] == sentencepiece.vocab["<0xE4>"]


def test_special_tokens_have_no_text():
    table = TokenTable.from_tokenizer(support.sentencepiece())
    assert table.pieces[table.specials["<s>"]] is None
    ids = support.sentencepiece()("hi", add_special_tokens=True)["input_ids"]
    assert ids[0] == table.specials["<s>"] and table.decode(ids) == b"hi"


def _clone(tokenizer, edit=None, **kwargs) -> PreTrainedTokenizerFast:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if edit:
        edit(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **kwargs)


def test_same_vocabulary_compares_token_to_id_maps_not_sizes():
    base = support.byte_level()
    table = TokenTable.from_tokenizer(base)
    assert same_vocabulary(table, TokenTable.from_tokenizer(_clone(base)))

    def swap_two(spec):
        vocab = spec["model"]["vocab"]
        a, b = "Ġthe", "Ġreturn"
        vocab[a], vocab[b] = vocab[b], vocab[a]

    swapped = TokenTable.from_tokenizer(_clone(base, swap_two))
    assert len(swapped) == len(table) and not same_vocabulary(table, swapped)
    other = TokenTable.from_tokenizer(support.byte_level(vocab_size=401))
    assert not same_vocabulary(table, other)


def test_intersection_matches_by_bytes_across_space_conventions():
    target = TokenTable.from_tokenizer(support.byte_level())
    drafter = TokenTable.from_tokenizer(support.sentencepiece())
    shared = Intersection.build(drafter, target)
    assert len(shared) > 100
    for d, t in zip(shared.draft_ids.tolist(), shared.target_ids.tolist(), strict=True):
        if drafter.pieces[d] is not None:
            assert drafter.pieces[d] == target.pieces[t]
    assert shared.draft_to_target[drafter.vocab["\u2581the"]] == target.vocab["Ġthe"]
    assert len(set(shared.target_ids.tolist())) == len(shared)  # one drafter row per shared token


def test_intersection_collapses_byte_fallback_duplicates_and_maps_specials_by_content():
    target = TokenTable.from_tokenizer(support.byte_level())
    drafter = TokenTable.from_tokenizer(support.sentencepiece())
    a_ids = [i for i, p in enumerate(drafter.pieces) if p == b"a"]
    assert len(a_ids) == 2  # "a" and "<0x61>"
    shared = Intersection.build(drafter, target)
    assert sum(d in shared.draft_to_target for d in a_ids) == 1
    smol_like = TokenTable.from_tokenizer(_clone(support.byte_level(), eos_token="<|im_end|>"))
    assert Intersection.build(smol_like, target).draft_to_target[smol_like.specials["<|im_end|>"]] == \
        target.specials["<|im_end|>"]
