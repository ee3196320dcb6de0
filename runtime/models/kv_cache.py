"""The paged KV cache storage: every layer's keys and values, preallocated in fixed-size blocks.

The cache holds num_blocks * block_size slots per layer and local KV head. Which blocks a
sequence owns is decided on rank 0 (its block table) and travels with each forward
(`batch.ForwardBatch`); this class only stores and moves K/V. A sequence that owns every block
in order (`one_sequence.OneSequence`) sees the slots as one long cache.

`length`, `check_room` and `truncate` serve a cache used as one plain sequence (the EAGLE-3
head's own cache).
"""

from __future__ import annotations

import torch

from hetero_run.topology.errors import UserError

DEFAULT_BLOCK_SIZE = 16


class KVCacheFull(UserError):
    """The sequence would grow past the slots the cache was sized for."""


def check_room(length: int, n: int, max_tokens: int) -> None:
    """Raise KVCacheFull unless a sequence of `length` tokens can grow by n within `max_tokens`."""
    if length + n > max_tokens:
        raise KVCacheFull(f"the sequence would reach {length + n} tokens but the KV cache holds {max_tokens}; "
                          "raise --context (or shorten the prompt / --max-new-tokens)", field="max_tokens")


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = DEFAULT_BLOCK_SIZE):
        if max_tokens < 1:
            raise UserError(f"KV cache must hold at least one token, got {max_tokens}", field="max_tokens")
        if block_size < 1:
            raise UserError(f"must be >= 1, got {block_size}", field="block_size")
        self.block_size = block_size
        self.num_blocks = -(-max_tokens // block_size)
        shape = (num_layers, kv_heads, self.num_blocks * block_size, head_dim)
        # empty, not zeros: every slot is written before it is read, and untouched pages cost no memory
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [layers, kv_heads, slots, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize

    def copy_slots(self, copies: torch.Tensor) -> None:
        """copies [2, C] (source, destination) physical slots: every layer's K/V move, all sources
        read before any destination is written."""
        src, dst = (c.to(self.k.device) for c in copies)
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]

    def check_room(self, n: int) -> None:
        check_room(self.length, n, self.max_tokens)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
