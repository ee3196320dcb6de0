"""Dense (bf16 / fp16 / fp32) linear layers: the compiled decode kernel where it helps, torch elsewhere.

torch's CPU bf16 matrix-vector product reaches about half the memory bandwidth of its fp32 one
on the machines this targets; `csrc/cpu_linear.cpp` streams bf16 weights at the bandwidth limit
(vdpbf16ps for bf16 activations, exact widening to fp32 for fp32 activations).
"""

from __future__ import annotations

import torch

from hetero_run.kernels import cpu_ext

# Up to this many rows of x the compiled kernel wins; beyond it, torch's GEMM (AMX / MKL) does.
SMALL_BATCH = 16


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ w[out, in].T -> [n, out] in x's dtype."""
    if _use_kernel(x, w):
        lib = cpu_ext.ops()
        xk = x.contiguous()
        if xk.dtype == torch.bfloat16 and not cpu_ext.features() & cpu_ext.FEATURE_AVX512_BF16:
            xk = xk.float()  # widening is exact; the fp32 path still reads w as bf16
        if xk.dtype == torch.float32 or w.dtype == torch.bfloat16:
            return lib.dense_linear(xk, w).to(x.dtype)
    return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)


def dense_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product in float64, for tests: [n, out] float64."""
    return x.double() @ w.double().T


def _use_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] <= SMALL_BATCH
        and w.dtype in (torch.bfloat16, torch.float32)
        and x.dtype in (torch.bfloat16, torch.float32)
        and w.is_contiguous()
        and cpu_ext.ops() is not None
    )
