"""Each model reads the prompt through its own tokenizer and chat template."""

from __future__ import annotations

import pytest
import speculative_support as support

from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.topology.errors import UserError

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def test_chat_uses_each_template():
    target, drafter, bare = support.byte_level(), support.sentencepiece(), support.trailing_space()
    prompt = Prompt.of("def add(a, b):", chat=True)
    assert prompt.messages == tuple(MESSAGES)
    target_ids = prompt.for_target(target)
    assert target.decode(target_ids).startswith("<|im_start|>user\ndef add(a, b):<|im_end|>")
    assert drafter.decode(prompt.for_drafter(drafter, target)).startswith("<s>[INST] def add(a, b): [/INST]")
    # no chat template: the drafter reads the target's rendering as text
    rendered = target.decode(target_ids)
    assert prompt.for_drafter(bare, target) == bare(rendered, add_special_tokens=False)["input_ids"]


def test_pre_rendered_target_ids_are_used_as_given():
    target, drafter = support.byte_level(), support.sentencepiece()
    ids = target("custom rendering")["input_ids"]
    prompt = Prompt(messages=tuple(MESSAGES), target_ids=tuple(ids))
    assert prompt.for_target(target) == ids
    assert drafter.decode(prompt.for_drafter(drafter, target)).startswith("<s>[INST]")
    only_ids = Prompt.of(ids)
    assert drafter.decode(only_ids.for_drafter(drafter, target)) == "custom rendering"


def test_raw_text_gets_each_tokenizers_specials():
    prompt = Prompt.of("hello")
    assert prompt.for_target(support.byte_level()) == support.byte_level()("hello")["input_ids"]
    assert prompt.for_drafter(support.sentencepiece(), support.byte_level())[0] == 1  # its BOS


def test_bad_prompts_are_one_line_errors():
    with pytest.raises(UserError, match="prompt"):
        Prompt.of([1.5, "x"])
