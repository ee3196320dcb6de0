"""Paged KV blocks on rank 0: which sequence owns which block, and the prefix cache.

A block holds the K/V of `block_size` consecutive positions of one sequence. Each block is
free, in use (its reference count is the number of block tables naming it), or cached: no
longer in use, but still holding the K/V of a known token prefix, reusable until it is
evicted (least recently used first) to make room.

Prefix caching: a full block of committed tokens is keyed by a hash chained over every token
up to its end, h_i = H(h_{i-1}, tokens of block i), so one key means one whole prefix. A new
sequence whose first blocks' keys are known takes those blocks as they are (a second chat turn,
a shared system prompt) and computes only the rest. Reuse is exact because every row of a
forward gets the same bits whatever else is in the batch (kernels/batch_invariance.py).

Worked example, block_size 4: a sequence [5 6 7 8 | 9 1 2 3 | 4] commits its first 8 tokens:
blocks A and B get keys H(-, 5678) and H(H(-, 5678), 9123). A later prompt [5 6 7 8 9 1 2 3 7 7]
matches both keys and starts with table [A, B] and 8 cached tokens; [5 6 7 8 0 ...] matches A only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from hetero_run.topology.errors import UserError


class OutOfBlocks(Exception):
    """Not enough free or evictable blocks for the request; the scheduler preempts or waits."""


@dataclass
class BlockTable:
    """One sequence's blocks, in order, and the keys of its leading full blocks."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys[i]: block i's prefix key (full, committed blocks)

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


def block_key(parent: bytes, tokens) -> bytes:
    data = parent + b"|" + ",".join(str(int(t)) for t in tokens).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise UserError(f"need at least one block of at least one token, got {num_blocks} of {block_size}",
                            field="kv_blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = enable_prefix_caching
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self.cached: OrderedDict[int, bytes] = OrderedDict()  # unused blocks with valid K/V, oldest first
        self.by_key: dict[bytes, int] = {}  # prefix key -> block
        self.key_of: dict[int, bytes] = {}  # block -> its prefix key

    @property
    def num_free(self) -> int:
        """Blocks a sequence could take now: free ones and cached ones (evicted on demand)."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, token_ids: list[int], limit: int) -> BlockTable:
        """A new sequence's table holding the cached blocks of its longest known prefix of whole
        blocks, at most `limit` tokens (the engine keeps the last prompt token to compute)."""
        table = BlockTable()
        if not self.prefix_caching:
            return table
        b, parent = self.block_size, b""
        for i in range(min(limit, len(token_ids)) // b):
            key = block_key(parent, token_ids[i * b:(i + 1) * b])
            block = self.by_key.get(key)
            if block is None:
                break
            self._take(block)
            table.blocks.append(block)
            table.keys.append(key)
            parent = key
        return table

    def grow(self, table: BlockTable, tokens: int) -> None:
        """Give `table` room for `tokens` positions; OutOfBlocks (and no change) if it cannot."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need <= 0:
            return
        if need > self.num_free:
            raise OutOfBlocks(f"{need} blocks needed, {self.num_free} free")
        for _ in range(need):
            table.blocks.append(self._new_block())

    def shrink(self, table: BlockTable, tokens: int) -> None:
        """Release the blocks past the first `tokens` positions (a rejected draft's)."""
        keep = self.blocks_for(tokens)
        for block in table.blocks[keep:]:
            self._release(block)
        del table.blocks[keep:]
        del table.keys[keep:]

    def prefix_keys(self, token_ids: list[int], tokens: int) -> list[bytes]:
        """The keys the full blocks among the first `tokens` of `token_ids` will have once committed."""
        keys: list[bytes] = []
        b = self.block_size
        for i in range(min(tokens, len(token_ids)) // b):
            keys.append(block_key(keys[-1] if keys else b"", token_ids[i * b:(i + 1) * b]))
        return keys

    def commit(self, table: BlockTable, token_ids: list[int], committed: int) -> None:
        """The first `committed` tokens of this sequence are final (their K/V written and kept):
        key its full blocks among them, so later sequences can reuse them."""
        if not self.prefix_caching:
            return
        b = self.block_size
        for i in range(len(table.keys), min(committed, len(token_ids)) // b):
            parent = table.keys[-1] if table.keys else b""
            key = block_key(parent, token_ids[i * b:(i + 1) * b])
            table.keys.append(key)
            block = table.blocks[i]
            if key not in self.by_key and block not in self.key_of:
                self.by_key[key] = block
                self.key_of[block] = key

    def release(self, table: BlockTable) -> None:
        """The sequence is done (or preempted): every block it held returns."""
        for block in reversed(table.blocks):  # its tail first, so its head stays cached longest
            self._release(block)
        table.blocks.clear()
        table.keys.clear()

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, key = self.cached.popitem(last=False)  # evict the least recently used
            del self.by_key[key]
            del self.key_of[block]
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] > 0:
            return
        if block in self.key_of:
            self.cached[block] = self.key_of[block]  # most recently used last
        else:
            self.free.append(block)
