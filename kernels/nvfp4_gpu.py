"""NVFP4 linear layers on CUDA devices.

Blackwell (sm_100, sm_12x; GB10 in DGX Spark is sm_121) multiplies FP4 by FP4 in its tensor cores
(W4A4): activations are quantised to NVFP4 with the checkpoint's `input_scale`, then
`torch._scaled_mm` takes both operands with their FP8 block scales in cuBLAS's swizzled layout
and the two global scales are applied to the float result. Other GPUs dequantise the weight
tile by tile and multiply in the activations' dtype (weight-only, W4A16).
The CPU reference for both is in `nvfp4.py` (W4A4 there is `fake_quantize` then W4A16).
"""

from __future__ import annotations

import logging

import torch

from hetero_run.kernels import nvfp4

log = logging.getLogger("hetero_run.kernels.nvfp4_gpu")
# Elements of W dequantised at once on the weight-only path.
TILE_ELEMENTS = 1 << 24
_warned: set[str] = set()


def fp4_tensor_cores(device: torch.device | str) -> bool:
    """Whether `device` multiplies NVFP4 operands natively (and this torch exposes it)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "float4_e2m1fn_x2"):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major in (10, 12)


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """float8 block scales [rows, k] -> cuBLAS's 1-D block-scaling layout.

    The matrix is zero-padded to multiples of 128 rows and 4 columns and cut into 128 x 4 tiles,
    stored tile after tile (row tiles outer). Inside a tile, scale (r, c) goes to byte
    (r % 32) * 16 + (r // 32) * 4 + c; e.g. rows 0, 32, 64, 96 of column 0 land on bytes 0, 4, 8, 12.
    """
    rows, cols = scale.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(row_tiles * 128, col_tiles * 4, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = scale.view(torch.uint8)
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4)  # [row tile, r // 32, r % 32, col tile, c]
    swizzled = tiles.permute(0, 3, 2, 1, 4).contiguous()  # [row tile, col tile, r % 32, r // 32, c]
    return swizzled.flatten().view(torch.float8_e4m3fn)


def linear_weight_only(x: torch.Tensor, codes: torch.Tensor, block_scale: torch.Tensor,
                       row_scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ W.T -> [n, out] in x's dtype, W dequantised a tile of rows at a time."""
    out_features, in_features = codes.shape[0], codes.shape[1] * 2
    tile_rows = max(1, TILE_ELEMENTS // in_features)
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, tile_rows):
        stop = min(start + tile_rows, out_features)
        tile = nvfp4.dequantize(codes[start:stop], block_scale[start:stop], row_scale[start:stop], x.dtype)
        y[:, start:stop] = x @ tile.T
    return y


def linear_w4a4(x: torch.Tensor, codes: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor,
                input_scale: float, cache: dict | None = None) -> torch.Tensor:
    """x [n, in] @ W.T with x quantised to NVFP4 using `input_scale`: [n, out] in x's dtype.

    Uses the FP4 tensor cores when the device has them, else the same arithmetic emulated.
    `cache` (a dict owned by the weight) keeps the weight's swizzled scales between calls.
    """
    if fp4_tensor_cores(x.device):
        try:
            return _scaled_mm_fp4(x, codes, block_scale, row_scale, input_scale, cache)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            # an unsupported shape or torch build: the same arithmetic, emulated
            _warn_once(f"FP4 tensor-core GEMM failed ({exc}); emulating W4A4")
    # as on the CPU: the quantised activations (FP4 x E4M3 x the float32 global scale are not all
    # bf16 values) meet the weights in float32, and only y is rounded to x's dtype
    return linear_weight_only(nvfp4.fake_quantize(x, input_scale), codes, block_scale, row_scale).to(x.dtype)


def _scaled_mm_fp4(x, codes, block_scale, row_scale, input_scale, cache):
    n = x.shape[0]
    padded_n = -(-n // 128) * 128  # the scale layout is in 128-row tiles
    xp = torch.zeros(padded_n, x.shape[1], dtype=torch.float32, device=x.device)
    xp[:n] = x
    xq = nvfp4.quantize(xp, nvfp4.GROUP_SIZE, input_scale)
    if cache is None or "swizzled" not in cache:
        swizzled = swizzle_block_scales(block_scale)
        if cache is not None:
            cache["swizzled"] = swizzled
    else:
        swizzled = cache["swizzled"]
    a = xq.codes.view(torch.float4_e2m1fn_x2)  # [padded_n, in / 2]
    b = codes.view(torch.float4_e2m1fn_x2)  # [out, in / 2]
    y = torch._scaled_mm(a, b.t(), swizzle_block_scales(xq.block_scale), swizzled, out_dtype=torch.bfloat16)
    return (y[:n].float() * (float(xq.global_scale) * row_scale)).to(x.dtype)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)
