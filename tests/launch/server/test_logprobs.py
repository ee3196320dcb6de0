"""Log probabilities in OpenAI's shapes (chat `logprobs` / `top_logprobs`, completions
`logprobs`), streamed or not, over the scripted engine; the figures themselves come from the
target's rows (tests/runtime/engine/test_engine_speculation.py)."""

from __future__ import annotations

import pytest
import speculative_support as support
from app_support import CHAT, client_for, error_of, parse_sse, post, run

from hetero_run.runtime.speculative.vocab import TokenTable

TEXT = ["Hello", " world", ", again"]
PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 8}


@pytest.fixture
def engine(engine):
    tokenizer = support.byte_level()
    engine.pieces = TEXT
    engine.token_ids = [tokenizer(piece, add_special_tokens=False)["input_ids"][0] for piece in TEXT]
    return engine


def _piece(token_id: int) -> tuple[str, list[int]]:
    """A token's text and bytes (runtime/speculative/vocab.py, tested on its own): id 100 of this
    vocabulary is one byte that is not UTF-8 alone."""
    raw = TokenTable.from_tokenizer(support.byte_level()).pieces[token_id]
    return raw.decode("utf-8", "replace"), list(raw)


def test_a_chat_answer_carries_each_tokens_log_probability_and_its_likeliest(engine):
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}))
    assert response.status_code == 200, response.text
    assert engine.requests[0].logprobs == 2
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [_piece(t)[0] for t in engine.token_ids]
    for j, (c, token) in enumerate(zip(content, engine.token_ids, strict=True)):
        text, raw = _piece(token)
        assert c == {"token": text, "logprob": -(j + 1) / 4, "bytes": raw,
                     "top_logprobs": [{"token": text, "logprob": -(j + 1) / 4, "bytes": raw},
                                      {"token": "\ufffd", "logprob": -(j + 1) / 4 - 1, "bytes": _piece(100)[1]}]}
    assert len(_piece(100)[1]) == 1 and _piece(100)[1][0] >= 0x80
    assert response.json()["choices"][0]["logprobs"]["refusal"] is None


def test_logprobs_true_alone_gives_no_alternatives_and_none_asked_gives_null(engine):
    body = run(post(engine, "/v1/chat/completions", {**CHAT, "logprobs": True})).json()
    assert engine.requests[0].logprobs == 0
    assert [c["top_logprobs"] for c in body["choices"][0]["logprobs"]["content"]] == [[], [], []]
    for extra in ({}, {"logprobs": False}):
        body = run(post(engine, "/v1/chat/completions", {**CHAT, **extra})).json()
        assert body["choices"][0]["logprobs"] is None and engine.requests[-1].logprobs is None


def test_a_streamed_chat_answer_carries_each_chunks_tokens(engine):
    chunks = parse_sse(run(post(engine, "/v1/chat/completions",
                                {**CHAT, "logprobs": True, "top_logprobs": 1, "stream": True})).text)
    content = [c for c in chunks[1:-1] if c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["delta"]["content"] for c in content] == TEXT
    assert [[e["token"] for e in c["choices"][0]["logprobs"]["content"]] for c in content] == \
        [[_piece(t)[0]] for t in engine.token_ids]
    assert chunks[0]["choices"][0]["logprobs"] is None and chunks[-2]["choices"][0]["logprobs"] is None
    whole = run(post(engine, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1})).json()
    assert [e for c in content for e in c["choices"][0]["logprobs"]["content"]] == \
        whole["choices"][0]["logprobs"]["content"]


def test_completions_carry_the_legacy_shape_with_text_offsets(engine):
    body = run(post(engine, "/v1/completions", {**PROMPT, "logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    tokens = [_piece(t)[0] for t in engine.token_ids]
    assert logprobs["tokens"] == tokens and logprobs["token_logprobs"] == [-0.25, -0.5, -0.75]
    assert logprobs["text_offset"] == [0, 5, 11]
    assert logprobs["top_logprobs"] == [{tokens[j]: -(j + 1) / 4, _piece(100)[0]: -(j + 1) / 4 - 1} for j in range(3)]
    # logprobs 0: each token's own figure only
    body = run(post(engine, "/v1/completions", {**PROMPT, "logprobs": 0})).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{tokens[j]: -(j + 1) / 4} for j in range(3)]
    chunks = parse_sse(run(post(engine, "/v1/completions", {**PROMPT, "logprobs": 1, "stream": True})).text)
    streamed = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"][0]["text"]]
    assert [s["tokens"] for s in streamed] == [[t] for t in tokens]
    assert [s["text_offset"] for s in streamed] == [[0], [5], [11]]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 1.5}, "logprobs"),
])
def test_bad_logprobs_fields_are_a_400_naming_them(engine, path, extra, param):
    body = {**(CHAT if "chat" in path else PROMPT), **extra}
    response = run(post(engine, path, body))
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert not engine.requests


def test_the_openai_client_reads_the_log_probabilities(engine):
    import openai

    async def go():
        async with client_for(engine) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            chat = await client.chat.completions.create(model="tiny", messages=CHAT["messages"], logprobs=True,
                                                        top_logprobs=3)
            text = await client.completions.create(model="tiny", prompt="hi", logprobs=1)
            return chat, text

    chat, text = run(go())
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [_piece(t)[0] for t in engine.token_ids]
    assert [c.logprob for c in content] == [-0.25, -0.5, -0.75] and all(len(c.top_logprobs) == 3 for c in content)
    assert text.choices[0].logprobs.token_logprobs == [-0.25, -0.5, -0.75]
    assert text.choices[0].logprobs.text_offset == [0, 5, 11]

