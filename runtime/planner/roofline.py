"""Decode roofline: how fast decoding can go when every step streams its bytes from memory.

A forward of n tokens per sequence reads, on each rank: its share of every dense weight
(attention, norms, routers, dense MLP, lm_head), one embedding row per token, the experts the
tokens route to, and the KV cache of the context. Its time is the busiest node's bytes (the
ranks on one node share its memory bandwidth) over that bandwidth, plus the collectives it
waits for times the link latency (the all-reduces are small, so latency, not bandwidth, bounds
them). Compute is assumed free: at batch 1 decode is memory-bound.

Experts: with E experts and k active per token, n independently and uniformly routed tokens
touch on average E * (1 - (1 - k/E)^n) distinct experts. For Qwen3-235B a verify of 4 tokens
touches ~29 of 128 experts per layer, not 8: verifying a draft of a MoE reads much more than one
decode step. Neighbouring tokens of one sequence often share experts, so the speculative ceiling
is given as a range: `independent` routing (the low end) and `shared` routing, where the tokens
of one verify window use the same k experts (the high end).

Speculative decoding, per round: the drafter proposes `draft_len` tokens on rank 0 while the
other ranks wait, then the target verifies draft_len + 1 tokens in one forward. With per-token
acceptance rate a and draft length K a round emits (1 - a^(K+1)) / (1 - a) tokens on average.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero_run.runtime.planner.hardware import Hardware
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.topology.errors import ConfigError


def expected_tokens_per_round(acceptance: float, draft_len: int) -> float:
    """Target tokens a round emits: accepted draft tokens plus the recovered or bonus token."""
    if acceptance >= 1.0:
        return draft_len + 1.0
    return (1.0 - acceptance ** (draft_len + 1)) / (1.0 - acceptance)


def experts_touched(num_experts: int, active: int, tokens: int) -> float:
    """Expected distinct experts `tokens` routed tokens use in one layer."""
    return num_experts * (1.0 - (1.0 - active / num_experts) ** tokens)


def collectives_per_forward(shape: ModelShape, tp: int) -> int:
    """All-reduces after o_proj and down_proj in every layer, one for the vocab-parallel
    embedding, one gather of the logits; none at TP=1."""
    return 0 if tp == 1 else 2 * shape.num_layers + 2


@dataclass(frozen=True)
class ForwardCost:
    tokens: int  # per sequence
    bytes_per_rank: tuple[int, ...]
    collectives: int
    seconds: float


def forward_bytes(groups: dict[str, int], shape: ModelShape, *, tokens: int, batch: int, context: int,
                  kv_bytes_per_token: int, embedding_row_bytes: int, skip: tuple[str, ...] = (),
                  shared_routing: bool = False, tied: bool = False) -> int:
    """Bytes one rank reads in a forward of `tokens` tokens for each of `batch` sequences that
    already hold `context` tokens of KV cache. `groups`: the rank's weight bytes per group.
    `shared_routing`: the tokens of one sequence use the same experts. `tied`: the embedding
    is also the lm_head, so it is read whole."""
    routed = (1 if shared_routing else tokens) * batch
    total = 0.0
    for group, nbytes in groups.items():
        if group in skip or group == "vocab_map":  # d2t / t2d: a few lookups per round
            continue
        if group == "experts":
            touched = experts_touched(shape.num_experts, shape.experts_per_token, routed)
            total += nbytes * touched / shape.num_experts
        elif group == "embedding" and not tied:
            total += min(nbytes, embedding_row_bytes * tokens * batch)
        else:
            total += nbytes
    total += batch * (context + tokens) * kv_bytes_per_token
    return int(total)


def forward_cost(per_rank_bytes: list[int], collectives: int, hardware: Hardware, tokens: int,
                 ranks_per_node: int = 1) -> ForwardCost:
    """Ranks on one node share its memory bandwidth: the busiest node's bytes set the time."""
    node_bytes = [sum(per_rank_bytes[i:i + ranks_per_node]) for i in range(0, len(per_rank_bytes), ranks_per_node)]
    seconds = max(node_bytes) / hardware.bandwidth_bytes_per_s + collectives * hardware.link_latency_s
    return ForwardCost(tokens, tuple(per_rank_bytes), collectives, seconds)


@dataclass(frozen=True)
class Roofline:
    hardware: Hardware
    batch: int
    context: int
    decode: ForwardCost  # one new token per sequence
    verify: ForwardCost | None = None  # draft_len + 1 tokens per sequence, independent routing
    verify_shared: ForwardCost | None = None  # the same with the window's tokens sharing experts
    draft_step: ForwardCost | None = None  # one drafter step on rank 0
    draft_round_extra_s: float = 0.0  # once per round (EAGLE-3: fusing the target features)
    acceptance: float = 0.0
    draft_len: int = 0

    def __post_init__(self):
        if not 0.0 <= self.acceptance <= 1.0:
            raise ConfigError(f"must be between 0 and 1, got {self.acceptance}", field="acceptance")
        if self.verify is not None and self.draft_len < 1:
            raise ConfigError(f"must be >= 1, got {self.draft_len}", field="draft_len")

    @property
    def target_tokens_per_s(self) -> float:
        """Per sequence; the batch emits `batch` times this."""
        return 1.0 / self.decode.seconds

    @property
    def expected_tokens_per_round(self) -> float:
        return expected_tokens_per_round(self.acceptance, self.draft_len)

    def round_seconds(self, shared_routing: bool = False) -> float | None:
        verify = self.verify_shared if shared_routing else self.verify
        if verify is None or self.draft_step is None:
            return None
        return self.draft_round_extra_s + self.draft_len * self.draft_step.seconds + verify.seconds

    def speculative_tokens_per_s(self, shared_routing: bool = False) -> float | None:
        """Per-sequence ceiling with speculative decoding (the low end of the range by default)."""
        seconds = self.round_seconds(shared_routing)
        return None if seconds is None else self.expected_tokens_per_round / seconds

    def speedup(self, shared_routing: bool = False) -> float | None:
        spec = self.speculative_tokens_per_s(shared_routing)
        return None if spec is None else spec / self.target_tokens_per_s

    def to_json(self) -> dict:
        def cost(c: ForwardCost | None):
            if c is None:
                return None
            return {"tokens": c.tokens, "bytes_per_rank": list(c.bytes_per_rank), "collectives": c.collectives,
                    "seconds": c.seconds}

        return {
            "memory_bandwidth_gbps": self.hardware.memory_bandwidth_gbps,
            "link_latency_us": self.hardware.link_latency_us,
            "bandwidth_measured": self.hardware.measured,
            "batch": self.batch,
            "context_tokens": self.context,
            "decode": cost(self.decode),
            "target_tokens_per_s": self.target_tokens_per_s,
            "speculative": None if self.verify is None else {
                "acceptance": self.acceptance,
                "draft_len": self.draft_len,
                "expected_tokens_per_round": self.expected_tokens_per_round,
                "draft_step": cost(self.draft_step),
                "draft_round_extra_s": self.draft_round_extra_s,
                "verify": cost(self.verify),
                "verify_shared_routing": cost(self.verify_shared),
                "round_seconds": self.round_seconds(),
                "tokens_per_s": self.speculative_tokens_per_s(),
                "speedup": self.speedup(),
                "tokens_per_s_shared_routing": self.speculative_tokens_per_s(shared_routing=True),
                "speedup_shared_routing": self.speedup(shared_routing=True),
            },
        }
