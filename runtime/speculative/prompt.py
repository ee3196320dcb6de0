"""A prompt as each model reads it: the target through its tokenizer, the drafter through its own.

A conversation is rendered with each tokenizer's own chat template (the drafter reads the
conversation the way it was trained to, which matters for acceptance). A drafter without a
chat template reads the target's rendering as text. Raw text gets each tokenizer's own
special tokens (a BOS where its tokenizer adds one). A caller that has already rendered the
target's prompt passes `target_ids` along with the messages or text: the target then reads
exactly those ids and the drafter still reads the conversation its own way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetero_run.topology.errors import UserError


@dataclass(frozen=True)
class Prompt:
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    target_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, prompt: str | Sequence | Prompt, chat: bool = False) -> Prompt:
        """str (raw text, or one user turn when `chat`), a list of {"role", "content"} messages,
        a list of target token ids, or a Prompt."""
        if isinstance(prompt, Prompt):
            return prompt
        if isinstance(prompt, str):
            return cls(messages=({"role": "user", "content": prompt},)) if chat else cls(text=prompt)
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            return cls(messages=tuple(items))
        if items and all(isinstance(t, int) for t in items):
            return cls(target_ids=tuple(items))
        raise UserError("a prompt is text, a list of chat messages or a list of token ids", field="prompt")

    def for_target(self, tokenizer) -> list[int]:
        return list(self.target_ids) if self.target_ids is not None else self.render(tokenizer)

    def for_drafter(self, tokenizer, target_tokenizer) -> list[int]:
        return self.render(tokenizer, self.target_text(target_tokenizer))

    def render(self, tokenizer, fallback_text: str | None = None) -> list[int]:
        """Token ids for `tokenizer`; `fallback_text` is what a template-less tokenizer reads."""
        if self.messages is not None:
            if getattr(tokenizer, "chat_template", None):
                out = tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
                return list(out["input_ids"] if isinstance(out, dict) else out)
            if fallback_text is None:
                raise UserError("the tokenizer has no chat template; give a raw prompt instead", field="chat")
            return tokenizer(fallback_text, add_special_tokens=False)["input_ids"]
        if self.text is not None:
            return tokenizer(self.text, add_special_tokens=True)["input_ids"]
        if fallback_text is None:
            raise UserError("token-id prompts need the target's tokenizer", field="prompt")
        return tokenizer(fallback_text, add_special_tokens=False)["input_ids"]

    def target_text(self, tokenizer) -> str:
        """The prompt as the target reads it, as text (what a template-less drafter reads)."""
        if self.target_ids is not None:
            return tokenizer.decode(list(self.target_ids), skip_special_tokens=False)
        if self.messages is not None and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=False)
        return self.text if self.text is not None else "\n".join(m["content"] for m in self.messages)
