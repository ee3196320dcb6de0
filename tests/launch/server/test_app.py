"""launch/server/app.py in process, over a scripted engine: statuses and error bodies for bad
input, auth, routes, body size, health per engine state, CORS, SSE framing, metrics."""

from __future__ import annotations

import json

import pytest
import speculative_support as support
from app_support import CHAT, client_for, error_of, parse_sse, post, run

from hetero_run.launch.server.metrics import Metrics
from hetero_run.runtime.engine.api import EngineState, GenerationEvent, SpeculationSummary, Usage


@pytest.mark.parametrize("body, status, param, words", [
    (b"{not json", 400, None, "not valid JSON"),
    ({"model": "tiny", "messages": []}, 400, "messages", "at least 1"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "'system', 'user'"),
    ({**CHAT, "max_tokens": "8"}, 400, "max_tokens", "valid integer"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ({**CHAT, "top_p": 0}, 400, "top_p", "greater than 0"),
    ({**CHAT, "n": 17}, 400, "n", "less than or equal to 16"),
    ({**CHAT, "n": 0}, 400, "n", "greater than or equal to 1"),
    ({**CHAT, "stop": [1]}, 400, "stop", ""),
    ({**CHAT, "stream": "yes"}, 400, "stream", "valid boolean"),
    ({"model": "tiny"}, 400, "messages", "is required"),
    ({**CHAT, "max_tokens": 1000}, 400, "messages", "context holds 64 tokens"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "does not list tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools[0].function.name", "at least 1"),
    ({**CHAT, "tool_choice": "required"}, 400, "tool_choice", 'only "auto" and "none"'),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice", "forced call"),
    ({**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content", "is required"),
    ({**CHAT, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format", '{"type": "text"}'),
    ({**CHAT, "presence_penalty": 0.5}, 400, "presence_penalty", "penalties"),
    ({**CHAT, "frequency_penalty": -1}, 400, "frequency_penalty", "penalties"),
    ({**CHAT, "repetition_penalty": 1.1}, 400, "repetition_penalty", "1 only"),
    ({**CHAT, "logit_bias": {"42": 5}}, 400, "logit_bias", "not supported"),
    ({**CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
])
def test_bad_chat_requests_get_openai_errors_naming_the_field(engine, body, status, param, words):
    response = run(post(engine, "/v1/chat/completions", body))
    assert response.status_code == status
    error = error_of(response)
    assert error["param"] == param and words in error["message"] and error["code"] in (status, "model_not_found")
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert engine.requests == []


def test_the_context_error_carries_the_token_counts(engine):
    error = error_of(run(post(engine, "/v1/completions", {"prompt": "hello there", "max_tokens": 64})))
    assert error["n_ctx"] == 64 and error["n_prompt_tokens"] > 0
    assert f"the prompt has {error['n_prompt_tokens']} tokens and max_tokens asks for 64" in error["message"]


def test_a_correct_request_after_bad_ones_is_served(engine):
    async def go():
        async with client_for(engine) as client:
            for body in (b"[", b'{"messages": 3}', json.dumps({**CHAT, "top_k": -7}).encode()):
                assert (await client.post("/v1/chat/completions", content=body)).status_code == 400
            return await client.post("/v1/chat/completions", json=CHAT)

    response = run(go())
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello wörld"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    assert body["speculation"] == {"algorithm": "slem", "rounds": 2, "drafts": 1, "draft_tokens": 3,
                                   "accepted_tokens": 1, "tokens_per_round": 1.5, "accepted_per_position": [1],
                                   "acceptance_rate": 0.3333}
    (request,) = engine.requests
    assert request.max_new_tokens == 8 and request.sampling.temperature == 1.0  # OpenAI's default


def test_request_fields_reach_the_engine(engine):
    body = {**CHAT, "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 9,
            "stop": ["\n\n", "END"], "ignore_eos": True, "user": "someone", "frequency_penalty": 0,
            "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert run(post(engine, "/v1/chat/completions", body)).status_code == 200
    (request,) = engine.requests
    assert request.max_new_tokens == 5 and request.stop_strings == ("\n\n", "END") and request.stop_ids == frozenset()
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k, request.sampling.seed) == \
        (0, 0.5, 3, 9)
    tokenizer = support.byte_level()
    expected = tokenizer(tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert list(request.prompt.target_ids) == expected
    assert request.prompt.messages == ({"role": "user", "content": "hi"},)


def test_content_parts_are_joined_and_token_prompts_accepted(engine):
    parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]}
    assert run(post(engine, "/v1/chat/completions", parts)).status_code == 200
    assert engine.requests[0].prompt.messages[0]["content"] == "a\nb"
    assert run(post(engine, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})).status_code == 200
    assert engine.requests[1].prompt.target_ids == (5, 6, 7)
    error = error_of(run(post(engine, "/v1/completions", {"prompt": [5, 99999], "max_tokens": 4})))
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]


def test_chat_stream_framing(engine):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = run(post(engine, "/v1/chat/completions", body))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(response.text)
    assert chunks[-1] == "[DONE]"
    first, *deltas, final, usage, _ = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [d["choices"][0]["delta"]["content"] for d in deltas] == ["Hel", "lo", " wörld"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == first["id"] and c["usage"] is None
               for c in [first, *deltas, final])
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert final["speculation"]["draft_tokens"] == 3
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_completion_stream_without_usage(engine):
    engine.finish = "stop"
    chunks = parse_sse(run(post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})).text)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hel", "lo", " wörld", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and all("usage" not in c for c in chunks[:-1])


def test_an_error_after_the_stream_began_is_an_error_event_then_done(engine):
    engine.finish = "error"
    chunks = parse_sse(run(post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})).text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["error"]["message"] == "boom" and chunks[-2]["error"]["code"] == 500
    response = run(post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 3}))
    assert response.status_code == 500 and error_of(response)["message"] == "boom"


def test_a_full_queue_is_429(engine):
    engine.full = True
    response = run(post(engine, "/v1/chat/completions", CHAT))
    assert response.status_code == 429 and "--max-queue 1" in error_of(response)["message"]
    assert error_of(response)["type"] == "rate_limit_error"


@pytest.mark.parametrize("headers, status", [({}, 401), ({"authorization": "Bearer nope"}, 401),
                                             ({"authorization": "Basic s3cret"}, 401),
                                             ({"authorization": "Bearer s3cret"}, 200)])
def test_the_api_key_guards_v1_routes(engine, headers, status):
    response = run(post(engine, "/v1/chat/completions", CHAT, headers, api_key="s3cret"))
    assert response.status_code == status
    if status == 401:
        assert error_of(response)["type"] == "authentication_error" and "s3cret" not in response.text

    async def models():
        async with client_for(engine, api_key="s3cret") as client:
            return [(await client.get(p, headers=headers)).status_code for p in ("/v1/models", "/health")]

    assert run(models()) == [status, 200]  # /health stays open for probes
    response = run(post(engine, "/tokenize", {"prompt": "hi"}, headers, api_key="s3cret"))
    assert response.status_code == status


def test_tokenize_gives_the_ids_the_completions_run_and_detokenize_reverses_it(engine):
    tokenizer = support.byte_level()
    got = run(post(engine, "/tokenize", {"prompt": "hello there", "return_token_strs": True})).json()
    ids = tokenizer("hello there")["input_ids"]
    assert got == {"count": len(ids), "max_model_len": 64, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert run(post(engine, "/tokenize", {"prompt": "hello", "add_special_tokens": False})).json()["tokens"] == \
        tokenizer("hello", add_special_tokens=False)["input_ids"]
    chat = run(post(engine, "/tokenize", {"messages": CHAT["messages"]})).json()
    assert run(post(engine, "/v1/chat/completions", CHAT)).status_code == 200
    assert chat["tokens"] == list(engine.requests[0].prompt.target_ids) and chat["token_strs"] is None
    back = run(post(engine, "/detokenize", {"tokens": chat["tokens"]})).json()
    assert back == {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "prompt", "exactly one of"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one of"),
    ("/tokenize", {"prompt": 5}, "prompt", "valid string"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]", "greater than or equal to 0"),
    ("/detokenize", {}, "tokens", "is required"),
])
def test_bad_tokenizer_requests_name_the_field(engine, path, body, param, words):
    response = run(post(engine, path, body))
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error


def test_a_body_over_the_limit_is_413(engine):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    response = run(post(engine, "/v1/chat/completions", body, max_body_bytes=4096))
    assert response.status_code == 413 and "--max-body-bytes" in error_of(response)["message"]


def test_unknown_routes_and_methods_are_openai_errors(engine):
    async def go():
        async with client_for(engine) as client:
            return await client.get("/v1/embeddings"), await client.get("/v1/chat/completions")

    missing, wrong_method = run(go())
    assert missing.status_code == 404 and error_of(missing)["type"] == "not_found_error"
    assert wrong_method.status_code == 405


@pytest.mark.parametrize("state, status, words", [(EngineState.READY, 200, ""), (EngineState.LOADING, 503, "loading"),
                                                  (EngineState.DRAINING, 503, "shutting down"),
                                                  (EngineState.FAILED, 503, "rank 1 (host h, pid 3) stopped")])
def test_health_follows_the_engine_state_and_requests_get_503_unless_ready(engine, state, status, words):
    engine.state = state
    engine.error = "rank 1 (host h, pid 3) stopped responding" if state is EngineState.FAILED else None

    async def go():
        async with client_for(engine) as client:
            return (await client.get("/health"), await client.post("/v1/chat/completions", json=CHAT),
                    await client.get("/version"))

    health, chat, version = run(go())
    assert health.status_code == status and chat.status_code == (200 if status == 200 else 503)
    if status == 503:
        assert words in error_of(health)["message"] and error_of(chat)["type"] == "unavailable_error"
    assert version.status_code == 200 and version.json()["state"] == state.value


def test_cors_is_off_unless_origins_are_allowed(engine):
    async def preflight(**settings):
        async with client_for(engine, **settings) as client:
            return await client.options("/v1/chat/completions", headers={
                "origin": "http://chat.local", "access-control-request-method": "POST"})

    assert "access-control-allow-origin" not in run(preflight()).headers
    allowed = run(preflight(allowed_origins=("http://chat.local",)))
    assert allowed.headers["access-control-allow-origin"] == "http://chat.local"


def test_metrics_count_tokens_speculation_and_rejections(engine):
    async def go():
        async with client_for(engine) as client:
            await client.post("/v1/chat/completions", json=CHAT)
            await client.post("/v1/chat/completions", content=b"{")
            return (await client.get("/metrics")).text

    text = run(go())
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert lines["hetero_run:generation_tokens_total"] == 3
    assert lines['hetero_run:request_success_total{finished_reason="length"}'] == 1
    assert lines['hetero_run:request_rejected_total{reason="invalid"}'] == 1
    assert lines["hetero_run:spec_decode_num_drafts_total"] == 1
    assert lines["hetero_run:spec_decode_num_draft_tokens_total"] == 3
    assert lines["hetero_run:spec_decode_num_accepted_tokens_total"] == 1
    assert lines['hetero_run:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 1
    assert not any("position=\"1\"" in name for name in lines)
    assert lines["hetero_run:time_to_first_token_seconds_count"] == 1
    assert lines["hetero_run:e2e_request_latency_seconds_count"] == 1
    assert lines["hetero_run:kv_cache_usage_perc"] == pytest.approx(4 / 64)
    assert lines['hetero_run:engine_state{state="ready"}'] == 1


def test_the_live_line_shows_requests_tok_s_and_acceptance(engine):
    from hetero_run.launch.server.live import LiveLine

    metrics = Metrics(engine)
    timer = metrics.timer(0.0)
    for event in (GenerationEvent("r", "ab", (1, 2)),
                  GenerationEvent("r", "", (), "length", None, Usage(3, 2), SpeculationSummary("slem", 2, 1, 4, 3))):
        timer.observe(event)
    line = LiveLine(engine, metrics, "tiny").render()
    assert "0.40 tok/s" in line and "running 0" in line and "waiting 0" in line and "acceptance  75.0%" in line
    assert "1 done, 0 failed" in line
