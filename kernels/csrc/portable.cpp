// Portable loops (any CPU), the run-time CPU feature checks, and the fp8 table.
#include <atomic>

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

// Each (weight row, x row) sums its products from input 0 upwards, one at a time.
void nvfp4_linear_portable(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                           const float* row_scale, int64_t out, float* y) {
  const float* fp8 = fp8_table();
  at::parallel_for(0, out, grain_rows(in / 2 + in / kGroup), [&](int64_t r0, int64_t r1) {
    std::vector<float> w(in);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* cr = codes + r * (in / 2);
      const uint8_t* sr = scales + r * (in / kGroup);
      for (int64_t k = 0; k < in; ++k)  // exact: E2M1 times an fp8 scale
        w[k] = kE2M1[(k & 1) ? (cr[k / 2] >> 4) : (cr[k / 2] & 15)] * fp8[sr[k / kGroup]];
      for (int64_t i = 0; i < n; ++i) {
        const float* xr = x + i * in;
        float acc = 0.f;
        for (int64_t k = 0; k < in; ++k) acc += w[k] * xr[k];
        y[i * out + r] = acc * row_scale[r];
      }
    }
  });
}

namespace {
template <typename W, typename ToFloat>
void dense_rows(const float* x, int64_t n, int64_t in, const W* w, int64_t out, float* y, ToFloat wf) {
  at::parallel_for(0, out, grain_rows(in * static_cast<int64_t>(sizeof(W))), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const W* wr = w + r * in;
      for (int64_t i = 0; i < n; ++i) {
        const float* xr = x + i * in;
        float acc = 0.f;
        for (int64_t k = 0; k < in; ++k) acc += wf(wr[k]) * xr[k];
        y[i * out + r] = acc;
      }
    }
  });
}
float same(float v) { return v; }
}  // namespace

void dense_linear_portable(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  dense_rows(x, n, in, w, out, y, same);
}

void dense_linear_portable(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_rows(x, n, in, w, out, y, bf16_to_float);
}

namespace {

int detect() {
  int f = 0;
#if HR_X86
  // __builtin_cpu_supports also checks that the OS saves the registers (XCR0).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= kFeatureAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    f |= kFeatureAvx512;
    if (__builtin_cpu_supports("avx512bf16")) f |= kFeatureAvx512Bf16;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1)) {  // AMX-BF16, AMX-TILE
#if defined(__linux__)
      // Linux hands out tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
      if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) f |= kFeatureAmx;
#endif
    }
  }
#endif
  return f;
}

std::atomic<int> g_allowed{-1};

}  // namespace

int supported_features() {
  static const int f = detect();
  return f;
}

int allowed_features() {
  const int a = g_allowed.load(std::memory_order_relaxed);
  return a < 0 ? supported_features() : a & supported_features();
}

void set_allowed_features(int mask) { g_allowed.store(mask, std::memory_order_relaxed); }

namespace {
std::atomic<int> g_dense_streaming{kStreamingByCpu};
}

int dense_streaming() { return g_dense_streaming.load(std::memory_order_relaxed); }
void set_dense_streaming(int mode) { g_dense_streaming.store(mode, std::memory_order_relaxed); }

bool amd_cpu() {
#if HR_X86
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

bool amd_zen5_or_later() {
#if HR_X86
  static const bool zen5 = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!amd_cpu() || !__get_cpuid(1, &a, &b, &c, &d)) return false;
    const unsigned family = ((a >> 8) & 0xF) + (((a >> 8) & 0xF) == 0xF ? (a >> 20) & 0xFF : 0);
    return family >= 0x1A;
  }();
  return zen5;
#else
  return false;
#endif
}

int64_t prefetch_ahead_bytes() { return amd_zen5_or_later() ? 6144 : 2048; }

bool has_avx2() { return allowed(kFeatureAvx2); }
bool has_avx512() { return allowed(kFeatureAvx512); }
bool has_avx512_bf16() { return allowed(kFeatureAvx512Bf16); }
bool has_amx() { return allowed(kFeatureAmx); }

}  // namespace hetero_run_cpu
