"""`n` choices of one request (chat and completions, streamed or not), over the scripted engine:
each choice its own engine request, seeds seed + i, usage summed over the choices, the prompt
counted once; a choice that cannot be queued or that fails ends the whole request."""

from __future__ import annotations

import pytest
from app_support import CHAT, client_for, error_of, parse_sse, post, run

PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 8}


@pytest.fixture
def engine(engine):
    # choice i (its request id ends in -i) answers "c<i>" twice, so the choices differ
    engine.answer = lambda request: ([f"c{request.request_id.rsplit('-', 1)[1]} ", "again"], "stop")
    return engine


def test_n_chat_choices_come_back_indexed_with_their_usage_summed(engine):
    body = run(post(engine, "/v1/chat/completions", {**CHAT, "n": 3})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["c0 again", "c1 again", "c2 again"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 3
    prompt = engine.requests[0].prompt_tokens
    assert body["usage"]["prompt_tokens"] == prompt and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == prompt + 6
    assert body["speculation"]["rounds"] == 6 and body["speculation"]["draft_tokens"] == 9
    assert body["speculation"]["accepted_per_position"] == [3]
    ids = [r.request_id for r in engine.requests]
    assert len(set(ids)) == 3 and all(r.prompt == engine.requests[0].prompt for r in engine.requests)
    assert body["id"] == ids[0].rsplit("-", 1)[0]


def test_a_seeded_requests_choices_draw_with_seed_plus_their_index(engine):
    run(post(engine, "/v1/chat/completions", {**CHAT, "n": 3, "seed": 40, "temperature": 1.0}))
    assert [r.sampling.seed for r in engine.requests] == [40, 41, 42]
    run(post(engine, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1.0}))
    assert [r.sampling.seed for r in engine.requests[3:]] == [None, None]
    run(post(engine, "/v1/chat/completions", {**CHAT, "seed": 40, "temperature": 1.0}))
    assert engine.requests[-1].sampling.seed == 40 and "-" not in engine.requests[-1].request_id[9:]


def test_streamed_choices_interleave_by_index_and_the_usage_comes_once_at_the_end(engine):
    chunks = parse_sse(run(post(engine, "/v1/chat/completions", {**CHAT, "n": 2, "stream": True,
                                                                 "stream_options": {"include_usage": True}})).text)
    assert chunks[-1] == "[DONE]"
    usage, frames = chunks[-2], chunks[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    for i in (0, 1):
        mine = [f["choices"][0] for f in frames if f["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == f"c{i} again"
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["stop"]
    assert all(f["usage"] is None for f in frames) and len({f["id"] for f in chunks[:-1]}) == 1


def test_completions_choices_streamed_and_not(engine):
    body = run(post(engine, "/v1/completions", {**PROMPT, "n": 2, "logprobs": 0})).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "c0 again"), (1, "c1 again")]
    assert [c["logprobs"]["token_logprobs"] for c in body["choices"]] == [[-0.25, -0.5]] * 2
    chunks = parse_sse(run(post(engine, "/v1/completions", {**PROMPT, "n": 2, "stream": True})).text)
    for i in (0, 1):
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i) == \
            f"c{i} again"


def test_a_choice_that_cannot_be_queued_is_a_429_and_cancels_the_queued_ones(engine):
    engine.room = 2
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "n": 3}))
    assert response.status_code == 429 and error_of(response)["type"]
    assert engine.cancelled == [r.request_id for r in engine.requests] and len(engine.requests) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_request(engine, stream):
    engine.answer = lambda request: (["x"], "error" if request.request_id.endswith("-1") else "stop")
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "n": 2, "stream": stream}))
    if not stream:
        assert response.status_code == 500 and error_of(response)["message"] == "boom"
    else:
        chunks = parse_sse(response.text)
        assert chunks[-1] == "[DONE]" and chunks[-2]["error"]["message"] == "boom"


def test_the_openai_client_reads_n_choices(engine):
    import openai

    async def go():
        async with client_for(engine) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            return await client.chat.completions.create(model="tiny", messages=CHAT["messages"], n=2)

    out = run(go())
    assert [(c.index, c.message.content) for c in out.choices] == [(0, "c0 again"), (1, "c1 again")]
    assert out.usage.completion_tokens == 4
