"""The decoder stack shared by the four architectures, and `TargetModel`, its entry point.

    h = embed(ids)                                   # vocab-parallel, one all-reduce
    for each layer:
        h += attention(rms_norm(h))                  # one all-reduce
        h += mlp_or_moe(rms_norm(h))                 # one all-reduce
    logits = lm_head(rms_norm(h))                    # gathered on rank 0

The residual stream h is replicated on every rank; weights, KV heads and intermediate
activations are split.
"""

from __future__ import annotations

import torch

from hetero_run.kernels.batch_invariance import invariant
from hetero_run.kernels.decode_ops import rms_norm
from hetero_run.runtime.models.attention import Attention
from hetero_run.runtime.models.config import ModelConfig
from hetero_run.runtime.models.embedding import ParallelLMHead, VocabParallelEmbedding
from hetero_run.runtime.models.kv_cache import KVCache
from hetero_run.runtime.models.mlp import GatedMLP
from hetero_run.runtime.models.moe import SparseMoE
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.models.rotary import Rotary


class DecoderLayer:
    def __init__(self, input_norm: torch.Tensor, attention: Attention, post_norm: torch.Tensor,
                 mlp: GatedMLP | SparseMoE, eps: float):
        self.input_norm, self.post_norm = input_norm, post_norm  # [hidden]
        self.attention, self.mlp, self.eps = attention, mlp, eps
        self.shape = tuple(input_norm.shape)

    @property
    def nbytes(self) -> int:
        return self.input_norm.nbytes + self.post_norm.nbytes + self.attention.nbytes + self.mlp.nbytes

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden], updated in place
        h += self.attention(rms_norm(h, self.input_norm, self.eps), cos, sin, start, mask)
        h += self.mlp(rms_norm(h, self.post_norm, self.eps))
        return h


class TargetModel:
    """One rank's shard of a decoder-only model with its KV cache.

    `forward(input_ids, positions)` appends the n tokens to the cache and returns their logits
    [n, vocab] (float32) on rank 0 of the group, None on the others; every rank of the group
    must call it with the same arguments. `truncate(length)` rolls the cache back.
    """

    def __init__(self, config: ModelConfig, ctx: ParallelContext, embed: VocabParallelEmbedding,
                 layers: list[DecoderLayer], norm: torch.Tensor, lm_head: ParallelLMHead, kv: KVCache,
                 rotary: Rotary, dtype: torch.dtype, prefill_chunk: int = 512):
        self.config, self.ctx = config, ctx
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.kv, self.rotary, self.dtype = kv, rotary, dtype
        self.prefill_chunk = prefill_chunk
        self.device = ctx.device
        # EAGLE-3 style hook (set with `capture`): the residual stream at the input of these
        # layers for the tokens of the last forward, concatenated in layer order ->
        # `captured` [n, len(capture_layers) * hidden], on the ranks that called `capture`.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None
        self.capture_sink = None  # sink(first slot, captured) after each forward

    @property
    def length(self) -> int:
        """Tokens in the KV cache (the next token's slot)."""
        return self.kv.length

    @property
    def max_tokens(self) -> int:
        return self.kv.max_tokens

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

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)

    def capture(self, layers: tuple[int, ...], sink=None) -> None:
        """Keep the hidden states entering `layers` (ascending; len(self.layers) is the last
        layer's output, before the final norm) in `captured` after each forward, and hand them to
        `sink(first slot, captured)` when given. Only the ranks that call this keep anything."""
        layers = tuple(layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i <= len(self.layers) for i in layers):
            raise ValueError(f"capture layers must be ascending and in 0..{len(self.layers)}, got {layers}")
        self.capture_layers, self.captured, self.capture_sink = layers, None, sink

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                num_logits: int | None = None) -> torch.Tensor | None:
        """input_ids, positions: [n] int64 -> logits [num_logits or n, vocab] on rank 0.

        The tokens take cache slots length .. length + n - 1 and attend causally among
        themselves; positions set their rotary angles (normally the same numbers as the slots).
        `num_logits` keeps only the last few rows (1 for a prompt). Prompts longer than
        `prefill_chunk` run in chunks, bounding the activation memory.
        """
        n = input_ids.shape[0]
        if n == 0 or positions.shape != input_ids.shape:
            raise ValueError(f"need n >= 1 ids with one position each, got {tuple(input_ids.shape)} "
                             f"ids and {tuple(positions.shape)} positions")
        keep = n if num_logits is None else num_logits
        if not 1 <= keep <= n:
            raise ValueError(f"num_logits must be in 1..{n}, got {num_logits}")
        self.kv.check_room(n)
        input_ids = input_ids.to(self.device, non_blocking=True)
        positions = positions.to(self.device, non_blocking=True)
        kept, captured, first_slot = [], [], self.kv.length
        for begin in range(0, n, self.prefill_chunk):
            end = min(n, begin + self.prefill_chunk)
            h = self._run(input_ids[begin:end], positions[begin:end], captured)
            if end > n - keep:
                kept.append(h[max(0, n - keep - begin):])
        if self.capture_layers:
            self.captured = torch.cat(captured) if len(captured) > 1 else captured[0]
            if self.capture_sink is not None:
                self.capture_sink(first_slot, self.captured)
        h = kept[0] if len(kept) == 1 else torch.cat(kept)
        return self.lm_head(rms_norm(h, self.norm, self.config.rms_norm_eps))

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, captured: list) -> torch.Tensor:
        start, n = self.kv.length, ids.shape[0]
        h = self.embed(ids)  # [n, hidden]
        cos, sin = self.rotary.tables(positions)
        mask = None
        if not invariant(n):  # slot start + i attends to slots 0 .. start + i (small n: per row, no mask)
            slots = torch.arange(start + n, device=self.device)
            mask = slots[None, :] <= slots[start:, None]  # [n, start + n]
        if self.capture_layers:
            saved = []
            for i, layer in enumerate(self.layers):
                if i in self.capture_layers:
                    saved.append(h.clone())
                h = layer(h, cos, sin, start, mask)
            if len(self.layers) in self.capture_layers:
                saved.append(h.clone())
            captured.append(torch.cat(saved, dim=-1))
        else:
            for layer in self.layers:
                h = layer(h, cos, sin, start, mask)
        self.kv.length = start + n
        return h
