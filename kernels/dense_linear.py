"""Dense (bf16 / fp16 / fp32) linear layers: the compiled kernel on the CPU, torch elsewhere.

torch's CPU bf16 matrix-vector product reaches about half the memory bandwidth of its fp32 one
on the machines this targets; `csrc/cpu_linear.cpp` streams bf16 weights at the bandwidth limit
(AMX tiles or vdpbf16ps for bf16 activations, exact widening to fp32 for fp32 activations) and
sums every row in one fixed order whatever the number of rows, so forwards of any size are
row-invariant (batch_invariance.py). Without the library (or for fp16 weights): torch, one row
at a time up to VERIFY_MAX_ROWS rows, torch's GEMM above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.kernels import cpu_ext
from hetero_run.kernels.batch_invariance import invariant, per_row


def dense_linear(x: torch.Tensor, w: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    """x [n, in] @ w[out, in].T -> [n, out] in x's dtype; with `float_out`, the same values held
    in float32 (a model's logits: the compiled kernel rounds its float32 sums to bf16 in place,
    without a bf16 copy and a float32 copy of it)."""
    if _use_kernel(x, w):
        lib = cpu_ext.ops()
        xk = x.contiguous()
        if xk.dtype == torch.bfloat16 and w.dtype == torch.float32:
            xk = xk.float()  # widening is exact
        bf16 = x.dtype == torch.bfloat16
        if float_out:
            y = lib.dense_linear(xk, w, 0, False)
            return lib.round_bf16_(y) if bf16 else y
        y = lib.dense_linear(xk, w, 0, bf16)  # bf16: rounded by the kernel
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if not invariant(x.shape[0]) or x.device.type != "cpu":  # prefill without the library, or a GPU
        y = F.linear(x.to(w.dtype), w).to(x.dtype)
    else:
        y = per_row(lambda row: F.linear(row.to(w.dtype), w), x).to(x.dtype)
    return y.float() if float_out else y


def dense_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product in float64, for tests: [n, out] float64."""
    return x.double() @ w.double().T


def _use_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and w.dtype in (torch.bfloat16, torch.float32)
        and x.dtype in (torch.bfloat16, torch.float32)
        and w.is_contiguous()
        and cpu_ext.ops() is not None
    )
