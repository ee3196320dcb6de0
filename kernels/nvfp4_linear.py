"""x @ W.T for an NVFP4 weight that stays packed: the fast path for the device at hand.

CPU with the compiled library: `csrc/cpu_linear.cpp` for any number of rows of x (decode,
speculative verify, batches, prefill). It decodes E2M1 with a permute table into exact bf16
weights and multiplies them with AVX512-BF16 dot products or AMX tiles (bf16 activations), or
FMA on exact float32 weights (float32 activations, or CPUs without those); fp32 sums, the
per-row global scale last. Its path never depends on the number of rows and every row sums in
one fixed order, so forwards of any size are row-invariant (batch_invariance.py).
CPU without the compiled library: `nvfp4.linear_reference` (tiled, plain PyTorch; one row at a
time up to VERIFY_MAX_ROWS rows).
CUDA: `nvfp4_gpu` (FP4 tensor cores for W4A4 on Blackwell, weight-only elsewhere).
W4A4 on the CPU is emulated: x is quantised to NVFP4 and back with `input_scale`, then W4A16.
"""

from __future__ import annotations

import torch

from hetero_run.kernels import cpu_ext, nvfp4, nvfp4_gpu
from hetero_run.kernels.batch_invariance import invariant, per_row

# An upper bound on the weight scratch (elements) one product holds at a time: the compiled
# kernel's per-thread tiles, or a tile of the PyTorch fallback (runtime/planner counts it).
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
    # bf16 x: the kernel rounds y itself (torch's bits, without a second pass through PyTorch)
    y = lib.nvfp4_linear(xk.contiguous(), codes, block_scale.view(torch.uint8), row_scale, 0, x.dtype == torch.bfloat16)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def nvfp4_dequantize(codes: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] in `dtype`, bit-identical to `nvfp4.dequantize` (compiled on the CPU when available)."""
    lib = cpu_ext.ops()
    if lib is not None and codes.device.type == "cpu" and codes.dim() == 2:
        return lib.nvfp4_dequant(codes.contiguous(), block_scale.contiguous().view(torch.uint8),
                                 row_scale.contiguous()).to(dtype)
    return nvfp4.dequantize(codes, block_scale, row_scale, dtype)


# ---------------------------------------------------------------- int8 activations (the drafter's)

I8_GROUP = 64  # inputs per group of a quantised row (csrc/nvfp4_int8.cpp)


def nvfp4_linear_i8(x: torch.Tensor, codes: torch.Tensor, block_scale: torch.Tensor,
                    row_scale: torch.Tensor) -> torch.Tensor:
    """float32 x [n, in] @ W.T -> float32 [n, out] with each block of 16 activations quantised to
    int8 (its own scale) and integer dot products: `csrc/nvfp4_int8.cpp`, the drafter's kernel
    where the CPU lacks AVX-512 (not nvfp4_linear's bits; within int8 rounding of them). Every row
    on its own, in one order: row-invariant. Without the compiled library, `linear_i8_reference`."""
    lib = cpu_ext.ops()
    x = x.float().contiguous()
    if lib is None:
        return linear_i8_reference(x, codes, block_scale, row_scale).float()
    return lib.nvfp4_linear_i8(x, codes, block_scale.view(torch.uint8), row_scale)


def quantize_i8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x [n, in] -> (q int8 [n, in], a float32 [n, in / 16]) as the kernels quantise it:
    per block of 16, a = amax / 127 and q = x * (127 / amax) rounded to even (0 for a zero block)."""
    blocks = x.float().reshape(x.shape[0], -1, nvfp4.GROUP_SIZE)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).to(torch.int8)
    return q.reshape(x.shape), (amax / 127.0).squeeze(-1)


def linear_i8_reference(x: torch.Tensor, codes: torch.Tensor, block_scale: torch.Tensor,
                        row_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4_linear_i8 in float64 from the same quantised activations (the kernel's float32 sums
    differ from it by rounding only)."""
    q, a = quantize_i8_reference(x)
    xd = (q.double().reshape(x.shape[0], -1, nvfp4.GROUP_SIZE) * a.double()[..., None]).reshape(x.shape)
    return xd @ nvfp4.dequantize(codes, block_scale, row_scale).double().T
