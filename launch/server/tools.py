"""Tool calls in the answer: the Hermes format that Qwen2.5 and Qwen3 chat templates teach their
models (and vLLM's `hermes` parser reads), turned into OpenAI's `tool_calls`.

The chat template lists the request's tools in the prompt and asks for each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

What the model writes is unchanged (speculation stays lossless): this only reads it. A block
whose body is a JSON object with a string `name` (and an object `arguments`, default {}) is a
call; anything else, a malformed block included, stays text, as vLLM's parser leaves it. Small
models often drop the tags (Qwen2.5-Coder-0.5B answers a weather question with the bare object):
an answer that is nothing but such objects, each naming an offered tool, is calls too, as
llama.cpp's Hermes parser reads it. Calls get ids `call_<24 hex digits>` and their arguments as a
JSON string, as OpenAI sends them.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_from(body: str) -> dict | None:
    """One block's body -> an OpenAI tool call, or None when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def bare_calls(text: str, names: set[str]) -> list[dict] | None:
    """An answer that is only JSON objects (whitespace between), each a call of one of `names`."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = call_from(json.dumps(value)) if isinstance(value, dict) and value.get("name") in names else None
        if call is None:
            return None
        calls.append(call)


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A whole answer -> (its text outside the calls, the calls); `names`: the offered tools. With
    calls, the text is stripped and None when nothing is left, as OpenAI returns `content: null`
    beside tool calls."""
    stream = CallStream(names)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", ())]
    for call in calls:
        del call["index"]
    if calls:
        return content.strip() or None, calls
    return content, calls


class CallStream:
    """Text deltas in, chat deltas out: {"content": text} for text, {"tool_calls": [call]} (with
    its `index`) once a call's block has closed. Text that may be the start of `<tool_call>` is
    held back until the next delta decides; text inside a block until the block closes; an answer
    that starts with `{` until it ends (it may be bare calls). After the first call, whitespace
    between calls is dropped."""

    def __init__(self, names: set[str]):
        self.names = names
        self._held, self._inside, self.calls = "", False, 0
        self._bare: bool | None = None  # None: the answer's first non-blank character is still to come

    def feed(self, text: str) -> list[dict]:
        self._held += text
        if self._bare is None and self._held.strip():
            self._bare = self._held.lstrip().startswith("{")
        if self._bare is not False:
            return []
        out: list[dict] = []
        while True:
            if self._inside:
                end = self._held.find(CLOSE)
                if end < 0:
                    return out
                body, self._held, self._inside = self._held[:end], self._held[end + len(CLOSE):], False
                out += self._block(body, closed=True)
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                out += self._text(self._held[:start])
                self._held, self._inside = self._held[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self._held, OPEN)
            out += self._text(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return out

    def finish(self) -> list[dict]:
        """What is still held when the answer ends (an unclosed block: a call if its body parses)."""
        if self._bare is not False:
            calls = bare_calls(self._held, self.names) if self._bare else None
            self._bare = False
            if calls:
                for call in calls:
                    call["index"] = self.calls
                    self.calls += 1
                return [{"tool_calls": calls}]
            held, self._held = self._held, ""
            return self.feed(held) + self.finish()
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            return self._block(held, closed=False)
        return self._text(held)

    def _block(self, body: str, closed: bool) -> list[dict]:
        call = call_from(body)
        if call is None:
            return self._text(OPEN + body + (CLOSE if closed else ""))
        call["index"] = self.calls
        self.calls += 1
        return [{"tool_calls": [call]}]

    def _text(self, text: str) -> list[dict]:
        if not text or (self.calls and not text.strip()):
            return []
        return [{"content": text}]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 when none does)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
