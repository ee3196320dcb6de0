"""One request inside the engine: its tokens, its blocks, where its KV cache stands.

Positions 0 .. len(token_ids) - 1 hold the prompt and then the generated tokens. The first
`computed` of them have final K/V in the cache; the rest still have to run (a prompt being
prefilled, and always the newest token, whose K/V the next forward writes):

    prompt [p0 .. p9], 4 of them from the prefix cache:  computed 4, to run p4 .. p9
    after the prompt and 3 rounds:  tokens p0 .. p9 g0 .. g6, computed 16, to run g6 (+ drafts)

A round on a sequence runs its pending tokens plus k draft tokens; the verifier keeps a of
the drafts, so computed grows by pending + a, and the recovered or bonus token becomes the
new pending token.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from hetero_run.runtime.engine.api import GenerationRequest, Sink
from hetero_run.runtime.engine.blocks import BlockTable

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    sink: Sink
    token_ids: list[int]  # prompt, then generated tokens
    number: int = field(default_factory=lambda: next(_ids))  # arrival order
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0  # leading positions whose K/V are final
    cached_tokens: int = 0  # prompt positions the prefix cache supplied (first admission)
    admitted_once: bool = False
    cancelled: bool = False
    cancel_reason: str | None = None
    finish_reason: str | None = None
    speculation: object = None  # the engine's per-sequence speculation state
    output: object = None  # the engine's per-sequence text output
    # what the request reports
    rounds: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    started: float = field(default_factory=time.monotonic)
    # with request.prompt_logprobs: entry j for prompt token j + 1, decided by the row of position j
    prompt_entries: list = field(default_factory=list)
    prompt_keys: list | None = None  # the prefix keys of its prompt's full blocks (the scheduler's, once)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_tokens

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_rows_wanted(self) -> bool:
        """Prompt positions whose logits are still to be read (their K/V cannot come from the cache)."""
        return self.request.prompt_logprobs is not None and len(self.prompt_entries) < self.prompt_len - 1

    @property
    def pending(self) -> int:
        """Positions that must run before this sequence's next token can be decided."""
        return len(self.token_ids) - self.computed

    @property
    def prefilling(self) -> bool:
        return self.pending > 1 or not self.generated

    @property
    def room(self) -> int:
        """Tokens it may still generate."""
        return self.request.max_new_tokens - self.generated
