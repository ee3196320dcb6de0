"""The drafter's view stays in step with the accepted text, and its KV cache with its tokens."""

from __future__ import annotations

import random

import speculative_support as support
import torch

from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.speculative.context import DraftContext
from hetero_run.runtime.speculative.retokenize import Retokenizer
from hetero_run.runtime.speculative.vocab import TokenTable

TEXT = "def is_prime(n):\n    if n < 2:\n        return False\n    # naïve 你好 😀\n    return True\n"


def make_context():
    tokenizer = support.sentencepiece()
    model = support.tiny_model(tokenizer, "llama", seed=2)
    retokenizer = Retokenizer(tokenizer, TokenTable.from_tokenizer(tokenizer), window=6)
    prompt = tokenizer("Q:", add_special_tokens=True)["input_ids"]
    return DraftContext(HFDraftModel(model), retokenizer, prompt), model, retokenizer


def test_commits_track_the_text_and_the_cache_tracks_the_tokens():
    context, model, retokenizer = make_context()
    table, rnd = retokenizer.table, random.Random(0)
    data, pos = TEXT.encode(), 0
    prompt_len = len(context.ids)
    while pos < len(data):
        context.catch_up()
        # draft a few tokens: sometimes the true continuation, sometimes junk
        truth = retokenizer.encode(data[pos:pos + 12].decode("utf-8", "ignore"))[:3]
        drafts = truth if rnd.random() < 0.6 else [rnd.randrange(3, len(table))]
        for token in drafts:
            context.step(token)
        step = rnd.randint(1, 6)
        context.commit_text(drafts, data[pos:pos + step])
        pos += step
        assert table.decode(context.ids[prompt_len:]) + context.pending == data[:pos]
    fresh = model(input_ids=torch.tensor([context.ids])).logits[0, -1]
    torch.testing.assert_close(context.catch_up(), fresh, atol=1e-4, rtol=1e-4)
    assert context.cached == context.ids


def test_matching_drafts_are_kept_without_rerunning_them():
    context, _, retokenizer = make_context()
    context.catch_up()
    start = len(context.ids)
    drafts = retokenizer.encode(" the quick")
    for token in drafts:
        context.step(token)
    length = context.model.length
    context.commit_text(drafts, b" the quick fox")
    assert context.ids[start:start + len(drafts)] == drafts
    assert retokenizer.table.decode(context.ids[start + len(drafts):]) == b" fox"
    context.catch_up()
    assert context.model.length == len(context.ids) and context.model.length - length <= 2


def test_a_split_character_waits_in_pending():
    context, _, retokenizer = make_context()
    before = list(context.ids)
    data = "你".encode()
    context.commit_text([], data[:2])
    assert context.ids == before and context.pending == data[:2] and not context.draft_ready
    context.commit_text([], data[2:])
    assert context.pending == b"" and retokenizer.table.decode(context.ids[len(before):]) == data
