"""KV-cache bytes: per token per rank, and for a context of N tokens times a batch.

The runtime's `KVCache` keeps K and V for every layer and local KV head, [layers, kv_heads,
max_tokens, head_dim] twice, in the run's dtype. At TP size s a rank holds num_kv_heads / s KV
heads, or one replicated head when there are fewer KV heads than ranks (`kv_head_split`).
Qwen3-235B, bf16, TP=2: 94 layers * 2 (K, V) * 2 heads * 128 * 2 bytes = 96256 bytes (94 KiB)
per token per rank.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.models.kv_cache import KVCache
from hetero_run.runtime.planner.accounting import local_kv_heads
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.topology.errors import ConfigError


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    if shape.num_heads % tp:
        raise ConfigError(f"{shape.num_heads} attention heads do not split across {tp} ranks",
                          field="tensor_parallel_size")
    return local_kv_heads(shape.num_kv_heads, tp)


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take on each rank."""
    return KVCache.bytes_per_token(shape.num_layers, kv_heads_per_rank(shape, tp), shape.head_dim, dtype)
