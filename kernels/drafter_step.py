"""A small decoder's decode step in one call (`csrc/drafter_step.cpp`), and its PyTorch reference.

A drafter such as SmolLM2-135M (30 layers of hidden 576) run as ~20 PyTorch operations per
layer spends about as long dispatching them as its weights take to stream. `DraftStep` runs
every layer of a llama / qwen2 / qwen3 decoder in one compiled call over a KV cache with
sequence slots, in one parallel region: each thread computes its share of every projection's
rows with the kernels of the registered linear ops (`torch.ops.hetero_run.nvfp4_linear` /
`dense_linear`, the same bits), and the threads meet at a barrier between phases instead of
forking and joining for each of a step's 121 products.

    step = DraftStep(weights, cos, sin, k_cache, v_cache)   # caches [slots, layers, kv_heads, max_tokens, d]
    logits = step.forward(ids, slots, index, positions)      # [n] each -> [n, vocab] float32

Row r embeds ids[r], writes its keys and values at `index[r]` of slot `slots[r]`, is rotated by
`positions[r]` and attends to indices 0 .. index[r] of its slot (only where mask[r] is True,
when a mask [n, >= max index + 1] is given: drafter trees). All rows write before any attends,
so the rows of one slot may form a chain or a tree within one call. Activations are float32,
the cache bf16 or float32. Each row is computed on its own, in an order that does not depend
on the other rows, so row r of a forward equals that row computed alone, bit for bit.

`step_reference` is the same computation in plain PyTorch (the linear products through the
same ops when the library is there); tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hetero_run.kernels import cpu_ext

CACHE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class Projection:
    """y = x @ W.T (+ bias), W dense [out, in] (bf16 / float32) or NVFP4 (codes, block scales, row scales)."""

    weight: torch.Tensor | None = None  # [out, in] bf16 / float32
    codes: torch.Tensor | None = None  # uint8 [out, in / 2]
    block_scale: torch.Tensor | None = None  # float8_e4m3fn [out, in / 16]
    row_scale: torch.Tensor | None = None  # float32 [out]
    bias: torch.Tensor | None = None  # float32 [out]
    bf16_x: bool = False  # a bf16 or NVFP4 weight multiplies x rounded to bf16 (the kernels' vdpbf16ps paths)
    int8_x: bool = False  # an NVFP4 weight multiplies x quantised to int8 (hetero_run::nvfp4_linear_i8)

    def __post_init__(self):
        if (self.weight is None) == (self.codes is None):
            raise ValueError("a projection is either dense (weight) or NVFP4 (codes, block_scale, row_scale)")
        if self.weight is not None:
            if self.weight.dim() != 2 or self.weight.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"a dense weight is 2-D bf16 or float32, got {self.weight.dtype} "
                                 f"{list(self.weight.shape)}")
            self.weight = self.weight.contiguous()
            self.bf16_x = self.bf16_x and self.weight.dtype == torch.bfloat16
            if self.int8_x:
                raise ValueError("int8 activations need NVFP4 weights")
        else:
            out, half = self.codes.shape
            if (self.codes.dtype != torch.uint8 or self.block_scale is None or self.row_scale is None
                    or self.block_scale.dtype != torch.float8_e4m3fn
                    or tuple(self.block_scale.shape) != (out, half // 8) or self.row_scale.shape != (out,)):
                raise ValueError("NVFP4 needs uint8 codes [out, in/2], float8_e4m3fn block_scale [out, in/16] and "
                                 "float32 row_scale [out]")
            self.codes, self.block_scale = self.codes.contiguous(), self.block_scale.contiguous()
            self.row_scale = self.row_scale.float().contiguous()
        if self.bf16_x and self.int8_x:
            raise ValueError("a projection takes bf16 or int8 activations, not both")
        if self.bias is not None:
            self.bias = self.bias.float().contiguous()
            if self.bias.shape != (self.out_features,):
                raise ValueError(f"bias must be [{self.out_features}], got {list(self.bias.shape)}")

    @property
    def nvfp4(self) -> bool:
        return self.codes is not None

    @property
    def out_features(self) -> int:
        return (self.weight if self.weight is not None else self.codes).shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] if self.weight is not None else self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        tensors = [self.weight] if self.weight is not None else [self.codes, self.block_scale, self.row_scale]
        return sum(t.nbytes for t in tensors) + (self.bias.nbytes if self.bias is not None else 0)

    def rows(self, rows: torch.Tensor) -> Projection:
        """The projection computing only output rows `rows` (exact: NVFP4 scales are per row)."""
        pick = (lambda t: None if t is None else t.index_select(0, rows).contiguous())  # noqa: E731
        if self.nvfp4:
            scales = self.block_scale.view(torch.uint8).index_select(0, rows).view(torch.float8_e4m3fn)
            return Projection(codes=pick(self.codes), block_scale=scales.contiguous(), row_scale=pick(self.row_scale),
                              bias=pick(self.bias), bf16_x=self.bf16_x, int8_x=self.int8_x)
        return Projection(weight=pick(self.weight), bias=pick(self.bias), bf16_x=self.bf16_x)


@dataclass
class StepLayer:
    input_norm: torch.Tensor  # float32 [hidden]
    qkv: Projection  # [(heads + 2 kv_heads) head_dim, hidden]: q heads, k heads, v heads
    o: Projection  # [hidden, heads head_dim]
    post_norm: torch.Tensor  # float32 [hidden]
    gate_up: Projection  # [2 intermediate, hidden]: gate rows, then up rows
    down: Projection  # [hidden, intermediate]
    qk_norm: torch.Tensor | None = None  # float32 [heads + kv_heads, head_dim] (qwen3 family)

    @property
    def nbytes(self) -> int:
        norms = self.input_norm.nbytes + self.post_norm.nbytes + (0 if self.qk_norm is None else self.qk_norm.nbytes)
        return norms + sum(p.nbytes for p in (self.qkv, self.o, self.gate_up, self.down))


@dataclass
class StepWeights:
    """Everything a decode step reads, in the layout the compiled step takes."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    embed: torch.Tensor  # [vocab, hidden] bf16 / float32
    layers: list[StepLayer]
    norm: torch.Tensor  # float32 [hidden]
    head: Projection  # [vocab, hidden]
    extra: dict = field(default_factory=dict)  # free for the caller (e.g. where the weights came from)

    @property
    def hidden(self) -> int:
        return self.embed.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.head.out_features

    def decode_nbytes(self) -> int:
        """Weight bytes one decoded token reads: every layer, the final norm, the head, one embedding row."""
        row = self.embed.shape[1] * self.embed.element_size()
        return sum(layer.nbytes for layer in self.layers) + self.norm.nbytes + self.head.nbytes + row


def rotary_tables(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [max_positions, head_dim] for rotate-half rotary embeddings, the sign of
    rotate_half folded into sin: x * cos + x.roll(head_dim / 2) * sin rotates x."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.numel()
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return emb.cos().contiguous(), (emb.sin() * sign).contiguous()


def compiled_available() -> bool:
    if cpu_ext.ops() is None:
        return False
    try:  # a missing class raises RuntimeError, not AttributeError
        torch.classes.hetero_run.DraftStep  # noqa: B018
    except RuntimeError:
        return False
    return True


class DraftStep:
    """The decode step over caches [slots, layers, kv_heads, max_tokens, head_dim]: compiled when the
    kernel library is there (`compiled=None`), else (or with `compiled=False`) `step_reference`."""

    def __init__(self, weights: StepWeights, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, compiled: bool | None = None):
        layers, kv_heads, d = len(weights.layers), weights.kv_heads, weights.head_dim
        if k_cache.dim() != 5 or tuple(k_cache.shape[1:3]) != (layers, kv_heads) or k_cache.shape[4] != d:
            raise ValueError(f"k_cache must be [slots, {layers}, {kv_heads}, max_tokens, {d}], "
                             f"got {list(k_cache.shape)}")
        if k_cache.dtype not in CACHE_DTYPES or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError("k_cache and v_cache must have one shape and one dtype, bf16 or float32")
        self.weights, self.cos, self.sin = weights, cos.float().contiguous(), sin.float().contiguous()
        self.k_cache, self.v_cache = k_cache, v_cache
        self.heads: dict[int, Projection] = {0: weights.head}
        if compiled and not compiled_available():
            raise RuntimeError("the compiled drafter step is not available (kernels/cpu_ext.py could not load it)")
        self.compiled = compiled_available() if compiled is None else compiled
        self._step = self._build() if self.compiled else None

    def _build(self):
        w = self.weights
        step = torch.classes.hetero_run.DraftStep(len(w.layers), w.hidden, w.heads, w.kv_heads, w.head_dim, w.eps,
                                                  w.embed, w.norm.float(), self.cos, self.sin, self.k_cache,
                                                  self.v_cache)
        for i, layer in enumerate(w.layers):
            step.set_norms(i, layer.input_norm.float(), layer.post_norm.float(),
                           None if layer.qk_norm is None else layer.qk_norm.float())
            for which, proj in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
                _set_proj(step, i, which, proj)
        _set_proj(step, -1, 0, w.head)
        return step

    def kernel_choices(self) -> tuple[str, ...]:
        """The kernels the compiled step can give its projections here: "amx" (AMX tiles, what the
        registered ops take on this CPU) and "vector" (the same kernels without AMX) where the CPU
        kernels may use AMX and some projection multiplies bf16 activations; else just the one
        it has. Either computes every row alone in a fixed order; they differ from each other."""
        if self._step is None:
            return ("reference",)
        bf16 = any(p.bf16_x for layer in self.weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        if bf16 and cpu_ext.features() & cpu_ext.FEATURE_AMX:
            return ("amx", "vector")
        return ("vector",)

    @property
    def kernels(self) -> tuple[str, str, int]:
        """(kernels of a forward of few rows, of many rows, the row count from which it is many):
        see use_kernels."""
        choices = self.kernel_choices()
        if len(choices) == 1:
            return choices[0], choices[0], 1
        few, many, many_from = self._step.paths()
        return ("vector" if few else "amx"), ("vector" if many else "amx"), int(many_from)

    def use_kernels(self, few: str, many: str | None = None, many_from: int = 1) -> None:
        """From the next forward on, give the projections of a forward of fewer than `many_from`
        rows `few`'s kernels and of a wider one `many`'s (default: `few`'s), each one of
        kernel_choices(). A one-row drafting step and a prompt read may so take different kernels;
        every row of one forward takes the same, so a row keeps the bits it has alone among
        forwards on the same side of `many_from`."""
        choices = self.kernel_choices()
        many = few if many is None else many
        for name in (few, many):
            if name not in choices:
                raise ValueError(f"kernels {name!r} are not available here; choose from {', '.join(choices)}")
        if many_from < 1:
            raise ValueError(f"many_from must be >= 1, got {many_from}")
        if len(choices) > 1:
            self._step.set_paths(int(few == "vector"), int(many == "vector"), many_from)

    def set_head(self, number: int, head: Projection | None) -> None:
        """Head `number` (> 0) computes `head` (e.g. the rows TLI drafts over); None drops it."""
        if number <= 0:
            raise ValueError(f"head 0 is the model's own; extra heads are numbered from 1, got {number}")
        if head is None:
            self.heads.pop(number, None)
            if self._step is not None:
                self._step.drop_head(number)
            return
        if head.in_features != self.weights.hidden:
            raise ValueError(f"a head takes {self.weights.hidden} inputs, got {head.in_features}")
        self.heads[number] = head
        if self._step is not None:
            _set_proj(self._step, -1, number, head)

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, head: int = 0, last: bool = False) -> torch.Tensor:
        """[n] int64 each (+ mask [n, W] bool) -> logits [n, head rows] float32 (module doc), or
        [1, head rows] of the last row alone when `last` (the head runs on that row only)."""
        if self._step is not None:
            return self._step.forward(ids, slots, index, positions, mask, head, last)
        logits = step_reference(self.weights, self.cos, self.sin, self.k_cache, self.v_cache, ids, slots, index,
                                positions, mask, self.heads[head])
        return logits[-1:] if last else logits


def _set_proj(step, layer: int, which: int, p: Projection) -> None:
    scales = None if p.block_scale is None else p.block_scale.view(torch.uint8)
    step.set_proj(layer, which, p.weight, p.codes, scales, p.row_scale, p.bias, p.bf16_x, p.int8_x)


# ---------------------------------------------------------------- the reference


def project(x: torch.Tensor, p: Projection) -> torch.Tensor:
    """x float32 [n, in] -> float32 [n, out] as the compiled step computes it: the registered op
    when the library is there, else plain PyTorch one row at a time."""
    lib = cpu_ext.ops()
    if p.int8_x:
        from hetero_run.kernels.nvfp4_linear import nvfp4_linear_i8

        y = nvfp4_linear_i8(x.contiguous(), p.codes, p.block_scale, p.row_scale)
    elif lib is not None:
        if p.nvfp4:
            xs = (x.bfloat16() if p.bf16_x else x).contiguous()
            y = lib.nvfp4_linear(xs, p.codes, p.block_scale.view(torch.uint8), p.row_scale)
        else:
            y = lib.dense_linear((x.bfloat16() if p.bf16_x else x).contiguous(), p.weight)
    else:
        from hetero_run.kernels.nvfp4 import dequantize

        w = dequantize(p.codes, p.block_scale, p.row_scale) if p.nvfp4 else p.weight.float()
        xs = x.bfloat16().float() if p.bf16_x else x
        y = torch.cat([F.linear(xs[i:i + 1], w) for i in range(x.shape[0])])
    y = y.float()
    return y + p.bias if p.bias is not None else y


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def step_reference(weights: StepWeights, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor, index: torch.Tensor,
                   positions: torch.Tensor, mask: torch.Tensor | None = None,
                   head: Projection | None = None) -> torch.Tensor:
    """`DraftStep.forward` in plain PyTorch; writes the same caches."""
    w = weights
    heads, kv_heads, d = w.heads, w.kv_heads, w.head_dim
    group, n = heads // kv_heads, ids.numel()
    scale = d ** -0.5
    rows = list(zip(slots.tolist(), index.tolist(), strict=True))
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # [n, 1, d]
    h = w.embed[ids].float()  # [n, hidden]
    for layer_no, layer in enumerate(w.layers):
        qkv = project(_rms(h, layer.input_norm, w.eps), layer.qkv)
        qk = qkv[:, :(heads + kv_heads) * d].reshape(n, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)
        if layer.qk_norm is not None:
            qk = _rms(qk, layer.qk_norm, w.eps)
        qk = qk * c + qk.roll(d // 2, dims=-1) * s
        q, k = qk[:, :heads] * scale, qk[:, heads:]
        for r, (slot, at) in enumerate(rows):
            k_cache[slot, layer_no, :, at] = k[r].to(k_cache.dtype)
            v_cache[slot, layer_no, :, at] = v[r].to(v_cache.dtype)
        out = torch.empty(n, heads, d)
        for r, (slot, at) in enumerate(rows):
            keys = k_cache[slot, layer_no, :, :at + 1].float()  # [kv_heads, keys, d]
            values = v_cache[slot, layer_no, :, :at + 1].float()
            scores = torch.einsum("gjd,gkd->gjk", q[r].view(kv_heads, group, d), keys)  # [kv_heads, group, keys]
            if mask is not None:
                scores = scores.masked_fill(~mask[r, :at + 1], float("-inf"))
            out[r] = torch.einsum("gjk,gkd->gjd", scores.softmax(-1), values).reshape(heads, d)
        h = h + project(out.reshape(n, heads * d), layer.o)
        gate, up = project(_rms(h, layer.post_norm, w.eps), layer.gate_up).chunk(2, dim=-1)
        h = h + project(F.silu(gate) * up, layer.down)
    return project(_rms(h, w.norm, w.eps), head if head is not None else w.head)
