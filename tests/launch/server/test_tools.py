"""Tool calls: the request's tools through the chat template, the answer's Hermes blocks back as
OpenAI `tool_calls`, streamed or not (launch/server/tools.py, over the scripted engine)."""

from __future__ import annotations

import json

import pytest
import speculative_support as support
from app_support import CHAT, client_for, parse_sse, post, run

from hetero_run.launch.server import tools

# a miniature of Qwen's template: the tools in a system turn, earlier calls as <tool_call> blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ANSWER = ["Let me check.<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_",
          "call>\n"]


@pytest.fixture
def tokenizer():
    tok = support.byte_level()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


@pytest.fixture
def engine(engine, tokenizer):
    engine.tokenizer, engine.pieces, engine.finish, engine.max_context = tokenizer, ANSWER, "stop", 4096
    return engine


def test_the_tools_reach_the_template_and_the_call_comes_back(engine, tokenizer):
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER]}))
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    (request,) = engine.requests
    text = tokenizer.apply_chat_template(CHAT["messages"], tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and list(request.prompt.target_ids) == tokenizer(text, add_special_tokens=False)[
        "input_ids"]
    assert request.prompt.messages is None  # the drafter reads the target's rendering, tools included


def test_a_streamed_call_is_one_delta_once_its_block_closes(engine):
    chunks = parse_sse(run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "stream": True})).text)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert deltas[0] == {"content": "Let me check."}  # "<tool" was held back, then opened a block
    (call,) = deltas[1]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert deltas[2:] == [{}] and chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_tools_out_and_the_text_alone(engine, tokenizer):
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "none"}))
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "".join(ANSWER)
    text = tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    assert list(engine.requests[0].prompt.target_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_bare_call_is_held_to_the_end_then_is_a_call(engine):
    engine.pieces = ['{"name": "get_weather",', ' "arguments": {"city": "Paris"}}']
    chunks = parse_sse(run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "stream": True})).text)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert [list(d) for d in deltas] == [["tool_calls"], []]
    assert json.loads(deltas[0]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    engine.pieces = ['{"name": "get_weather",', ' "size": 3}', " is JSON"]
    chunks = parse_sse(run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "stream": True})).text)
    assert [c["choices"][0]["delta"] for c in chunks[1:-1]] == [{"content": "".join(engine.pieces)}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_malformed_block_stays_text(engine):
    engine.pieces = ["<tool_call>", "{not json}", "</tool_call>"]
    choice = run(post(engine, "/v1/chat/completions", {**CHAT, "tools": [WEATHER]})).json()["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "<tool_call>{not json}</tool_call>"},
                      "logprobs": None, "finish_reason": "stop"}


def test_earlier_calls_and_their_results_are_rendered(engine, tokenizer):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 12}'}]
    engine.pieces = ["It is 12 degrees."]
    response = run(post(engine, "/v1/chat/completions", {**CHAT, "messages": history, "tools": [WEATHER]}))
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 12 degrees."}
    ids = list(engine.requests[0].prompt.target_ids)
    text = tokenizer.decode(ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<|im_start|>tool\n{"temp": 12}<|im_end|>' in text


@pytest.mark.parametrize("text, content, names", [
    ("plain", "plain", []),
    ('<tool_call>{"name": "a"}</tool_call>', None, ["a"]),  # arguments default to {}
    ('x <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '"{\\"k\\": 1}"}</tool_call>\n', "x", ["a", "b"]),
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', None, ["a"]),  # unclosed at the end, but whole
    ("<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("a <tool_c", "a <tool_c", []),  # a partial tag at the end is text
    (' {"name": "a", "arguments": {"k": 1}}\n', None, ["a"]),  # bare: the whole answer is calls
    ('{"name": "a"}\n{"name": "b", "arguments": {}}', None, ["a", "b"]),
    ('{"name": "zzz", "arguments": {}}', '{"name": "zzz", "arguments": {}}', []),  # not an offered tool
    ('{"name": "a"} and more', '{"name": "a"} and more', []),
    ('{"k": 1} <tool_call>{"name": "b"}</tool_call>', '{"k": 1}', ["b"]),
])
def test_parse(text, content, names):
    got, calls = tools.parse(text, {"a", "b"})
    assert got == content and [c["function"]["name"] for c in calls] == names
    assert len({c["id"] for c in calls}) == len(calls)


def test_any_split_of_the_text_streams_the_same_deltas():
    text = 'Sure: <tool_call>{"name": "f", "arguments": {"q": "<tool_call>"}}</tool_call>\n<tool_call>{"name": "g"}'
    whole, whole_calls = tools.parse(text, {"f"})
    for size in (1, 2, 3, 7, len(text)):
        stream = tools.CallStream({"f"})
        deltas = []
        for i in range(0, len(text), size):
            deltas += stream.feed(text[i:i + size])
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas).strip() == whole
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
            [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(whole_calls)]


def test_the_openai_client_reads_the_calls_streamed_and_not(engine):
    import openai

    async def go():
        async with client_for(engine) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            whole = await client.chat.completions.create(model="tiny", messages=CHAT["messages"], tools=[WEATHER])
            calls: dict[int, list[str]] = {}
            finish = None
            async for chunk in await client.chat.completions.create(model="tiny", messages=CHAT["messages"],
                                                                    tools=[WEATHER], stream=True):
                for call in chunk.choices[0].delta.tool_calls or ():
                    calls.setdefault(call.index, [call.id, call.function.name, ""])[2] += call.function.arguments
                finish = chunk.choices[0].finish_reason or finish
            return whole, calls, finish

    whole, calls, finish = run(go())
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Let me check."
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert finish == "tool_calls" and list(calls) == [0] and calls[0][0].startswith("call_")
    assert (calls[0][1], json.loads(calls[0][2])) == ("get_weather", {"city": "Paris"})
