"""NVFP4 as NVIDIA ModelOpt writes it: E2M1 codes, FP8 E4M3 block scales, a float32 global scale.

Plain-PyTorch reference, bit-exact with ModelOpt's `NVFP4QTensor` (quantize, dequantize) and
with the tensors `export_hf_checkpoint` writes. The fast kernels (`nvfp4_linear.py`,
`csrc/cpu_linear.cpp`, `nvfp4_gpu.py`) are tested against these functions.

A weight [out, in] becomes
  codes        uint8          [out, in / 2]   element 2i in the LOW nibble, 2i + 1 in the high one
  block_scale  float8_e4m3fn  [out, in / 16]  one scale per 16 consecutive inputs of a row
  global_scale float32        []              amax / (6 * 448), stored as `weight_scale_2`
and element [r, c] is `E2M1[code] * (float(block_scale[r, c // 16]) * global_scale)`.
Worked example: codes byte 0x2F holds element 0 = code 0xF (-6.0) and element 1 = code 0x2 (1.0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between magnitudes. A value exactly on a midpoint rounds to the even code: the
# searchsorted below sends it down, and the midpoints next to an odd code (0.75, 1.75, 3.5)
# get one step up (0.75 -> code 2 = 1.0, not code 1 = 0.5).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_BOUNDS = (0.75, 1.75, 3.5)
# Smallest block scale ModelOpt stores (the smallest FP8 E4M3 subnormal); smaller ones clamp up.
_MIN_BLOCK_SCALE = 2.0**-9


class NVFP4Tensors(NamedTuple):
    codes: torch.Tensor  # uint8 [..., in / 2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., in / 16]
    global_scale: torch.Tensor  # float32 []


def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., 2k] -> packed bytes [..., k], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | (codes[..., 0::2] & 0x0F)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., k] -> uint8 codes [..., 2k]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 codes [...]: round to nearest (ties to even), saturating at +-6.

    -0.0 encodes as +0 (code 0), as ModelOpt does (the sign comes from `x < 0`).
    """
    sign = (x < 0).to(torch.uint8)
    magnitude = x.abs()
    bounds = _table(_E2M1_BOUNDS, x.device).to(magnitude.dtype)
    code = torch.searchsorted(bounds, magnitude, out_int32=True).to(torch.uint8)
    round_up = torch.zeros_like(code)
    for bound in _ROUND_UP_BOUNDS:
        round_up |= (magnitude == bound).to(torch.uint8)
    return (sign << 3) + code + round_up


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [...] -> float32 values [...]."""
    return _table(E2M1_VALUES, codes.device)[codes.long()]


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale `weight_scale_2` = amax / (6 * 448), float32 []."""
    amax = torch.maximum(w.max().abs(), w.min().abs())
    return amax.float() / (E2M1_MAX * E4M3_MAX)


def block_scales(w: torch.Tensor, gscale: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """[..., in] -> float8_e4m3fn [..., in / group_size]: block amax / (6 * global scale).

    All-zero blocks get scale 1.0; the rest clamp into [2^-9, 448] before the cast, so a block
    much smaller than the tensor's amax keeps the smallest FP8 subnormal instead of 0.
    """
    _check_groups(w, group_size)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    amax = blocks.abs().amax(dim=-1).float()
    scale = amax / (E2M1_MAX * gscale.to(amax.device))
    scale[scale == 0] = 1.0
    return scale.clamp(min=_MIN_BLOCK_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(
    w: torch.Tensor,
    group_size: int = GROUP_SIZE,
    global_scale_: torch.Tensor | float | None = None,
    block_scale: torch.Tensor | None = None,
) -> NVFP4Tensors:
    """float [..., in] -> NVFP4 codes, block scales and global scale, as ModelOpt computes them.

    `global_scale_` defaults to `global_scale(w)`; pass a checkpoint's `weight_scale_2` (for fused
    q/k/v or gate/up it is the group's largest) to reproduce that checkpoint's codes exactly.
    Activations quantise the same way with `global_scale_ = input_scale` (W4A4).
    """
    _check_groups(w, group_size)
    if global_scale_ is None:
        gscale = global_scale(w)
    else:
        gscale = torch.as_tensor(global_scale_, dtype=torch.float32, device=w.device)
    if block_scale is None:
        block_scale = block_scales(w, gscale, group_size)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scaled = blocks / (block_scale.to(torch.float32) * gscale).unsqueeze(-1)  # float32
    codes = e2m1_encode(scaled.reshape(w.shape))
    return NVFP4Tensors(pack_e2m1(codes), block_scale, gscale)


def dequantize(
    codes: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale_: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed codes [..., in / 2] -> [..., in] in `dtype`; `global_scale_` is a scalar or has one
    value per row ([...] without the last dimension), e.g. after fusing layers."""
    values = e2m1_decode(unpack_e2m1(codes))  # [..., in]
    gscale = torch.as_tensor(global_scale_, dtype=torch.float32, device=codes.device)
    if gscale.ndim:
        gscale = gscale.unsqueeze(-1)
    scale = block_scale.to(torch.float32) * gscale  # [..., in / group]
    group = values.shape[-1] // block_scale.shape[-1]
    blocks = values.reshape(*values.shape[:-1], block_scale.shape[-1], group) * scale.unsqueeze(-1)
    return blocks.reshape(values.shape).to(dtype)


def fake_quantize(x: torch.Tensor, global_scale_: torch.Tensor | float, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Quantise-dequantise activations [..., in] to the values an FP4 tensor core sees (W4A4)."""
    q = quantize(x.float(), group_size, global_scale_)
    return dequantize(q.codes, q.block_scale, q.global_scale, torch.float32)


def linear_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    block_scale: torch.Tensor,
    row_scale: torch.Tensor,
    tile_rows: int = 1024,
) -> torch.Tensor:
    """x [n, in] @ W.T -> float32 [n, out], dequantising `tile_rows` rows of W at a time so the
    whole weight never exists unpacked. `row_scale` float32 [out] is the global scale per row."""
    out_features = codes.shape[0]
    x32 = x.float()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for start in range(0, out_features, tile_rows):
        stop = min(start + tile_rows, out_features)
        tile = dequantize(codes[start:stop], block_scale[start:stop], row_scale[start:stop])  # [rows, in]
        y[:, start:stop] = x32 @ tile.T
    return y


def _check_groups(w: torch.Tensor, group_size: int) -> None:
    if group_size != GROUP_SIZE:
        raise ValueError(f"NVFP4 uses blocks of {GROUP_SIZE} elements, got group_size {group_size}")
    if w.shape[-1] % group_size:
        raise ValueError(f"the last dimension ({w.shape[-1]}) must be a multiple of {group_size}")
