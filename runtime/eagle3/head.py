"""The EAGLE-3 head: one Llama decoder layer over [embedding; fused target features], on rank 0.

One draft step for the token at position t + 1 (paired with features of position t):

    g = fc(concat(low, mid, high))          # [n, H] fused target states (or the head's own last h)
    x = concat(input_layernorm(embed(token)), hidden_norm(g))          # [n, 2H]
    h = g + o(attention(rope(q(x)), rope(k(x)), v(x)))   # over the head's own KV cache
    h = h + down(silu(gate(post_norm(h))) * up(post_norm(h)))
    logits = lm_head(norm(h))                # [n, draft_vocab]; draft id d is target id d + d2t[d]

`h` (before `norm`) is what a later step feeds back in place of g. Plain PyTorch, weights in
the target's dtype; the KV cache is the runtime's static one (rollback = truncate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.runtime.eagle3.config import Eagle3Config
from hetero_run.runtime.models.kv_cache import KVCache
from hetero_run.runtime.models.rotary import Rotary


class Embedding:
    """Target-vocabulary embedding rows on rank 0: the target's own shard (all of it at TP=1)
    and, at TP > 1, the rows other ranks hold, read once from the target checkpoint."""

    def __init__(self, local: torch.Tensor, rest: torch.Tensor | None = None):
        self.local = local  # [rows held by rank 0, hidden] (shared with the target)
        self.rest = rest  # [vocab - rows, hidden] or None
        self.rows = local.shape[0]

    @property
    def extra_nbytes(self) -> int:
        """Bytes this adds to what the target already holds."""
        return 0 if self.rest is None else self.rest.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.rest is None:
            return F.embedding(ids, self.local)
        outside = ids >= self.rows
        out = F.embedding(ids.clamp(max=self.rows - 1), self.local)
        if bool(outside.any()):
            out[outside] = F.embedding(ids[outside] - self.rows, self.rest)
        return out


class Eagle3Head:
    def __init__(self, config: Eagle3Config, weights: dict[str, torch.Tensor], embed: Embedding, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        c = config
        self.config, self.embed, self.dtype = c, embed, dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        self.fc = w("fc.weight")  # [H, 3 * H_target]
        self.qkv = torch.cat([w("layer.self_attn.q_proj.weight"), w("layer.self_attn.k_proj.weight"),
                              w("layer.self_attn.v_proj.weight")])  # [(heads + 2 * kv_heads) * head_dim, 2H]
        self.o = w("layer.self_attn.o_proj.weight")  # [H, heads * head_dim]
        self.gate_up = torch.cat([w("layer.mlp.gate_proj.weight"), w("layer.mlp.up_proj.weight")])  # [2I, H]
        self.down = w("layer.mlp.down_proj.weight")  # [H, I]
        self.input_norm = w("layer.input_layernorm.weight")  # [H]
        self.hidden_norm = w("layer.hidden_norm.weight")  # [H]
        self.post_norm = w("layer.post_attention_layernorm.weight")  # [H]
        self.norm = w("norm.weight")  # [H]
        self.lm_head = w("lm_head.weight")  # [draft_vocab, H]
        self.kv = KVCache(1, c.num_kv_heads, c.head_dim, max_tokens, dtype, self.device)
        self.rotary = Rotary(c.rope, c.head_dim, max_tokens, dtype, self.device)
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.scale = c.head_dim ** -0.5

    @property
    def nbytes(self) -> int:
        tensors = (self.fc, self.qkv, self.o, self.gate_up, self.down, self.input_norm, self.hidden_norm,
                   self.post_norm, self.norm, self.lm_head)
        return sum(t.nbytes for t in tensors) + self.embed.extra_nbytes

    @property
    def length(self) -> int:
        return self.kv.length

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Captured target states [n, 3 * H_target] -> g [n, H]."""
        return F.linear(features.to(self.dtype), self.fc)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Tokens [n] with their features g [n, H] at the next n cache slots -> h [n, H] (pre-norm)."""
        c, n = self.config, ids.shape[0]
        eps = c.rms_norm_eps
        start = self.kv.length
        self.kv.check_room(n)
        g = g.to(device=self.device, dtype=self.dtype)
        normed_g = F.rms_norm(g, (c.hidden_size,), self.hidden_norm, eps)
        residual = normed_g if c.norm_before_residual else g
        e = F.rms_norm(self.embed(ids.to(self.device)).to(self.dtype), (c.hidden_size,), self.input_norm, eps)
        qkv = F.linear(torch.cat([e, normed_g], dim=-1), self.qkv)  # [n, q + 2 kv]
        q = qkv[:, :self.q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, c.num_kv_heads, c.head_dim)
        cos, sin = self.rotary.tables(torch.arange(start, start + n, device=self.device))
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        end = start + n
        self.kv.k[0, :, start:end] = k.transpose(0, 1)
        self.kv.v[0, :, start:end] = v.transpose(0, 1)
        mask = None
        if n > 1:
            slots = torch.arange(end, device=self.device)
            mask = slots[None, :] <= slots[start:, None]  # [n, end]
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], self.kv.k[0, None, :, :end], self.kv.v[0, None, :, :end], attn_mask=mask,
            scale=self.scale, enable_gqa=c.num_heads != c.num_kv_heads)  # [1, heads, n, head_dim]
        h = residual + F.linear(att[0].transpose(0, 1).reshape(n, self.q_size), self.o)
        gate, up = F.linear(F.rms_norm(h, (c.hidden_size,), self.post_norm, eps), self.gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.down)
        self.kv.length = end
        return h

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, H] -> draft-vocabulary logits [n, draft_vocab] (float32)."""
        return F.linear(F.rms_norm(h, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps),
                        self.lm_head).float()
