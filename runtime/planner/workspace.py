"""Activations and scratch memory: an estimate, sized for the largest forward the run does.

The largest target forward is one step of `rows` rows: --max-num-batched-tokens for `serve`
(decode, draft and prompt rows of many sequences together), a prefill chunk for `generate`
(one sequence). Per rank, in the activation dtype unless noted:
- hidden states: residual, normed input, attention output, MLP output: 4 * n * H;
- attention: local q, k, v and the attention output: n * (2 * q_local + 2 * kv_local);
- what attention builds per (row, key), each row reading up to `context` keys: for the
  runtime's paged attention one int64 cache slot, about six such lists alive while they are
  built (batch.py `key_lists`): rows * context * KEY_LIST_BYTES; for an EAGLE-3 head or a
  transformers drafter a causal mask and the additive mask made of it: rows * context * (1 + a).
  And the rotary cos / sin tables for every position the model may reach:
  2 * context * head_dim * a. These two grow with the context;
- MLP: gate, up and their product: 3 * n * I_local; MoE: the same per routed token
  (n * k rows of moe_intermediate / tp) plus float32 router logits n * E;
- NVFP4 scratch: one dequantised weight tile (the kernel's `TILE_ELEMENTS`, float32) and
  float32 copies of the widest layer's input and output;
- logits, float32: every rank's vocabulary shard for the rows that need logits (each running
  sequence's pending token and drafts), and on rank 0 the gathered full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_run.runtime.planner.accounting import RankTensor
from hetero_run.runtime.planner.kv import kv_heads_per_rank
from hetero_run.runtime.planner.shape import ModelShape

FP32 = 4
KEY_LIST_BYTES = 6 * 8  # int64 slots per (row, key): key_slots and its temporaries at their peak


@dataclass(frozen=True)
class Workspace:
    fixed_bytes: int
    per_context_token_bytes: int

    def at(self, context: int) -> int:
        return self.fixed_bytes + self.per_context_token_bytes * context

    def __add__(self, other: Workspace) -> Workspace:
        return Workspace(self.fixed_bytes + other.fixed_bytes,
                         self.per_context_token_bytes + other.per_context_token_bytes)


def workspace(shape: ModelShape, tensors: list[RankTensor], *, tp: int, rows: int, logits_rows: int,
              act_dtype: torch.dtype, gathers_logits: bool, paged: bool = True) -> Workspace:
    """The scratch of a forward of `rows` rows of which `logits_rows` need logits; `paged`: the
    runtime's paged attention (key lists), else a masked attention."""
    a = act_dtype.itemsize
    n = rows
    h = shape.attention_input_size
    q_local, kv_local = shape.q_size // tp, kv_heads_per_rank(shape, tp) * shape.head_dim
    fixed = 4 * n * h * a + n * (2 * q_local + 2 * kv_local) * a
    if shape.is_moe:
        fixed += 3 * n * shape.experts_per_token * (shape.moe_intermediate_size // tp) * a
        fixed += n * shape.num_experts * FP32
    else:
        fixed += 3 * n * (shape.intermediate_size // tp) * a
    if shape.eagle3:
        fixed += n * 3 * shape.target_hidden_size * a  # the fused target features it reads
    fixed += _nvfp4_scratch(tensors, n)
    vocab = shape.draft_vocab_size if shape.eagle3 else shape.vocab_size
    fixed += logits_rows * -(-vocab // tp) * FP32
    if gathers_logits and tp > 1:
        fixed += logits_rows * vocab * FP32
    per_key = KEY_LIST_BYTES if paged else 1 + a
    return Workspace(int(fixed), rows * per_key + 2 * shape.head_dim * a)


def _nvfp4_scratch(tensors: list[RankTensor], rows: int) -> int:
    """The NVFP4 kernel's scratch for `rows` input rows: one dequantised tile of the weight
    (float32, `TILE_ELEMENTS`) and float32 copies of the input and output of the widest layer."""
    from hetero_run.kernels.nvfp4_linear import TILE_ELEMENTS

    widest = 0
    for t in tensors:
        if t.name.endswith(".codes"):  # [out, in / 2]
            widest = max(widest, t.shape[0] + 2 * t.shape[1])
    return 0 if widest == 0 else TILE_ELEMENTS * FP32 + rows * widest * FP32
