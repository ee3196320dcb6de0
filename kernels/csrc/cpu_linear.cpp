// Decode-shaped linear layers on the CPU: y[n, out] = x[n, in] @ W[out, in].T for small n.
//
// Ops (namespace hetero_run, loaded by kernels/cpu_ext.py; references in kernels/nvfp4.py and
// kernels/dense_linear.py):
//   nvfp4_linear(x f32|bf16 [n, in], codes u8 [out, in/2], block_scale u8 (fp8 e4m3 bits) [out, in/16],
//                row_scale f32 [out], path=0) -> f32 [n, out]
//   nvfp4_dequant(codes, block_scale, row_scale) -> f32 [out, in]   (bit-exact with the reference)
//   dense_linear(x f32|bf16 [n, in], w f32|bf16 [out, in], path=0) -> f32 [n, out]
//   cpu_features() -> int   (bit 0: AVX-512 kernels, bit 1: AVX-512 BF16 dot products, bit 2: AMX)
// path 0 picks the best kernel; 1 forces the vector kernels, 2 the AMX ones (tests use both).
//
// Decode reads every weight once per token, so these kernels aim at memory bandwidth: weights
// stream through once, x stays in L1/L2, and each thread owns a range of output rows.
// The AVX-512 and AMX paths are compiled with per-function target attributes and chosen at run
// time, so the library builds and runs (portable loops) on any CPU. Files: this one (the ops and
// the choice of kernel), nvfp4_avx512.cpp, dense_avx512.cpp, amx.cpp, portable.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_kernels.h"

namespace hetero_run_cpu {
namespace {

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// path: 0 = best available, 1 = vector kernels (AVX-512 or portable), 2 = AMX (bf16 x only).
constexpr int64_t kPathAuto = 0, kPathVector = 1, kPathAmx = 2;

// The choice never depends on the number of rows of x: each kernel computes every row of y in
// one fixed order whatever the other rows are, so row i of f(x) equals f(x[i:i+1]) bit for bit
// (a speculative verify forward of k + 1 tokens must match k + 1 one-token decode forwards).
// AMX costs about as much for 16 rows as for one, which is what makes verifying cheap.
bool use_amx(const at::Tensor& x, int64_t in, int64_t path) {
  const bool able = x.scalar_type() == at::kBFloat16 && in % 32 == 0 && has_amx();
  TORCH_CHECK(path != kPathAmx || able, "the AMX path needs bfloat16 x, in_features a multiple of 32 and a CPU "
              "with AMX");
  return path == kPathAmx || (path == kPathAuto && able);
}

at::Tensor nvfp4_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& row_scale, int64_t path) {
  check_2d(x_in, "x");
  check_2d(codes, "codes");
  check_2d(scales, "block_scale");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "codes and scales must be uint8");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale must be contiguous float32");
  const int64_t n = x_in.size(0), in = x_in.size(1), out = codes.size(0);
  TORCH_CHECK(in % kGroup == 0, "in_features ", in, " is not a multiple of ", kGroup);
  TORCH_CHECK(codes.size(1) * 2 == in, "codes have ", codes.size(1) * 2, " inputs, x has ", in);
  TORCH_CHECK(scales.size(0) == out && scales.size(1) * kGroup == in, "block_scale shape does not match codes");
  TORCH_CHECK(row_scale.numel() == out, "row_scale needs ", out, " values");
  at::Tensor y = at::empty({n, out}, x_in.options().dtype(at::kFloat));
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const uint8_t* sd = scales.data_ptr<uint8_t>();
  const float* rs = row_scale.data_ptr<float>();
  float* yd = y.data_ptr<float>();
#if HR_X86
  if (use_amx(x_in, in, path)) {
    nvfp4_linear_amx(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, cd, sd, rs, out, yd);
    return y;
  }
#endif
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in : x_in.to(at::kFloat);
  const float* xd = x.data_ptr<float>();
#if HR_X86
  if (has_avx512()) {
    nvfp4_linear_avx512(xd, n, in, cd, sd, rs, out, yd);
    return y;
  }
#endif
  at::parallel_for(0, out, grain_rows(in / 2), [&](int64_t r0, int64_t r1) {
    nvfp4_rows_generic(xd, n, in, cd, sd, rs, r0, r1, yd, out);
  });
  return y;
}

at::Tensor nvfp4_dequant(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale) {
  check_2d(codes, "codes");
  check_2d(scales, "block_scale");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "codes and scales must be uint8");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale must be contiguous float32");
  const int64_t out = codes.size(0), in = codes.size(1) * 2;
  TORCH_CHECK(in % kGroup == 0 && scales.size(0) == out && scales.size(1) * kGroup == in,
              "block_scale shape does not match codes");
  TORCH_CHECK(row_scale.numel() == out, "row_scale needs ", out, " values");
  at::Tensor w = at::empty({out, in}, row_scale.options());
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const uint8_t* sd = scales.data_ptr<uint8_t>();
  const float* rs = row_scale.data_ptr<float>();
  float* wd = w.data_ptr<float>();
  at::parallel_for(0, out, grain_rows(in * 4), [&](int64_t r0, int64_t r1) {
#if HR_X86
    if (has_avx512()) {
      nvfp4_dequant_rows_avx512(cd, sd, rs, in, r0, r1, wd);
      return;
    }
#endif
    const float* fp8 = fp8_table();
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < in; ++k) {
        const uint8_t byte = cd[r * (in / 2) + k / 2];
        const float s = fp8[sd[r * (in / kGroup) + k / kGroup]] * rs[r];
        wd[r * in + k] = kE2M1[(k & 1) ? (byte >> 4) : (byte & 15)] * s;
      }
  });
  return w;
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t path) {
  check_2d(x, "x");
  check_2d(w, "w");
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16, "w must be float32 or bfloat16");
  TORCH_CHECK(!(xt == at::kBFloat16 && wt == at::kFloat), "bfloat16 x with float32 w is not supported");
  const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
  TORCH_CHECK(w.size(1) == in, "w has ", w.size(1), " inputs, x has ", in);
  at::Tensor y = at::empty({n, out}, x.options().dtype(at::kFloat));
  float* yd = y.data_ptr<float>();
  const bool bf16_dot = xt == at::kBFloat16 && has_avx512_bf16();
#if HR_X86
  if (wt == at::kBFloat16 && use_amx(x, in, path)) {
    dense_linear_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()), n, in,
                     reinterpret_cast<const uint16_t*>(w.data_ptr()), out, yd);
    return y;
  }
  if (has_avx512() && (xt == at::kFloat || bf16_dot)) {
    if (xt == at::kBFloat16) {
      dense_linear_avx512(reinterpret_cast<const uint16_t*>(x.data_ptr()), n, in,
                          reinterpret_cast<const uint16_t*>(w.data_ptr()), out, yd);
    } else if (wt == at::kBFloat16) {
      dense_linear_avx512(x.data_ptr<float>(), n, in, reinterpret_cast<const uint16_t*>(w.data_ptr()), out, yd);
    } else {
      dense_linear_avx512(x.data_ptr<float>(), n, in, w.data_ptr<float>(), out, yd);
    }
    return y;
  }
#endif
  (void)bf16_dot;
  at::parallel_for(0, out, grain_rows(in * w.element_size()), [&](int64_t r0, int64_t r1) {
    if (xt == at::kBFloat16)
      dense_rows_generic(reinterpret_cast<const uint16_t*>(x.data_ptr()), n, in,
                         reinterpret_cast<const uint16_t*>(w.data_ptr()), r0, r1, yd, out);
    else if (wt == at::kBFloat16)
      dense_rows_generic(x.data_ptr<float>(), n, in, reinterpret_cast<const uint16_t*>(w.data_ptr()), r0, r1, yd,
                         out);
    else
      dense_rows_generic(x.data_ptr<float>(), n, in, w.data_ptr<float>(), r0, r1, yd, out);
  });
  return y;
}

int64_t cpu_features() { return (has_avx512() ? 1 : 0) | (has_avx512_bf16() ? 2 : 0) | (has_amx() ? 4 : 0); }

}  // namespace
}  // namespace hetero_run_cpu

TORCH_LIBRARY(hetero_run, m) {
  m.def("nvfp4_linear(Tensor x, Tensor codes, Tensor block_scale, Tensor row_scale, int path=0) -> Tensor",
        &hetero_run_cpu::nvfp4_linear);
  m.def("nvfp4_dequant(Tensor codes, Tensor block_scale, Tensor row_scale) -> Tensor", &hetero_run_cpu::nvfp4_dequant);
  m.def("dense_linear(Tensor x, Tensor w, int path=0) -> Tensor", &hetero_run_cpu::dense_linear);
  m.def("cpu_features() -> int", &hetero_run_cpu::cpu_features);
}
