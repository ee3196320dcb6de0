// Shared by the CPU linear kernels (see cpu_linear.cpp for the ops they implement).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define HR_X86 1
#define HR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define HR_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define HR_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")))
#else
#define HR_X86 0
#endif

namespace hetero_run_cpu {

constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                             -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
constexpr int64_t kGroup = 16;
constexpr int kMaxBatch = 8;  // x rows kept in registers at once

// fp8 e4m3 byte -> float, a 256-entry table (NaN encodings are never block scales).
const float* fp8_table();

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rows per task so that each task streams at least ~64 KiB of weights (thread wake-up costs
// more than a smaller task saves).
inline int64_t grain_rows(int64_t row_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
}

// What this CPU (and OS) lets us use; false everywhere off x86.
bool has_avx512();
bool has_avx512_bf16();
bool has_amx();

// portable.cpp: plain loops, any CPU.
void nvfp4_rows_generic(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                        const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t out);
void dense_rows_generic(const float* x, int64_t n, int64_t in, const float* w, int64_t r0, int64_t r1, float* y,
                        int64_t out);
void dense_rows_generic(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t r0, int64_t r1, float* y,
                        int64_t out);
void dense_rows_generic(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t r0, int64_t r1,
                        float* y, int64_t out);

// nvfp4_avx512.cpp
void nvfp4_linear_avx512(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                         const float* row_scale, int64_t out, float* y);
void nvfp4_dequant_rows_avx512(const uint8_t* codes, const uint8_t* scales, const float* row_scale, int64_t in,
                               int64_t r0, int64_t r1, float* w);
void row_scales(const uint8_t* s, int64_t nblocks, float* out);  // fp8 block scales -> float

// dense_avx512.cpp (uint16_t = bf16 bits)
void dense_linear_avx512(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);
void dense_linear_avx512(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);
void dense_linear_avx512(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

// amx.cpp (bf16 x)
void nvfp4_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                      const float* row_scale, int64_t out, float* y);
void dense_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

}  // namespace hetero_run_cpu
