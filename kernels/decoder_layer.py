"""A target decoder layer in one compiled call on the CPU (`csrc/decoder_layer.cpp`).

runtime/models/decoder.py runs a layer as about 15 PyTorch operations (norms, the four linear
products, their biases, rotary and the cache writes, attention, silu * up, the residual adds);
between the kernels, Python and PyTorch's dispatch cost about 1 ms of an 8 ms one-row step of the
real CPU target (24 layers; Zen 5), a tenth of it. `TargetLayer` calls the same kernels in the
same order on the same tensors, so it gives the same bits, in one call per layer (two where the
layer's products are all-reduced between ranks).

    layer = target_layer(heads, kv_heads, head_dim, eps, input_norm, post_norm, qk_norm, k_cache,
                         v_cache, products)   # products: qkv, o, gate_up, down as `Product`s
    h = layer.forward(h, cos, sin, write_slots, key_slots, key_offsets)   # one rank
    y = layer.attention(h, ...) / layer.mlp(h)   # the row-parallel products, before all-reduce and bias

Only for bf16 activations and caches, with dense bf16 or NVFP4 (weight-only) products, and only
where the compiled library is loaded; `HETERO_RUN_FUSED_LAYERS=0` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hetero_run.kernels import cpu_ext

_WHICH = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Product:
    """A linear product as the kernels take it: dense bf16 `weight` [out, in], or NVFP4 `codes`
    uint8 [out, in/2], `block_scale` float8_e4m3fn [out, in/16], `row_scale` float32 [out]; and
    its `bias` (added after the product, by the layer for qkv and gate_up, by the caller for the
    row-parallel o and down except in `forward`)."""

    weight: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def enabled() -> bool:
    """Whether fused layers may be used here: the library is loaded and not turned off."""
    if os.environ.get("HETERO_RUN_FUSED_LAYERS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return cpu_ext.ops() is not None


def target_layer(heads: int, kv_heads: int, head_dim: int, eps: float, input_norm: torch.Tensor,
                 post_norm: torch.Tensor, qk_norm: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 products: dict[str, Product], qk_eps: float | None = None):
    """The compiled layer (a `torch.classes.hetero_run.TargetLayer`); the tensors are shared, not copied."""
    layer = torch.classes.hetero_run.TargetLayer(heads, kv_heads, head_dim, eps, eps if qk_eps is None else qk_eps,
                                                 head_dim ** -0.5, input_norm, post_norm, qk_norm, k_cache, v_cache)
    for which, name in enumerate(_WHICH):
        p = products[name]
        scales = None if p.block_scale is None else p.block_scale.view(torch.uint8)
        layer.set_product(which, p.weight, p.codes, scales, p.row_scale, p.bias)
    return layer
