// Portable loops (any CPU), the run-time CPU feature checks, and the fp8 table.
#include "cpu_kernels.h"

#if HR_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace hetero_run_cpu {

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(static_cast<float>(m), -9);
      t[b] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table.data();
}

void nvfp4_rows_generic(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                        const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t out) {
  const float* fp8 = fp8_table();
  std::vector<float> acc(n);
  for (int64_t r = r0; r < r1; ++r) {
    std::fill(acc.begin(), acc.end(), 0.f);
    const uint8_t* cr = codes + r * (in / 2);
    const uint8_t* sr = scales + r * (in / kGroup);
    for (int64_t b = 0; b < in / kGroup; ++b) {
      const float s = fp8[sr[b]];
      for (int64_t i = 0; i < n; ++i) {
        const float* xb = x + i * in + b * kGroup;
        float t = 0.f;
        for (int k = 0; k < kGroup / 2; ++k) {
          const uint8_t byte = cr[b * kGroup / 2 + k];
          t += kE2M1[byte & 15] * xb[2 * k] + kE2M1[byte >> 4] * xb[2 * k + 1];
        }
        acc[i] += t * s;
      }
    }
    for (int64_t i = 0; i < n; ++i) y[i * out + r] = acc[i] * row_scale[r];
  }
}

namespace {
template <typename X, typename W, typename ToFloatX, typename ToFloatW>
void dense_rows(const X* x, int64_t n, int64_t in, const W* w, int64_t r0, int64_t r1, float* y, int64_t out,
                ToFloatX xf, ToFloatW wf) {
  for (int64_t r = r0; r < r1; ++r) {
    const W* wr = w + r * in;
    for (int64_t i = 0; i < n; ++i) {
      const X* xr = x + i * in;
      float acc = 0.f;
      for (int64_t k = 0; k < in; ++k) acc += wf(wr[k]) * xf(xr[k]);
      y[i * out + r] = acc;
    }
  }
}
float same(float v) { return v; }
}  // namespace

void dense_rows_generic(const float* x, int64_t n, int64_t in, const float* w, int64_t r0, int64_t r1, float* y,
                        int64_t out) {
  dense_rows(x, n, in, w, r0, r1, y, out, same, same);
}

void dense_rows_generic(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t r0, int64_t r1, float* y,
                        int64_t out) {
  dense_rows(x, n, in, w, r0, r1, y, out, same, bf16_to_float);
}

void dense_rows_generic(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t r0, int64_t r1,
                        float* y, int64_t out) {
  dense_rows(x, n, in, w, r0, r1, y, out, bf16_to_float, bf16_to_float);
}

#if HR_X86
bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

bool has_avx512_bf16() {
  static const bool ok = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

bool has_amx() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
#if defined(__linux__)
    // Linux hands out tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
#else
bool has_avx512() { return false; }
bool has_avx512_bf16() { return false; }
bool has_amx() { return false; }
#endif

}  // namespace hetero_run_cpu
