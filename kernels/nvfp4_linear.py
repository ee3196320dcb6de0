"""x @ W.T for an NVFP4 weight that stays packed: the fast path for the device at hand.

CPU, up to VERIFY_MAX_ROWS rows of x (decode, speculative verify), and any number of rows on a
CPU with AMX: the compiled kernel. With bf16 activations on a CPU with AMX it multiplies on AMX
tiles (W dequantised exactly to bf16 16 rows at a time, fp32 accumulation), otherwise it looks
E2M1 values up in a register table and streams the codes once. Its path never depends on the
number of rows, so these forwards are batch-invariant (see batch_invariance.py).
CPU, more rows otherwise (prefill): tiles of W dequantised by the compiled kernel, multiplied by torch.
CPU without the compiled library: `nvfp4.linear_reference` (tiled, plain PyTorch; one row at a
time up to VERIFY_MAX_ROWS rows).
CUDA: `nvfp4_gpu` (FP4 tensor cores for W4A4 on Blackwell, weight-only elsewhere).
W4A4 on the CPU is emulated: x is quantised to NVFP4 and back with `input_scale`, then W4A16.
"""

from __future__ import annotations

import torch

from hetero_run.kernels import cpu_ext, nvfp4, nvfp4_gpu
from hetero_run.kernels.batch_invariance import invariant, per_row

# Elements of W dequantised at once on the prefill path (4 MiB of float32: stays in L2/L3).
TILE_ELEMENTS = 1 << 20


def nvfp4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    block_scale: torch.Tensor,
    row_scale: torch.Tensor,
    input_scale: float | None = None,
    cache: dict | None = None,
) -> torch.Tensor:
    """x [n, in] @ W.T -> [n, out] in x's dtype.

    codes uint8 [out, in/2], block_scale float8_e4m3fn [out, in/16], row_scale float32 [out]
    (the global scale of each row). With `input_scale`, activations are quantised too (W4A4).
    """
    if x.is_cuda:
        if input_scale is not None:
            return nvfp4_gpu.linear_w4a4(x, codes, block_scale, row_scale, input_scale, cache)
        return nvfp4_gpu.linear_weight_only(x, codes, block_scale, row_scale)
    xk = x if input_scale is None else nvfp4.fake_quantize(x, input_scale)  # W4A4: float32
    if xk.dtype not in (torch.float32, torch.bfloat16):
        xk = xk.float()
    lib = cpu_ext.ops()
    if lib is None:
        reference = (lambda rows: nvfp4.linear_reference(rows, codes, block_scale, row_scale))  # noqa: E731
        return (per_row(reference, xk) if invariant(x.shape[0]) else reference(xk)).to(x.dtype)
    scales = block_scale.view(torch.uint8)
    amx = xk.dtype == torch.bfloat16 and cpu_ext.features() & cpu_ext.FEATURE_AMX and xk.shape[1] % 32 == 0
    if invariant(x.shape[0]) or amx:
        return lib.nvfp4_linear(xk.contiguous(), codes, scales, row_scale).to(x.dtype)
    xf = xk.float()
    out_features = codes.shape[0]
    tile_rows = max(1, TILE_ELEMENTS // (codes.shape[1] * 2))
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    for start in range(0, out_features, tile_rows):
        stop = min(start + tile_rows, out_features)
        tile = lib.nvfp4_dequant(codes[start:stop], scales[start:stop], row_scale[start:stop])  # [rows, in]
        y[:, start:stop] = xf @ tile.T
    return y.to(x.dtype)


def nvfp4_dequantize(codes: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] in `dtype`, bit-identical to `nvfp4.dequantize` (compiled on the CPU when available)."""
    lib = cpu_ext.ops()
    if lib is not None and codes.device.type == "cpu" and codes.dim() == 2:
        return lib.nvfp4_dequant(codes.contiguous(), block_scale.contiguous().view(torch.uint8),
                                 row_scale.contiguous()).to(dtype)
    return nvfp4.dequantize(codes, block_scale, row_scale, dtype)
