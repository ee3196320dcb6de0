"""Requests -> the prompt the engine runs: the target's ids exactly as `hetero-run generate` encodes
them (chat template + generation prompt for chat, the tokenizer's special tokens for raw text),
and the messages or text for a drafter that reads them its own way. Runs in a worker thread."""

from __future__ import annotations

import threading

from hetero_run.launch.generate import encode_chat, encode_text
from hetero_run.launch.server.errors import bad_request
from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.runtime.speculative.vocab import TokenTable


class Prompter:
    def __init__(self, tokenizer, stop_ids: set[int]):
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        # a fast tokenizer may reconfigure itself inside __call__; encodes from many worker threads take turns
        self._lock = threading.Lock()
        self._table: TokenTable | None = None  # built at the first request for log probabilities

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, conversation: list[dict], tools: list[dict] | None = None) -> Prompt:
        """With tools, or a conversation that carries tool calls or results, the drafter reads the
        target's rendering as text: its own template may know nothing of tools."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template: use /v1/completions", "messages")
        try:
            with self._lock:
                ids = encode_chat(self.tokenizer, conversation, tools)
                listed = not tools or ids != encode_chat(self.tokenizer, conversation)
        except Exception as exc:  # a template that refuses the conversation (e.g. roles out of order)
            raise bad_request(f"the chat template refused the conversation: {exc}", "messages") from None
        if not listed:
            raise bad_request("the model's chat template does not list tools, so the model cannot call them", "tools")
        tooled = tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation)
        messages = None if tooled else tuple(conversation)
        return self._checked(Prompt(messages=messages, target_ids=tuple(ids)), "messages")

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and its exact bytes (a token that ends inside a character has bytes that
        are not UTF-8 on their own; its text shows U+FFFD there); a special token is its content;
        an id past the tokenizer (a padded vocabulary row) is empty. For log probabilities."""
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = TokenTable.from_tokenizer(self.tokenizer)
        if token_id >= len(self._table):
            return "", b""
        raw = self._table.pieces[token_id]
        if raw is None:  # special
            raw = self.tokenizer.convert_ids_to_tokens(token_id).encode("utf-8")
        return raw.decode("utf-8", "replace"), raw

    def token_strings(self, ids) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(list(ids))

    def detokenize(self, ids) -> str:
        """Ids -> text with the special tokens kept, so /tokenize and /detokenize round-trip."""
        return self.tokenizer.decode(self.checked_ids(ids, "tokens"), skip_special_tokens=False)

    def checked_ids(self, ids, param: str) -> list[int]:
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary ({vocab} tokens)", param)
        return list(ids)

    def completion(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            with self._lock:
                ids = encode_text(self.tokenizer, prompt)
            return self._checked(Prompt(text=prompt, target_ids=tuple(ids)), "prompt")
        return self._checked(Prompt(target_ids=tuple(self.checked_ids(prompt, "prompt"))), "prompt")

    @staticmethod
    def _checked(prompt: Prompt, param: str) -> Prompt:
        if not prompt.target_ids:
            raise bad_request("the prompt is empty", param)
        return prompt
