"""Memory of one rank: what it holds, against the memory of the node it runs on.

Memory on a rank is `fixed + per_context_token * context` (weights, scratch and overhead are
fixed; the KV cache and the attention mask grow with the context), the KV cache rounded up to
whole blocks, so the longest context that fits is `(capacity - fixed) // per_context_token`
or at most a block's worth of tokens less.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetero_run.runtime.models.kv_cache import DEFAULT_BLOCK_SIZE
from hetero_run.runtime.planner.workspace import Workspace
from hetero_run.topology.errors import ConfigError


@dataclass(frozen=True)
class Node:
    name: str
    memory_bytes: int

    def __post_init__(self):
        if self.memory_bytes <= 0:
            raise ConfigError(f"node {self.name!r} has {self.memory_bytes} bytes of memory", field="memory_gib")


@dataclass(frozen=True)
class RankPlan:
    rank: int
    node: str
    capacity_bytes: int
    context: int
    batch: int
    weights_by_group: dict[str, int]
    kv_bytes_per_token: int
    drafter_weights_bytes: int
    drafter_kv_bytes_per_token: int
    workspace: Workspace
    reserved_bytes: int
    overhead_bytes: int

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_group.values())

    @property
    def kv_tokens(self) -> int:
        """KV cache slots: context * batch, in whole blocks (models/kv_cache.py)."""
        return -(-self.context * self.batch // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.kv_tokens

    @property
    def drafter_kv_bytes(self) -> int:
        return self.drafter_kv_bytes_per_token * self.context * self.batch

    @property
    def drafter_bytes(self) -> int:
        return self.drafter_weights_bytes + self.drafter_kv_bytes

    @property
    def activation_bytes(self) -> int:
        return self.workspace.at(self.context)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.drafter_bytes + self.activation_bytes
                + self.reserved_bytes + self.overhead_bytes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def fixed_bytes(self) -> int:
        return (self.weights_bytes + self.drafter_weights_bytes + self.workspace.fixed_bytes
                + self.reserved_bytes + self.overhead_bytes)

    @property
    def per_context_token_bytes(self) -> int:
        return (self.batch * (self.kv_bytes_per_token + self.drafter_kv_bytes_per_token)
                + self.workspace.per_context_token_bytes)

    @property
    def max_context_tokens(self) -> int:
        """Longest context whose plan fits this rank (0 when not even one token fits)."""
        room = self.capacity_bytes - self.fixed_bytes
        longest = max(0, room // self.per_context_token_bytes)
        while longest > 0 and not replace(self, context=longest).fits:  # the KV cache rounds up to whole blocks
            longest -= 1
        return longest

    @property
    def kv_room_bytes(self) -> int:
        """What is left for the KV cache once everything else at this context is placed."""
        return self.capacity_bytes - (self.total_bytes - self.kv_bytes - self.drafter_kv_bytes)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "weights_bytes": self.weights_bytes,
            "weights_by_group": dict(self.weights_by_group),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "drafter_bytes": self.drafter_bytes,
            "drafter_weights_bytes": self.drafter_weights_bytes,
            "drafter_kv_bytes": self.drafter_kv_bytes,
            "activation_bytes": self.activation_bytes,
            "reserved_bytes": self.reserved_bytes,
            "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes,
            "capacity_bytes": self.capacity_bytes,
            "free_bytes": self.free_bytes,
            "kv_room_bytes": self.kv_room_bytes,
            "max_context_tokens": self.max_context_tokens,
            "fits": self.fits,
        }
