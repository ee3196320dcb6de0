"""vLLM's `stop_token_ids` and the completions `echo`, over the scripted engine."""

from __future__ import annotations

import pytest
import speculative_support as support
from app_support import CHAT, error_of, parse_sse, post, run

PROMPT = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8}


def test_stop_token_ids_join_the_end_of_sequence_tokens_and_survive_ignore_eos(engine):
    eos = support.byte_level().eos_token_id
    run(post(engine, "/v1/chat/completions", {**CHAT, "stop_token_ids": [11, 12]}))
    assert engine.requests[-1].stop_ids == {eos, 11, 12}
    run(post(engine, "/v1/completions", {**PROMPT, "stop_token_ids": [11], "ignore_eos": True}))
    assert engine.requests[-1].stop_ids == {11}
    run(post(engine, "/v1/completions", {**PROMPT, "ignore_eos": True}))
    assert engine.requests[-1].stop_ids == set()


@pytest.mark.parametrize("ids, words", [([10 ** 9], "outside the vocabulary"), ([-1], "greater than or equal to 0"),
                                        (["7"], "valid integer"), (list(range(17)), "at most 16")])
def test_bad_stop_token_ids_are_a_400_naming_them(engine, ids, words):
    response = run(post(engine, "/v1/completions", {**PROMPT, "stop_token_ids": ids}))
    assert response.status_code == 400 and error_of(response)["param"].startswith("stop_token_ids")
    assert words in error_of(response)["message"] and not engine.requests


def test_echo_puts_the_prompt_before_the_completion(engine):
    body = run(post(engine, "/v1/completions", {**PROMPT, "echo": True, "n": 2})).json()
    assert [c["text"] for c in body["choices"]] == ["def f(x):Hello wörld"] * 2
    chunks = parse_sse(run(post(engine, "/v1/completions", {**PROMPT, "echo": True, "stream": True})).text)
    assert chunks[0]["choices"][0]["text"] == "def f(x):"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "def f(x):Hello wörld"
    ids = support.byte_level()("def f(x):", add_special_tokens=False)["input_ids"]
    body = run(post(engine, "/v1/completions", {**PROMPT, "prompt": ids, "echo": True})).json()
    assert body["choices"][0]["text"] == "def f(x):Hello wörld"
    body = run(post(engine, "/v1/completions", {**PROMPT, "echo": False})).json()
    assert body["choices"][0]["text"] == "Hello wörld"


def test_echo_with_logprobs_lists_the_prompts_tokens_first(engine):
    """The legacy shape with echo: the prompt's tokens (the first without figures), then the
    output's, offsets into the echoed text; streamed, the echo chunk carries the prompt's part."""
    tokenizer = support.byte_level()
    engine.token_ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"][:2]
    engine.pieces = [tokenizer.decode([i]) for i in engine.token_ids]
    out = "".join(engine.pieces)
    ids = tokenizer(PROMPT["prompt"], add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == PROMPT["prompt"] and len(ids) > 2
    body = run(post(engine, "/v1/completions", {**PROMPT, "echo": True, "logprobs": 1})).json()
    assert engine.requests[-1].prompt_logprobs == 1 and engine.requests[-1].logprobs == 1
    logprobs = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == PROMPT["prompt"] + out
    assert logprobs["tokens"] == pieces + engine.pieces
    assert logprobs["token_logprobs"] == [None] + [-q / 8 for q in range(1, len(ids))] + [-0.25, -0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1:len(ids)] == [{pieces[q]: -q / 8} for q in range(1, len(ids))]
    starts = [len("".join(pieces[:q])) for q in range(len(ids))]
    n = len(PROMPT["prompt"])
    assert logprobs["text_offset"] == starts + [n, n + len(engine.pieces[0])]
    chunks = parse_sse(run(post(engine, "/v1/completions", {**PROMPT, "echo": True, "logprobs": 1,
                                                            "stream": True})).text)
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT["prompt"] and first["logprobs"]["tokens"] == pieces
    assert first["logprobs"]["text_offset"] == starts
    rest = [c["choices"][0]["logprobs"] for c in chunks[1:-1] if c["choices"][0]["text"]]
    assert [r["text_offset"] for r in rest] == [[n], [n + len(engine.pieces[0])]]
    # without echo the prompt's figures are not asked for
    run(post(engine, "/v1/completions", {**PROMPT, "logprobs": 1}))
    assert engine.requests[-1].prompt_logprobs is None


def test_max_tokens_0_with_echo_scores_the_prompt_and_shows_no_answer(engine):
    tokenizer = support.byte_level()
    ids = tokenizer(PROMPT["prompt"], add_special_tokens=False)["input_ids"]
    body = run(post(engine, "/v1/completions", {**PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT["prompt"] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert choice["logprobs"]["token_logprobs"] == [None] + [-q / 8 for q in range(1, len(ids))]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert engine.requests[-1].max_new_tokens == 1 and engine.requests[-1].prompt_logprobs == 0
    chunks = parse_sse(run(post(engine, "/v1/completions", {**PROMPT, "max_tokens": 0, "echo": True, "stream": True,
                                                            "stream_options": {"include_usage": True}})).text)
    assert [c["choices"][0]["text"] for c in chunks[:-2]] == [PROMPT["prompt"], ""]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length" and chunks[-2]["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("path, body", [("/v1/completions", {**PROMPT, "max_tokens": 0}),
                                        ("/v1/completions", {**PROMPT, "max_tokens": 0, "echo": False}),
                                        ("/v1/chat/completions", {**CHAT, "max_tokens": 0, "echo": True})])
def test_max_tokens_0_without_echo_or_in_chat_is_a_400(engine, path, body):
    response = run(post(engine, path, body))
    assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"
    assert not engine.requests
