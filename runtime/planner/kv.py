"""The KV cache in blocks: bytes per token and per block on each rank, and how many blocks the
cache gets.

The runtime's `KVCache` keeps K and V for every layer and local KV head in `num_blocks` blocks
of `block_size` slots, [layers, kv_heads, num_blocks * block_size, head_dim] twice, in the run's
dtype. At TP size s a rank holds num_kv_heads / s KV heads, or one replicated head when there
are fewer KV heads than ranks (`kv_head_split`). A sequence of n tokens owns ceil(n /
block_size) blocks. Every rank allocates the same number of blocks (rank 0's block tables name
them on every rank), so the cache gets what the tightest rank has room for.

Qwen3-235B, bf16, TP=2: 94 layers * 2 (K, V) * 2 heads * 128 * 2 bytes = 96256 bytes (94 KiB)
per token per rank; a 16-token block is 1.47 MiB; a 32,768-token sequence 2,048 blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetero_run.runtime.config import BatchingConfig
from hetero_run.runtime.planner.shape import ModelShape
from hetero_run.topology.errors import ConfigError


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    if shape.num_heads % tp:
        raise ConfigError(f"{shape.num_heads} attention heads do not split across {tp} ranks",
                          field="tensor_parallel_size")
    return shape.decoder.kv_heads_per_rank(tp)


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take on each rank (`KVCache.bytes_per_token` of the
    shard the loader builds, through the same config)."""
    kv_heads_per_rank(shape, tp)
    return shape.kv_bytes_per_token(tp, dtype)


def kv_cache_blocks(batching: BatchingConfig, context: int, blocks_by_memory: Sequence[int]) -> int:
    """The blocks every rank's KV cache gets: --kv-cache-tokens when given, else enough for
    --max-num-seqs sequences of `context` tokens, within what the tightest rank has room for,
    and never fewer than one full-length sequence needs (a plan that cannot give it that does
    not fit). `blocks_by_memory`: the room of each rank, in blocks."""
    if batching.requested_blocks is not None:
        return batching.requested_blocks
    per_sequence = batching.blocks_for(context)
    return max(per_sequence, min(batching.max_num_seqs * per_sequence, min(blocks_by_memory)))
