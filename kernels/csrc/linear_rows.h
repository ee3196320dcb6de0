// Part of a registered linear op, for callers that split the output rows between threads
// themselves (drafter_step.cpp runs a whole decode step in one parallel region).
#pragma once

#include <ATen/core/Tensor.h>

namespace hetero_run_cpu {

// A caller that starts a kernel on cold weights can first prefetch prefetch_ahead_bytes()
// (cpu_kernels.h) of them, the window the NVFP4 kernels run ahead of their group loop.
//
// Output rows r0 .. r1 - 1 of hetero_run::nvfp4_linear(x, codes, block_scale, row_scale, path) and
// of hetero_run::dense_linear(x, w, path), path 0 (the best allowed kernels) or 1 (the same without
// AMX), into y [n, r1 - r0] (row-major): the same kernel and the same bits as those rows of the op.
// Shapes and dtypes are the caller's to check. Called inside a parallel region, the kernel runs on
// the calling thread alone.
void nvfp4_linear_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& block_scale,
                       const at::Tensor& row_scale, int64_t r0, int64_t r1, float* y, int64_t path = 0);
void dense_linear_rows(const at::Tensor& x, const at::Tensor& w, int64_t r0, int64_t r1, float* y,
                       int64_t path = 0);

// hetero_run::nvfp4_linear_i8, path 0, in two parts: the n rows of x [n, in] quantised (nvfp4_int8.cpp's
// layout, i8_groups(in) * kI8GroupBytes bytes a row) into xq, then output rows r0 .. r1 - 1 of xq
// times the NVFP4 weights into y [n, r1 - r0], on the calling thread.
void quantize_i8_rows(const float* x, int64_t n, int64_t in, uint8_t* xq);
void nvfp4_i8_linear_rows(const uint8_t* xq, int64_t n, int64_t in, const at::Tensor& codes,
                          const at::Tensor& block_scale, const at::Tensor& row_scale, int64_t r0, int64_t r1, float* y);

}  // namespace hetero_run_cpu
