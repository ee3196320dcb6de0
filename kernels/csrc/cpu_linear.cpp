// Linear layers on the CPU: y[n, out] = x[n, in] @ W[out, in].T for any n.
//
// Ops (namespace hetero_run, loaded by kernels/cpu_ext.py; references in kernels/nvfp4.py and
// kernels/dense_linear.py):
//   nvfp4_linear(x f32|bf16 [n, in], codes u8 [out, in/2], block_scale u8 (fp8 e4m3 bits) [out, in/16],
//                row_scale f32 [out], path=0, bf16_out=False) -> f32 [n, out]
//       (bf16_out: y rounded to bf16 here, the bits torch's .to(torch.bfloat16) gives, without
//       a second pass through PyTorch: that took 5% of an 8-row decode step of the CPU target)
//   nvfp4_dequant(codes, block_scale, row_scale) -> f32 [out, in]   (bit-exact with the reference)
//   dense_linear(x f32|bf16 [n, in], w f32|bf16 [out, in], path=0, bf16_out=False) -> f32 [n, out]
//   nvfp4_linear_i8(x f32 [n, in], codes, block_scale, row_scale, path=0) -> f32 [n, out]
//       x quantised to int8 a block of 16 at a time, then integer dot products (nvfp4_int8.cpp;
//       not the bits of nvfp4_linear: the drafter's kernel where the CPU lacks AVX-512); path 0,
//       5 (AVX2) or 6 (portable loops), which give the same bits
//   nvfp4_i8_quantize(x f32 [n, in], path=0) -> u8 [n, 128 * ceil(in / 64)]  (its quantised rows)
//   cpu_features() -> int            the kernels path 0 may use (kFeature* bits, cpu_kernels.h)
//   cpu_supported_features() -> int  what CPUID and the OS offer
//   set_cpu_features(int mask)       restrict path 0 to these (after the caller's self-tests)
// path: 0 = the best allowed kernel, 1 = the best allowed without AMX, 2 = AMX, 3 = AVX512-BF16,
// 4 = AVX-512 (float32 FMA), 5 = AVX2 (float32 FMA), 6 = portable loops. A forced path (2-6)
// runs whenever the CPU supports it (tests and self-tests force each one) and is an error
// otherwise; x is widened to float32 (exactly) for the float32 paths.
//
// The choice never depends on the number of rows of x, and every kernel computes each row of y
// in one fixed order whatever the other rows are, so row i of f(x) equals f(x[i:i+1]) bit for
// bit at any n: a speculative verify, or a batch of many requests' rows, gives each row the bits
// it gets alone. Weights stream through once per pass of x rows; each thread owns a range of
// output rows. The kernels are compiled with per-function target attributes, so the library
// builds and runs (portable loops) on any CPU. Files: this one (the ops and the choice of
// kernel), nvfp4_avx512.cpp, dense_avx512.cpp (+ rows_avx512.h), avx2.cpp, amx.cpp, portable.cpp.

#include <cstring>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include "cpu_kernels.h"
#include "linear_rows.h"
#include "ops.h"

namespace hetero_run_cpu {
namespace {

void check_2d(const at::Tensor& t, const char* name) {
  HR_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  HR_CHECK(t.is_contiguous(), name, " must be contiguous");
  HR_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

constexpr int64_t kPathAuto = 0, kPathVector = 1, kPathAmx = 2, kPathAvx512Bf16 = 3, kPathAvx512 = 4,
                  kPathAvx2 = 5, kPathPortable = 6;

const char* isa_name(Isa isa) {
  switch (isa) {
    case kAmx: return "AMX";
    case kAvx512Bf16: return "AVX512-BF16";
    case kAvx512: return "AVX-512";
    case kAvx2: return "AVX2";
    default: return "portable";
  }
}

int feature_of(Isa isa) {
  switch (isa) {
    case kAmx: return kFeatureAmx;
    case kAvx512Bf16: return kFeatureAvx512Bf16;
    case kAvx512: return kFeatureAvx512;
    case kAvx2: return kFeatureAvx2;
    default: return 0;
  }
}

// bf16_ok: the bf16 paths apply (bf16 x, and bf16 w for dense); amx_ok: and the AMX tiles fit
// (in_features a multiple of 32).
Isa choose(int64_t path, bool bf16_ok, bool amx_ok) {
  HR_CHECK(path >= kPathAuto && path <= kPathPortable, "path must be 0..6, got ", path);
  const Isa forced[] = {kPortable, kPortable, kAmx, kAvx512Bf16, kAvx512, kAvx2, kPortable};
  if (path >= kPathAmx) {
    const Isa isa = forced[path];
    HR_CHECK(isa != kAmx || amx_ok, "the AMX path needs bfloat16 x (and weights), in_features a multiple of 32");
    HR_CHECK(isa != kAvx512Bf16 || bf16_ok, "the AVX512-BF16 path needs bfloat16 x (and weights)");
    HR_CHECK(isa == kPortable || supported(feature_of(isa)), "this CPU cannot run the ", isa_name(isa), " kernels");
    return isa;
  }
  if (path == kPathAuto && amx_ok && allowed(kFeatureAmx)) return kAmx;
  if (bf16_ok && allowed(kFeatureAvx512Bf16)) return kAvx512Bf16;
  if (allowed(kFeatureAvx512)) return kAvx512;
  if (allowed(kFeatureAvx2)) return kAvx2;
  return kPortable;
}

// x [n, in] times `out` NVFP4 weight rows (codes, scales and row scales of the first at cd, sd,
// rs) -> y [n, out], on `isa`.
void nvfp4_run(Isa isa, const at::Tensor& x_in, const uint8_t* cd, const uint8_t* sd, const float* rs, int64_t out,
               float* yd) {
  const int64_t n = x_in.size(0), in = x_in.size(1);
#if HR_X86
  if (isa == kAmx) return nvfp4_linear_amx(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, cd, sd, rs, out, yd);
  if (isa == kAvx512Bf16)
    return nvfp4_linear_avx512_bf16(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, cd, sd, rs, out, yd);
  if (isa == kAvx2 && x_in.scalar_type() == at::kBFloat16)
    return nvfp4_linear_avx2(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, cd, sd, rs, out, yd);
#endif
  const at::Tensor x = x_in.scalar_type() == at::kBFloat16 ? x_in.to(at::kFloat) : x_in;
  const float* xd = x.data_ptr<float>();
#if HR_X86
  if (isa == kAvx512) return nvfp4_linear_avx512(xd, n, in, cd, sd, rs, out, yd);
  if (isa == kAvx2) return nvfp4_linear_avx2(xd, n, in, cd, sd, rs, out, yd);
#endif
  nvfp4_linear_portable(xd, n, in, cd, sd, rs, out, yd);
}

// x [n, in] times `out` dense weight rows starting at w -> y [n, out], on `isa`.
void dense_run(Isa isa, const at::Tensor& x_in, const at::Tensor& w, int64_t r0, int64_t out, float* yd) {
  const int64_t n = x_in.size(0), in = x_in.size(1);
  const auto* wb = reinterpret_cast<const uint16_t*>(w.data_ptr()) + r0 * in;
#if HR_X86
  if (isa == kAmx) return dense_linear_amx(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, wb, out, yd);
  if (isa == kAvx512Bf16)
    return dense_linear_avx512_bf16(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, wb, out, yd);
  if (isa == kAvx2 && x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16)
    return dense_linear_avx2(reinterpret_cast<const uint16_t*>(x_in.data_ptr()), n, in, wb, out, yd);
#endif
  const at::Tensor x = x_in.scalar_type() == at::kBFloat16 ? x_in.to(at::kFloat) : x_in;
  const float* xd = x.data_ptr<float>();
  const bool wf = w.scalar_type() == at::kFloat;
  const float* wfd = wf ? w.data_ptr<float>() + r0 * in : nullptr;
#if HR_X86
  if (isa == kAvx512) return wf ? dense_linear_avx512(xd, n, in, wfd, out, yd) : dense_linear_avx512(xd, n, in, wb, out, yd);
  if (isa == kAvx2) return wf ? dense_linear_avx2(xd, n, in, wfd, out, yd) : dense_linear_avx2(xd, n, in, wb, out, yd);
#endif
  wf ? dense_linear_portable(xd, n, in, wfd, out, yd) : dense_linear_portable(xd, n, in, wb, out, yd);
}

#if HR_X86
HR_AVX512 void round_bf16_avx512(const float* y, int64_t count, uint16_t* out) {
  int64_t e = 0;
  for (; e + 16 <= count; e += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), round_bf16x16(_mm512_loadu_ps(y + e)));
  if (e < count) {
    const __mmask16 m = static_cast<__mmask16>((1u << (count - e)) - 1);
    _mm256_mask_storeu_epi16(out + e, m, round_bf16x16(_mm512_maskz_loadu_ps(m, y + e)));
  }
}

// The same rounding, each value written back widened to float32 (its low 16 bits zero).
HR_AVX512 void round_bf16_in_place_avx512(float* y, int64_t count) {
  int64_t e = 0;
  for (; e + 16 <= count; e += 16) _mm512_storeu_ps(y + e, through_bf16(_mm512_loadu_ps(y + e)));
  if (e < count) {
    const __mmask16 m = static_cast<__mmask16>((1u << (count - e)) - 1);
    _mm512_mask_storeu_ps(y + e, m, through_bf16(_mm512_maskz_loadu_ps(m, y + e)));
  }
}

HR_AVX2 void round_bf16_avx2(const float* y, int64_t count, uint16_t* out) {
  int64_t e = 0;
  for (; e + 8 <= count; e += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + e), round_bf16x8(_mm256_loadu_ps(y + e)));
  for (; e < count; ++e) out[e] = round_bf16(y[e]);
}

HR_AVX2 void round_bf16_in_place_avx2(float* y, int64_t count) {
  int64_t e = 0;
  for (; e + 8 <= count; e += 8) _mm256_storeu_ps(y + e, through_bf16x8(_mm256_loadu_ps(y + e)));
  for (; e < count; ++e) {
    const uint32_t wide = static_cast<uint32_t>(round_bf16(y[e])) << 16;
    std::memcpy(y + e, &wide, sizeof(wide));
  }
}
#endif

// y float32 -> a new bf16 tensor of the same shape (round_bf16's bits, element by element).
at::Tensor to_bf16(const at::Tensor& y) {
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(at::kBFloat16));
  const float* yd = y.data_ptr<float>();
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t e0, int64_t e1) { round_bf16_row(yd + e0, e1 - e0, od + e0); });
  return out;
}

// y float32, in place: every value rounded to bf16 (round_bf16's bits), kept in float32, so y holds
// what to_bf16(y) holds, widened. What a bf16 model's logits need without a bf16 copy and a float32
// copy of it (at 64 rows of a 151936-word vocabulary those copies are 58 MB of fresh pages).
at::Tensor& round_bf16_(at::Tensor& y) {
  HR_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous(), "y must be contiguous float32");
  float* yd = y.data_ptr<float>();
#if HR_X86
  const bool vec = has_avx512(), vec8 = has_avx2();
#endif
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t e0, int64_t e1) {
#if HR_X86
    if (vec) return round_bf16_in_place_avx512(yd + e0, e1 - e0);
    if (vec8) return round_bf16_in_place_avx2(yd + e0, e1 - e0);
#endif
    for (int64_t e = e0; e < e1; ++e) {
      const uint32_t wide = static_cast<uint32_t>(round_bf16(yd[e])) << 16;
      std::memcpy(yd + e, &wide, sizeof(wide));
    }
  });
  return y;
}

at::Tensor nvfp4_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& row_scale, int64_t path, bool bf16_out) {
  check_2d(x_in, "x");
  check_2d(codes, "codes");
  check_2d(scales, "block_scale");
  HR_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  HR_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "codes and scales must be uint8");
  HR_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale must be contiguous float32");
  const int64_t n = x_in.size(0), in = x_in.size(1), out = codes.size(0);
  HR_CHECK(in % kGroup == 0, "in_features ", in, " is not a multiple of ", kGroup);
  HR_CHECK(codes.size(1) * 2 == in, "codes have ", codes.size(1) * 2, " inputs, x has ", in);
  HR_CHECK(scales.size(0) == out && scales.size(1) * kGroup == in, "block_scale shape does not match codes");
  HR_CHECK(row_scale.numel() == out, "row_scale needs ", out, " values");
  at::Tensor y = at::empty({n, out}, x_in.options().dtype(at::kFloat));
  if (n == 0 || out == 0) return bf16_out ? y.to(at::kBFloat16) : y;
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  nvfp4_run(choose(path, bf16, bf16 && in % 32 == 0), x_in, codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
            row_scale.data_ptr<float>(), out, y.data_ptr<float>());
  return bf16_out ? to_bf16(y) : y;
}

at::Tensor nvfp4_dequant(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_scale) {
  check_2d(codes, "codes");
  check_2d(scales, "block_scale");
  HR_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "codes and scales must be uint8");
  HR_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale must be contiguous float32");
  const int64_t out = codes.size(0), in = codes.size(1) * 2;
  HR_CHECK(in % kGroup == 0 && scales.size(0) == out && scales.size(1) * kGroup == in,
           "block_scale shape does not match codes");
  HR_CHECK(row_scale.numel() == out, "row_scale needs ", out, " values");
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

at::Tensor dense_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t path, bool bf16_out) {
  check_2d(x_in, "x");
  check_2d(w, "w");
  const auto xt = x_in.scalar_type(), wt = w.scalar_type();
  HR_CHECK(xt == at::kFloat || xt == at::kBFloat16, "x must be float32 or bfloat16");
  HR_CHECK(wt == at::kFloat || wt == at::kBFloat16, "w must be float32 or bfloat16");
  HR_CHECK(!(xt == at::kBFloat16 && wt == at::kFloat), "bfloat16 x with float32 w is not supported");
  const int64_t n = x_in.size(0), in = x_in.size(1), out = w.size(0);
  HR_CHECK(w.size(1) == in, "w has ", w.size(1), " inputs, x has ", in);
  at::Tensor y = at::empty({n, out}, x_in.options().dtype(at::kFloat));
  if (n == 0 || out == 0) return bf16_out ? y.to(at::kBFloat16) : y;
  const bool bf16 = xt == at::kBFloat16 && wt == at::kBFloat16;
  dense_run(choose(path, bf16, bf16 && in % 32 == 0), x_in, w, 0, out, y.data_ptr<float>());
  return bf16_out ? to_bf16(y) : y;
}

// The int8-activation kernels: AVX2 for path 0 when allowed or for path 5, the portable loops
// for path 6 (or path 0 without AVX2).
bool i8_avx2(int64_t path) {
  HR_CHECK(path == kPathAuto || path == kPathAvx2 || path == kPathPortable,
           "the int8-activation kernels take path 0, 5 (AVX2) or 6 (portable), got ", path);
  if (path == kPathAvx2) HR_CHECK(supported(kFeatureAvx2), "this CPU cannot run the AVX2 kernels");
  return HR_X86 && (path == kPathAvx2 || (path == kPathAuto && allowed(kFeatureAvx2)));
}

void quantize_i8(bool avx2, const float* x, int64_t n, int64_t in, uint8_t* xq) {
  const int64_t row = i8_groups(in) * kI8GroupBytes;
  for (int64_t i = 0; i < n; ++i) {
#if HR_X86
    if (avx2) {
      quantize_i8_avx2(x + i * in, in, xq + i * row);
      continue;
    }
#endif
    quantize_i8_portable(x + i * in, in, xq + i * row);
  }
}

void nvfp4_i8_rows(bool avx2, const uint8_t* xq, int64_t n, int64_t in, const uint8_t* cd, const uint8_t* sd,
                   const float* rs, int64_t r0, int64_t r1, float* y, int64_t y_stride) {
#if HR_X86
  if (avx2) return nvfp4_i8_rows_avx2(xq, n, in, cd, sd, rs, r0, r1, y, y_stride);
#endif
  nvfp4_i8_rows_portable(xq, n, in, cd, sd, rs, r0, r1, y, y_stride);
}

void check_i8_x(const at::Tensor& x) {
  check_2d(x, "x");
  HR_CHECK(x.scalar_type() == at::kFloat, "x must be float32 for the int8-activation kernels, got ", x.scalar_type());
  HR_CHECK(x.size(1) % kGroup == 0, "in_features ", x.size(1), " is not a multiple of ", kGroup);
}

at::Tensor nvfp4_i8_quantize(const at::Tensor& x, int64_t path) {
  check_i8_x(x);
  const bool avx2 = i8_avx2(path);
  const int64_t n = x.size(0), in = x.size(1);
  at::Tensor xq = at::empty({n, i8_groups(in) * kI8GroupBytes}, x.options().dtype(at::kByte));
  quantize_i8(avx2, x.data_ptr<float>(), n, in, xq.data_ptr<uint8_t>());
  return xq;
}

at::Tensor nvfp4_linear_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& row_scale, int64_t path) {
  check_i8_x(x);
  check_2d(codes, "codes");
  check_2d(scales, "block_scale");
  HR_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kByte, "codes and scales must be uint8");
  HR_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous(), "row_scale must be contiguous float32");
  const int64_t n = x.size(0), in = x.size(1), out = codes.size(0);
  HR_CHECK(codes.size(1) * 2 == in, "codes have ", codes.size(1) * 2, " inputs, x has ", in);
  HR_CHECK(scales.size(0) == out && scales.size(1) * kGroup == in, "block_scale shape does not match codes");
  HR_CHECK(row_scale.numel() == out, "row_scale needs ", out, " values");
  const bool avx2 = i8_avx2(path);
  at::Tensor y = at::empty({n, out}, x.options());
  if (n == 0 || out == 0) return y;
  std::vector<uint8_t> xq(n * i8_groups(in) * kI8GroupBytes);
  quantize_i8(avx2, x.data_ptr<float>(), n, in, xq.data());
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const uint8_t* sd = scales.data_ptr<uint8_t>();
  const float* rs = row_scale.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  at::parallel_for(0, out, grain_rows(in / 2 + in / kGroup), [&](int64_t r0, int64_t r1) {
    nvfp4_i8_rows(avx2, xq.data(), n, in, cd, sd, rs, r0, r1, yd + r0, out);  // straight into y's columns
  });
  return y;
}

int64_t cpu_features() { return allowed_features(); }
int64_t cpu_supported_features() { return supported_features(); }
void set_cpu_features(int64_t mask) { set_allowed_features(static_cast<int>(mask)); }
int64_t get_dense_streaming() { return dense_streaming(); }
void force_dense_streaming(int64_t mode) {
  HR_CHECK(mode >= kStreamingByCpu && mode <= kStreamingDirect, "dense streaming mode must be -1, 0, 1 or 2, got ", mode);
  set_dense_streaming(static_cast<int>(mode));
}

}  // namespace

void round_bf16_row(const float* y, int64_t count, uint16_t* out) {
#if HR_X86
  if (has_avx512()) return round_bf16_avx512(y, count, out);
  if (has_avx2()) return round_bf16_avx2(y, count, out);
#endif
  for (int64_t e = 0; e < count; ++e) out[e] = round_bf16(y[e]);
}

void nvfp4_linear_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& row_scale, int64_t r0, int64_t r1, float* y, int64_t path) {
  HR_CHECK(path == kPathAuto || path == kPathVector, "path must be 0 or 1, got ", path);
  const int64_t half = codes.size(1), nb = scales.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  nvfp4_run(choose(path, bf16, bf16 && x.size(1) % 32 == 0), x, codes.data_ptr<uint8_t>() + r0 * half,
            scales.data_ptr<uint8_t>() + r0 * nb, row_scale.data_ptr<float>() + r0, r1 - r0, y);
}

void dense_linear_rows(const at::Tensor& x, const at::Tensor& w, int64_t r0, int64_t r1, float* y, int64_t path) {
  HR_CHECK(path == kPathAuto || path == kPathVector, "path must be 0 or 1, got ", path);
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
  dense_run(choose(path, bf16, bf16 && x.size(1) % 32 == 0), x, w, r0, r1 - r0, y);
}

void quantize_i8_rows(const float* x, int64_t n, int64_t in, uint8_t* xq) {
  quantize_i8(i8_avx2(kPathAuto), x, n, in, xq);
}

void nvfp4_i8_linear_rows(const uint8_t* xq, int64_t n, int64_t in, const at::Tensor& codes,
                          const at::Tensor& block_scale, const at::Tensor& row_scale, int64_t r0, int64_t r1, float* y) {
  nvfp4_i8_rows(i8_avx2(kPathAuto), xq, n, in, codes.data_ptr<uint8_t>(), block_scale.data_ptr<uint8_t>(),
                row_scale.data_ptr<float>(), r0, r1, y, r1 - r0);
}

namespace ops {
at::Tensor nvfp4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& block_scale,
                        const at::Tensor& row_scale, int64_t path, bool bf16_out) {
  return hetero_run_cpu::nvfp4_linear(x, codes, block_scale, row_scale, path, bf16_out);
}
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, int64_t path, bool bf16_out) {
  return hetero_run_cpu::dense_linear(x, w, path, bf16_out);
}
}  // namespace ops

}  // namespace hetero_run_cpu

TORCH_LIBRARY(hetero_run, m) {
  m.def("nvfp4_linear(Tensor x, Tensor codes, Tensor block_scale, Tensor row_scale, int path=0, bool bf16_out=False) "
        "-> Tensor",
        &hetero_run_cpu::nvfp4_linear);
  m.def("nvfp4_dequant(Tensor codes, Tensor block_scale, Tensor row_scale) -> Tensor", &hetero_run_cpu::nvfp4_dequant);
  m.def("dense_linear(Tensor x, Tensor w, int path=0, bool bf16_out=False) -> Tensor", &hetero_run_cpu::dense_linear);
  m.def("nvfp4_linear_i8(Tensor x, Tensor codes, Tensor block_scale, Tensor row_scale, int path=0) -> Tensor",
        &hetero_run_cpu::nvfp4_linear_i8);
  m.def("nvfp4_i8_quantize(Tensor x, int path=0) -> Tensor", &hetero_run_cpu::nvfp4_i8_quantize);
  m.def("round_bf16_(Tensor(a!) y) -> Tensor(a!)", &hetero_run_cpu::round_bf16_);
  m.def("cpu_features() -> int", &hetero_run_cpu::cpu_features);
  m.def("cpu_supported_features() -> int", &hetero_run_cpu::cpu_supported_features);
  m.def("set_cpu_features(int mask) -> ()", &hetero_run_cpu::set_cpu_features);
  m.def("dense_streaming() -> int", &hetero_run_cpu::get_dense_streaming);
  m.def("set_dense_streaming(int mode) -> ()", &hetero_run_cpu::force_dense_streaming);
}
