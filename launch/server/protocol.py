"""OpenAI request and response shapes, as typed models that validate themselves.

A request that fails validation is a 400 naming the field (`messages[1].role: Input should be
'system', 'user' or 'assistant'`). Types are strict, as OpenAI's are: "5" is not a number.
Fields a server does not know are ignored (clients send extras); fields hetero-run knows but
cannot honour (a tool_choice that forces a call, a response format other
than text, sampling penalties and logit biases) are a 400 naming them, as vLLM and llama-server
refuse what they are not set up for: an answer that quietly ignored them would not be what was
asked. The neutral values clients send by default (penalties of 0, an empty logit_bias,
{"type": "text"}) pass.

Tools: `tools` with `tool_choice` "auto" (the default) reach the chat template, and the answer's
calls come back as `tool_calls` (tools.py); "none" leaves them out of the prompt. A conversation
may carry earlier calls (an assistant message's `tool_calls`, its content null) and their results
(`role: "tool"` messages).

Log probabilities: chat `logprobs: true` (+ `top_logprobs` 0..20), completions `logprobs` 0..20
(with `echo`, the prompt's tokens first), as OpenAI shapes them (`chat_logprobs`,
`completion_logprobs`). They are the target's raw
log-probabilities (log-softmax of its logits, before temperature, top-k and top-p: vLLM's
default), computed on the rows that decided each token, so speculation changes none of them.

`n` (1..16): that many choices of one prompt, each its own engine request, batched together;
choice i of a seeded request is what the same request with seed + i returns alone.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetero_run.launch.server.errors import APIError, bad_request

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_N = 16  # choices of one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: no top-k cut
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # choices, each its own engine request
    ignore_eos: bool = False  # vLLM's extension: generate past end-of-sequence tokens
    # vLLM's extension: more tokens that end generation (not shown in the text), even with ignore_eos
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the output's token ids in the response

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        return None  # completions with echo only

    @property
    def scores_only(self) -> bool:
        return False  # completions with echo only

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # a JSON object, encoded, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value):
        try:
            decoded = json.loads(value)
        except ValueError:
            raise ValueError("is not valid JSON") from None
        if not isinstance(decoded, dict):
            raise ValueError("must encode a JSON object")
        return value


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        # chat templates write the arguments with `| tojson`: they take the object, not its encoding
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionSpec


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def conversation(messages: list[Message]) -> list[dict]:
    """Messages as chat templates take them, or a 400 naming the message that cannot be one."""
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request("is required (null only for an assistant message with tool_calls)",
                              f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise bad_request("only assistant messages carry tool calls", f"messages[{i}].tool_calls")
    return [m.for_template() for m in messages]


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @property
    def wanted_logprobs(self) -> int | None:
        """None: no log-probabilities; k: each token's and the k likeliest."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the chat template lists, or None (no tools, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def tool_names(self) -> set[str]:
        return {tool.function.name for tool in self.tools or ()}


class CompletionRequest(_Request):
    # 0 with echo: score the prompt (its text and, with logprobs, its tokens' figures), generate nothing
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: bool = False  # the prompt's text before the completion's
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Literal[1] | None = None

    @property
    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """With echo, the prompt's tokens are listed too, with their log-probabilities."""
        return self.logprobs if self.echo else None

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 (with echo): the answer is the prompt alone, its tokens scored."""
        return self.max_tokens == 0


    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        return value[0] if isinstance(value, list) and value and isinstance(value[0], str) else value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: raw text (`prompt`, the tokenizer's special tokens unless
    add_special_tokens is false) or a conversation (`messages` [+ `tools`], through the chat
    template with the assistant's turn opened, as /v1/chat/completions encodes it)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse(kind: type[BaseModel], body: bytes) -> BaseModel:
    """The request body -> a validated request (of `kind`), or an APIError 400 naming the field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    if kind is not ChatRequest and data.get("logprobs") is False:
        data.pop("logprobs")  # clients send logprobs: false to any route
    if kind is ChatRequest and data.get("top_logprobs") is not None and data.get("logprobs") is not True:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    for field, neutral, why in _NOT_HONOURED:
        if field in data and data[field] is not None and not neutral(data[field]):
            raise bad_request(why, field)
    try:
        request = kind.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc) from None
    if isinstance(request, CompletionRequest) and request.max_tokens == 0 and not request.echo:
        raise bad_request("0 scores the prompt without generating and needs echo: true", "max_tokens")
    return request


# (field, whether its value asks for nothing, the 400's message)
_NOT_HONOURED = (
    ("tool_choice", lambda v: v in ("none", "auto"),
     'only "auto" and "none" are supported: a forced call needs constrained decoding'),
    ("response_format", lambda v: v == {"type": "text"},
     'only {"type": "text"} is supported: no JSON mode or schema-constrained decoding'),
    ("presence_penalty", lambda v: v == 0, "sampling penalties are not supported (0 only)"),
    ("frequency_penalty", lambda v: v == 0, "sampling penalties are not supported (0 only)"),
    ("repetition_penalty", lambda v: v == 1, "repetition_penalty is not supported (1 only)"),
    ("logit_bias", lambda v: v == {}, "logit_bias is not supported"),
)


def _field_error(exc: ValidationError) -> APIError:
    # a union reports one error per branch; the first names the field well enough
    error = exc.errors(include_url=False)[0]
    loc = [part for part in error["loc"] if not _is_branch(part)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    message = error["msg"]
    if error["type"] == "missing":
        message = "is required"
    elif error["type"] == "value_error":
        message = str(error["ctx"]["error"])
    return bad_request(message, param)


def _is_branch(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "list[str]", "list[int]", "list[TextPart]")
                                      or part.startswith(("list[", "constrained-", "function-")))


# -- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None

    @classmethod
    def of(cls, usage) -> Usage:
        return cls(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.prompt_tokens + usage.completion_tokens,
                   prompt_tokens_details={"cached_tokens": usage.cached_tokens})


class ResponseIds:
    """id, created and model of one request; every chunk of a stream carries the same."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def chat_choice(index: int, content: str | None, finish_reason: str, tool_calls: list[dict] | None = None,
                logprobs: dict | None = None, token_ids=None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return _with_ids({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason},
                     token_ids)


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None, token_ids=None) -> dict:
    return _with_ids({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, token_ids)


def chat_response(ids: ResponseIds, choices: list[dict], usage, speculation, prompt_ids=None) -> dict:
    return _response(ids.head("chat.completion"), choices, usage, speculation, prompt_ids)


def completion_response(ids: ResponseIds, choices: list[dict], usage, speculation, prompt_ids=None) -> dict:
    return _response(ids.head("text_completion"), choices, usage, speculation, prompt_ids)


def _response(head: dict, choices: list[dict], usage, speculation, prompt_ids) -> dict:
    body = {**head, "choices": choices, "usage": Usage.of(usage).model_dump(), "speculation": _speculation(speculation)}
    if prompt_ids is not None:  # vLLM's return_token_ids
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def _with_ids(choice: dict, token_ids) -> dict:
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_chunk(ids: ResponseIds, delta: dict, finish_reason: str | None = None, include_usage: bool = False,
               speculation=None, logprobs: dict | None = None, index: int = 0) -> dict:
    chunk = {**ids.head("chat.completion.chunk"),
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return _chunk_extras(chunk, include_usage, speculation)


def completion_chunk(ids: ResponseIds, text: str, finish_reason: str | None = None, include_usage: bool = False,
                     speculation=None, logprobs: dict | None = None, index: int = 0) -> dict:
    chunk = {**ids.head("text_completion"),
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return _chunk_extras(chunk, include_usage, speculation)


# OpenAI's JSON has no -inf: a token the target gives no chance at all reads this, as in vLLM
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries, piece) -> dict:
    """Chat `choices[].logprobs` of TokenLogprob `entries`: per token its text, log-probability,
    bytes and the likeliest tokens there. `piece(id) -> (text, bytes)`."""
    def one(token_id: int, logprob: float) -> dict:
        text, raw = piece(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(raw)}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries, piece, prompt: tuple | None = None, base: int = 0) -> dict:
    """Completions `choices[].logprobs` (the legacy shape): tokens, their log-probabilities, per
    token the likeliest tokens and the token itself as {text: log-probability}, and where each
    token's text starts in the choice's text (`base` added to the output's offsets: the echoed
    prompt's length). With echo, `prompt` = (the first prompt token, TokenLogprob entries of the
    others) comes first: the first token has no figures (null), the offsets add up its tokens' texts."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token_id: int, logprob, top, offset: int) -> None:
        text = piece(token_id)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(None if logprob is None else _lp(logprob))
        if logprob is None:
            out["top_logprobs"].append(None)
        else:
            out["top_logprobs"].append({piece(i)[0]: _lp(lp) for i, lp in top})
            out["top_logprobs"][-1].setdefault(text, _lp(logprob))

    if prompt is not None:
        first, others = prompt
        add(first, None, (), 0)
        offset, previous = 0, first
        for e in others:
            offset += len(piece(previous)[0])
            add(e.token_id, e.logprob, e.top, offset)
            previous = e.token_id
    for e in entries:
        add(e.token_id, e.logprob, e.top, base + e.offset)
    return out


def usage_chunk(ids: ResponseIds, obj: str, usage) -> dict:
    return {**ids.head(obj), "choices": [], "usage": Usage.of(usage).model_dump()}


def _chunk_extras(chunk: dict, include_usage: bool, speculation) -> dict:
    if include_usage:
        chunk["usage"] = None
    if speculation is not None:
        chunk["speculation"] = _speculation(speculation)
    return chunk


def _speculation(summary) -> dict | None:
    if summary is None:
        return None
    out = summary.to_json()
    out["acceptance_rate"] = round(summary.accepted_tokens / summary.draft_tokens, 4) if summary.draft_tokens else 0.0
    return out
