"""Memory of one rank: what it holds, against the memory of the node it runs on.

Everything but the target's KV cache is placed first: weights, the drafter (its weights and,
on rank 0, its own KV cache for --max-num-seqs sequences of the context), activations sized for
a step of --max-num-batched-tokens rows, runtime overhead and what the OS keeps. What is left
is the room for the KV cache, counted in whole blocks of `block_size * kv_bytes_per_token`
bytes; `kv_blocks`, the blocks the cache actually gets, is the same on every rank
(kv.py `kv_cache_blocks`).

Worked example, Qwen3-235B at TP=2, bf16 KV (94 KiB per token), block size 16: one block is
1,540,096 bytes (1.47 MiB); a 32,768-token sequence owns 2,048 blocks (2.94 GiB); spark-b's
49.16 GiB of room holds 34,274 blocks: 16 such sequences at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetero_run.runtime.config import BatchingConfig
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
    batching: BatchingConfig
    weights_by_group: dict[str, int]
    kv_bytes_per_token: int
    drafter_weights_bytes: int
    drafter_kv_bytes_per_token: int
    workspace: Workspace
    reserved_bytes: int
    overhead_bytes: int
    kv_blocks: int = 0  # the blocks the KV cache gets, the same on every rank (make_plan sets it)

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights_by_group.values())

    @property
    def block_size(self) -> int:
        return self.batching.block_size

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of the full context owns."""
        return self.batching.blocks_for(self.context)

    @property
    def kv_tokens(self) -> int:
        """KV cache slots: the `kv_tokens` the loader is given (models/kv_cache.py)."""
        return self.kv_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_block_bytes * self.kv_blocks

    @property
    def drafter_kv_bytes(self) -> int:
        """The drafter's own KV cache (rank 0): one slot of the context per sequence."""
        return self.drafter_kv_bytes_per_token * self.context * self.batching.max_num_seqs

    @property
    def drafter_bytes(self) -> int:
        return self.drafter_weights_bytes + self.drafter_kv_bytes

    @property
    def activation_bytes(self) -> int:
        return self.workspace.at(self.context)

    @property
    def other_bytes(self) -> int:
        """Everything on this rank but the target's KV cache."""
        return (self.weights_bytes + self.drafter_bytes + self.activation_bytes + self.reserved_bytes
                + self.overhead_bytes)

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + self.kv_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    @property
    def kv_room_bytes(self) -> int:
        """What is left for the KV cache once everything else at this context is placed."""
        return self.capacity_bytes - self.other_bytes

    @property
    def kv_blocks_by_memory(self) -> int:
        """The most blocks this rank has room for."""
        return max(0, self.kv_room_bytes) // self.kv_block_bytes

    @property
    def sequences(self) -> int:
        """Sequences of the full context the KV cache holds at once."""
        return self.kv_blocks // self.blocks_per_sequence

    @property
    def sequences_by_memory(self) -> int:
        """Sequences of the full context this rank's room could hold at once."""
        return self.kv_blocks_by_memory // self.blocks_per_sequence

    @property
    def max_num_seqs_fit(self) -> bool:
        """Whether --max-num-seqs sequences of the full context fit this rank at once."""
        return self.sequences_by_memory >= self.batching.max_num_seqs

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes and self.kv_blocks >= self.blocks_per_sequence

    def alone(self, context: int) -> RankPlan:
        """This rank at another context, its KV cache as the default budget would size it if it
        were the only rank (or as --kv-cache-tokens asks)."""
        from hetero_run.runtime.planner.kv import kv_cache_blocks

        at = replace(self, context=context)
        return replace(at, kv_blocks=kv_cache_blocks(self.batching, context, [at.kv_blocks_by_memory]))

    @property
    def max_context_tokens(self) -> int:
        """Longest context whose plan fits this rank (0 when not even one token fits). Memory
        only grows with the context, so a binary search finds it exactly."""
        low, high = 0, self.capacity_bytes // self.kv_bytes_per_token + 1  # high never fits
        while high - low > 1:
            middle = (low + high) // 2
            if self.alone(middle).fits:
                low = middle
            else:
                high = middle
        return low

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "node": self.node,
            "weights_bytes": self.weights_bytes,
            "weights_by_group": dict(self.weights_by_group),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_block_bytes": self.kv_block_bytes,
            "kv_blocks": self.kv_blocks,
            "kv_tokens": self.kv_tokens,
            "kv_bytes": self.kv_bytes,
            "blocks_per_sequence": self.blocks_per_sequence,
            "sequences": self.sequences,
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
            "kv_blocks_by_memory": self.kv_blocks_by_memory,
            "kv_tokens_by_memory": self.kv_blocks_by_memory * self.block_size,
            "sequences_by_memory": self.sequences_by_memory,
            "max_num_seqs_fit": self.max_num_seqs_fit,
            "max_context_tokens": self.max_context_tokens,
            "fits": self.fits,
        }
