"""A static KV cache for one sequence: every layer's keys and values, preallocated.

Tokens occupy slots 0 .. length - 1. A forward appends its n tokens at slots length ..
length + n - 1 (a prompt chunk, one decode token, or k + 1 tokens to verify) and each of them
attends to the slots before it and to itself. `truncate(length)` rolls back to any shorter
length, e.g. the accepted prefix after verification; the next forward overwrites the slots
past it, so rollback copies nothing.
"""

from __future__ import annotations

import torch

from hetero_run.topology.errors import UserError


class KVCacheFull(UserError):
    """The sequence would grow past the slots the cache was sized for."""


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device):
        if max_tokens < 1:
            raise UserError(f"KV cache must hold at least one token, got {max_tokens}", field="max_tokens")
        shape = (num_layers, kv_heads, max_tokens, head_dim)
        # empty, not zeros: every slot is written before it is read, and untouched pages cost no memory
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [layers, kv_heads, max_tokens, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * dtype.itemsize

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_tokens:
            raise KVCacheFull(
                f"the sequence would reach {self.length + n} tokens but the KV cache holds {self.max_tokens}; "
                "raise --max-tokens (or shorten the prompt / --max-new-tokens)",
                field="max_tokens",
            )

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
