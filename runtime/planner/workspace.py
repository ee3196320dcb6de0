"""Activations and scratch memory: an estimate, sized for the largest forward the run does.

The largest forward is a prefill chunk of `prefill_chunk` tokens for each of `batch`
sequences (decode and verify forwards are smaller as long as draft_len + 1 <= prefill_chunk).
Per rank, in the activation dtype unless noted:
- hidden states: residual, normed input, attention output, MLP output: 4 * n * H;
- attention: local q, k, v and the attention output: n * (2 * q_local + 2 * kv_local);
- the causal mask of a multi-token forward, [chunk, context] bool, and the additive mask the
  fused attention kernel makes of it in the activation dtype: batch * chunk * context * (1 + a)
  (the fused kernel never materialises scores); and the rotary cos / sin tables the model
  builds for every position it may reach: 2 * context * head_dim * a. These two grow with the
  context;
- MLP: gate, up and their product: 3 * n * I_local; MoE: the same per routed token
  (n * k rows of moe_intermediate / tp) plus float32 router logits n * E;
- NVFP4 scratch: one dequantised weight tile (the kernel's `TILE_ELEMENTS`, float32) and
  float32 copies of the widest layer's input and output;
- logits, float32: every rank's vocabulary shard for the tokens that need logits, and on
  rank 0 the gathered full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_run.runtime.planner.accounting import RankTensor
from hetero_run.runtime.planner.kv import kv_heads_per_rank
from hetero_run.runtime.planner.shape import ModelShape

FP32 = 4


@dataclass(frozen=True)
class Workspace:
    fixed_bytes: int
    per_context_token_bytes: int

    def at(self, context: int) -> int:
        return self.fixed_bytes + self.per_context_token_bytes * context

    def __add__(self, other: Workspace) -> Workspace:
        return Workspace(self.fixed_bytes + other.fixed_bytes,
                         self.per_context_token_bytes + other.per_context_token_bytes)


def workspace(shape: ModelShape, tensors: list[RankTensor], *, tp: int, batch: int, chunk: int,
              logits_tokens: int, act_dtype: torch.dtype, gathers_logits: bool) -> Workspace:
    a = act_dtype.itemsize
    n = batch * chunk
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
    rows = batch * logits_tokens
    fixed += rows * -(-vocab // tp) * FP32
    if gathers_logits and tp > 1:
        fixed += rows * vocab * FP32
    return Workspace(int(fixed), batch * chunk * (1 + a) + 2 * shape.head_dim * a)


def _nvfp4_scratch(tensors: list[RankTensor], rows: int) -> int:
    """The NVFP4 kernel's scratch for `rows` input rows: one dequantised tile of the weight
    (float32, `TILE_ELEMENTS`) and float32 copies of the input and output of the widest layer."""
    from hetero_run.kernels.nvfp4_linear import TILE_ELEMENTS

    widest = 0
    for t in tensors:
        if t.name.endswith(".codes"):  # [out, in / 2]
            widest = max(widest, t.shape[0] + 2 * t.shape[1])
    return 0 if widest == 0 else TILE_ELEMENTS * FP32 + rows * widest * FP32
