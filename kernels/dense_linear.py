"""Dense (bf16 / fp16 / fp32) linear layers: the compiled kernel where it helps, torch elsewhere.

torch's CPU bf16 matrix-vector product reaches about half the memory bandwidth of its fp32 one
on the machines this targets; `csrc/cpu_linear.cpp` streams bf16 weights at the bandwidth limit
(AMX tiles or vdpbf16ps for bf16 activations, exact widening to fp32 for fp32 activations).
Forwards of up to VERIFY_MAX_ROWS rows are batch-invariant (see batch_invariance.py): the
compiled kernel, whose path does not depend on the number of rows, or else torch one row at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.kernels import cpu_ext
from hetero_run.kernels.batch_invariance import invariant, per_row


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ w[out, in].T -> [n, out] in x's dtype."""
    if not invariant(x.shape[0]) or x.device.type != "cpu":  # prefill (or a GPU): torch's GEMM
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    if _use_kernel(x, w):
        xk = x.contiguous()
        if xk.dtype == torch.bfloat16 and (w.dtype == torch.float32
                                           or not cpu_ext.features() & cpu_ext.FEATURE_AVX512_BF16):
            xk = xk.float()  # widening is exact; the fp32 path still reads a bf16 w as bf16
        return cpu_ext.ops().dense_linear(xk, w).to(x.dtype)
    return per_row(lambda row: F.linear(row.to(w.dtype), w), x).to(x.dtype)


def dense_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product in float64, for tests: [n, out] float64."""
    return x.double() @ w.double().T


def _use_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and x.dim() == 2
        and w.dtype in (torch.bfloat16, torch.float32)
        and x.dtype in (torch.bfloat16, torch.float32)
        and w.is_contiguous()
        and cpu_ext.ops() is not None
    )
