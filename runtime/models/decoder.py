"""The decoder stack shared by the four architectures, and `TargetModel`, its entry point.

    h = embed(ids)                                   # vocab-parallel, one all-reduce
    for each layer:
        h += attention(rms_norm(h))                  # one all-reduce
        h += mlp_or_moe(rms_norm(h))                 # one all-reduce
    logits = lm_head(rms_norm(h))                    # gathered on rank 0

The residual stream h is replicated on every rank; weights, KV heads and intermediate
activations are split. One forward runs the rows of a `ForwardBatch` (any mix of sequences,
decode / verify / tree / prefill rows); `forward` / `truncate` / `keep` drive the cache as one
sequence (`one_sequence.OneSequence`).
"""

from __future__ import annotations

import torch

from hetero_run.kernels import decoder_layer
from hetero_run.kernels.decode_ops import rms_norm
from hetero_run.runtime.models.attention import Attention, AttentionRows
from hetero_run.runtime.models.batch import ForwardBatch
from hetero_run.runtime.models.config import ModelConfig
from hetero_run.runtime.models.embedding import ParallelLMHead, VocabParallelEmbedding
from hetero_run.runtime.models.kv_cache import KVCache
from hetero_run.runtime.models.mlp import GatedMLP
from hetero_run.runtime.models.moe import SparseMoE
from hetero_run.runtime.models.one_sequence import OneSequence
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.models.rotary import Rotary
from hetero_run.runtime.weights import DenseWeight, NVFP4Weight


class DecoderLayer:
    def __init__(self, input_norm: torch.Tensor, attention: Attention, post_norm: torch.Tensor,
                 mlp: GatedMLP | SparseMoE, eps: float):
        self.input_norm, self.post_norm = input_norm, post_norm  # [hidden]
        self.attention, self.mlp, self.eps = attention, mlp, eps
        self.shape = tuple(input_norm.shape)
        self.fused = None  # the same layer as one compiled call (`fuse`), where it applies
        self.one_rank = True

    @property
    def nbytes(self) -> int:
        return self.input_norm.nbytes + self.post_norm.nbytes + self.attention.nbytes + self.mlp.nbytes

    def fuse(self, ctx: ParallelContext) -> bool:
        """Run this layer as one compiled call per forward (kernels/decoder_layer.py: the same
        kernels in the same order, the same bits; two calls around the all-reduces at TP > 1)
        where it applies: bf16 on the CPU with the compiled library, a gated MLP (not experts),
        dense bf16 or NVFP4 weight-only products, a cache whose slots are contiguous rows."""
        products = _fusable_products(self)
        if products is None or ctx.device.type != "cpu" or not decoder_layer.enabled():
            return False
        a = self.attention
        self.fused = decoder_layer.target_layer(a.heads, a.kv_heads, a.head_dim, self.eps, self.input_norm,
                                                self.post_norm, a.qk_norm, a.k_cache, a.v_cache, products, a.eps)
        self.one_rank = ctx.size == 1
        return True

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rows: AttentionRows) -> torch.Tensor:  # [n, hidden], updated in place
        if self.fused is not None:
            if self.one_rank:
                return self.fused.forward(h, cos, sin, rows.write_slots, rows.key_slots, rows.key_offsets)
            h += self.attention.o.reduce(self.fused.attention(h, cos, sin, rows.write_slots, rows.key_slots,
                                                              rows.key_offsets))
            h += self.mlp.down.reduce(self.fused.mlp(h))
            return h
        h += self.attention(rms_norm(h, self.input_norm, self.eps), cos, sin, rows)
        h += self.mlp(rms_norm(h, self.post_norm, self.eps))
        return h


def _fusable_products(layer: DecoderLayer) -> dict[str, decoder_layer.Product] | None:
    """The layer's four products as the fused layer takes them, or None where it does not apply."""
    a = layer.attention
    if (not isinstance(layer.mlp, GatedMLP) or layer.input_norm.dtype != torch.bfloat16
            or layer.post_norm.dtype != torch.bfloat16 or a.k_cache.dtype != torch.bfloat16
            or (a.qk_norm is not None and a.qk_norm.dtype != torch.bfloat16)
            or any(c.stride(2) != 1 or c.stride(1) != a.head_dim for c in (a.k_cache, a.v_cache))):
        return None
    products = {}
    for name, linear in (("qkv", a.qkv), ("o", a.o), ("gate_up", layer.mlp.gate_up), ("down", layer.mlp.down)):
        w = linear.weight
        if isinstance(w, DenseWeight) and w.weight.dtype == torch.bfloat16:
            products[name] = decoder_layer.Product(weight=w.weight, bias=linear.bias)
        elif isinstance(w, NVFP4Weight) and w.activation != "w4a4":
            products[name] = decoder_layer.Product(codes=w.codes, block_scale=w.block_scale, row_scale=w.row_scale,
                                                   bias=linear.bias)
        else:
            return None
    return products


class TargetModel:
    """One rank's shard of a decoder-only model with its KV cache.

    `forward_batch(batch)` runs the rows of a ForwardBatch and returns the logits of its
    `logits_rows` [L, vocab] (float32) on rank 0 of the group, None on the others; every rank of
    the group must call it with the same batch. `forward(input_ids, positions)` / `truncate` /
    `keep` use the whole cache as one sequence (`self.sequence`).
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, embed: VocabParallelEmbedding,
                 layers: list[DecoderLayer], norm: torch.Tensor, lm_head: ParallelLMHead, kv: KVCache,
                 rotary: Rotary, dtype: torch.dtype, prefill_chunk: int = 512, context: int | None = None):
        self.config, self.ctx = config, ctx
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.kv, self.rotary, self.dtype = kv, rotary, dtype
        self.device = ctx.device
        self.context = min(context or kv.max_tokens, kv.max_tokens, rotary.max_positions)  # tokens per sequence
        self.sequence = OneSequence(self.forward_batch, self.context, kv.block_size, prefill_chunk)
        self.fused_layers = sum(layer.fuse(ctx) for layer in layers)  # run as one compiled call each
        # EAGLE-3 style hook (set with `capture`): the residual stream at the input of these
        # layers for the rows of the last forward, concatenated in layer order ->
        # `captured` [n, len(capture_layers) * hidden], on the ranks that called `capture`.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self.capture_sink = None  # sink(batch, captured) after each forward

    @property
    def length(self) -> int:
        """Tokens in the one-sequence cache (the next token's position)."""
        return self.sequence.length

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence may hold."""
        return self.context

    @property
    def prefill_chunk(self) -> int:
        return self.sequence.prefill_chunk

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights this rank holds."""
        return (self.embed.nbytes + sum(layer.nbytes for layer in self.layers) + self.norm.nbytes
                + (0 if self.lm_head.tied else self.lm_head.nbytes))

    def decode_nbytes(self) -> int:
        """Weight bytes this rank reads per decoded token (the batch-1 roofline's numerator):
        every layer but only top_k of the experts, the head, one embedding row."""
        total = self.lm_head.nbytes + self.norm.nbytes
        for layer in self.layers:
            total += layer.nbytes
            if isinstance(layer.mlp, SparseMoE):
                moe = layer.mlp
                total -= moe.nbytes - moe.router.nbytes
                total += (moe.nbytes - moe.router.nbytes) * moe.top_k // len(moe.experts)
        return total

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_logits: int | None = None,
                parents: list[int] | None = None) -> torch.Tensor | None:
        """The one-sequence forward (see `OneSequence.forward`): ids, positions [n] -> logits
        [num_logits or n, vocab] on rank 0. Every rank must call it with the same arguments.
        With `capture`, `captured` then holds the states of all n tokens (every prefill chunk)."""
        if not self.capture_layers:
            return self.sequence.forward(input_ids, positions, num_logits, parents)
        chunks = []
        run = self.sequence.run

        def keep_captured(batch: ForwardBatch) -> torch.Tensor | None:
            out = run(batch)
            chunks.append(self.captured)
            return out

        self.sequence.run = keep_captured
        try:
            return self.sequence.forward(input_ids, positions, num_logits, parents)
        finally:
            self.sequence.run = run
            self.captured = chunks[0] if len(chunks) == 1 else torch.cat(chunks) if chunks else None

    def truncate(self, length: int) -> None:
        self.sequence.truncate(length)

    def keep(self, rows: list[int]) -> None:
        self.sequence.keep(rows)

    def capture(self, layers: tuple[int, ...], sink=None) -> None:
        """Keep the hidden states entering `layers` (ascending; len(self.layers) is the last
        layer's output, before the final norm) in `captured` after each forward, and hand them to
        `sink(batch, captured)` when given (row i of captured is row i of the ForwardBatch). Only
        the ranks that call this keep anything."""
        layers = tuple(layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"capture layers must be ascending and in 0..{len(self.layers)}, got {layers}")
        self.capture_layers, self.captured, self.capture_sink = layers, None, sink

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The rows of `batch` -> logits [len(batch.logits_rows), vocab] on rank 0 (None when it
        asks for none, and on the other ranks)."""
        device = self.device
        if batch.copies is not None:
            self.kv.copy_slots(batch.copies)
        key_slots, key_offsets = batch.key_lists()
        rows = AttentionRows(batch.write_slots().to(device), key_slots.to(device), key_offsets)
        h = self.embed(batch.ids.to(device, non_blocking=True))  # [n, hidden]
        cos, sin = self.rotary.tables(batch.positions.to(device, non_blocking=True))
        if self.capture_layers:
            saved = []
            for i, layer in enumerate(self.layers):
                if i in self.capture_layers:
                    saved.append(h.clone())
                h = layer(h, cos, sin, rows)
            if len(self.layers) in self.capture_layers:
                saved.append(h.clone())
            self.captured = torch.cat(saved, dim=-1)
            if self.capture_sink is not None:
                self.capture_sink(batch, self.captured)
        else:
            for layer in self.layers:
                h = layer(h, cos, sin, rows)
        if batch.logits_rows.numel() == 0:
            return None
        h = h[batch.logits_rows.to(device)]
        return self.lm_head(rms_norm(h, self.norm, self.config.rms_norm_eps))
