// Shared by the CPU linear kernels (see cpu_linear.cpp for the ops they implement).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HR_X86 1
#define HR_AVX2 __attribute__((target("avx2,fma")))
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

// The instruction sets a kernel can be built from, best last, and their cpu_features() bits
// (kernels/cpu_isa.py has the same numbers).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
constexpr int kFeatureAvx512 = 1, kFeatureAvx512Bf16 = 2, kFeatureAmx = 4, kFeatureAvx2 = 8;

// What the CPU and OS offer (CPUID, XCR0, the Linux tile-data permission), and what the caller
// allows after its self-tests (set_allowed_features); auto paths use only allowed ones.
int supported_features();
int allowed_features();
void set_allowed_features(int mask);
inline bool supported(int feature) { return (supported_features() & feature) != 0; }
inline bool allowed(int feature) { return (allowed_features() & feature) != 0; }
// Allowed (for the decode_ops kernels, which predate the per-path choice).
bool has_avx2();
bool has_avx512();
bool has_avx512_bf16();
bool has_amx();

// Whether the CPU is AMD's (CPUID's vendor), and whether it is AMD family 0x1A or later (Zen 5:
// 512-bit data paths, two 512-bit dot products a cycle, and cores that each stream memory about
// twice as fast as Zen 4's), for tuning that does not change results.
bool amd_cpu();
bool amd_zen5_or_later();

// How far ahead of the group it decodes an NVFP4 kernel asks for each weight row's codes (its
// block scales: an eighth of it): 2 KiB, 6 KiB on Zen 5, whose cores stream faster than the
// hardware prefetchers run ahead of a compute-heavy loop (one NVFP4 row of the real target's
// layers: 3.5 against 4.5 ms there; docs/nvfp4.md).
int64_t prefetch_ahead_bytes();

// How the AVX-512 dense kernel streams few rows of x (dense_avx512.cpp): chosen by the CPU, or
// forced one way (tests run every way on any CPU; the sums are the same in each).
enum DenseStreaming { kStreamingByCpu = -1, kStreamingWalk = 0, kStreamingStaged = 1, kStreamingDirect = 2 };
int dense_streaming();
void set_dense_streaming(int mode);

// fp8 e4m3 byte -> float, a 256-entry table (NaN encodings are never block scales).
const float* fp8_table();

// Scratch memory on 64-byte boundaries (std::vector does not promise that for vector types here).
template <typename T>
class Aligned {
 public:
  explicit Aligned(size_t count) : raw_((count * sizeof(T) + 127) / 64) {
    const auto p = reinterpret_cast<uintptr_t>(raw_.data());
    data_ = reinterpret_cast<T*>((p + 63) & ~static_cast<uintptr_t>(63));
  }
  T* data() { return data_; }

 private:
  struct alignas(8) Line { unsigned char b[64]; };
  std::vector<Line> raw_;
  T* data_;
};

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> bf16 bits, rounded to nearest even as torch's .to(torch.bfloat16) does, so a kernel
// that rounds its own output gives torch's bits; a NaN stays a NaN of the same sign (its top
// bits, made quiet). Every kernel that narrows float32 to bf16 uses these two.
inline uint16_t round_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// An element of float32 or bf16 storage read as float32 (exact) and written from it (bf16 by
// round_bf16), for code templated on the storage type.
inline float to_float(float v) { return v; }
inline float to_float(uint16_t h) { return bf16_to_float(h); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = round_bf16(v); }

// count floats -> bf16 bits (round_bf16's), at the widest vector width allowed (cpu_linear.cpp),
// on the calling thread.
void round_bf16_row(const float* y, int64_t count, uint16_t* out);

#if HR_X86
HR_AVX512 inline __m256i round_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i top = _mm512_srli_epi32(bits, 16);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_and_si512(top, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF))),
      16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// v rounded to bf16 and widened back to float32 (its low 16 bits zero).
HR_AVX512 inline __m512 through_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16x16(v)), 16));
}

// The same for 8 floats on AVX2 (round_bf16's bits; the packing saturates nothing, every rounded
// value lies in 0 .. 0xFFFF).
HR_AVX2 inline __m128i round_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(bits, 16);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_and_si256(top, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF))),
      16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
HR_AVX2 inline __m256 widen_bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
HR_AVX2 inline __m256 through_bf16x8(__m256 v) { return widen_bf16x8(round_bf16x8(v)); }

// The horizontal sum of 8 floats, one fixed tree: (l + l+4), then (l + l+2), then (l + l+1).
HR_AVX2 inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

HR_AVX2 inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Lanes 0 .. left - 1 of 8 (all-ones bits), for tails handled in a zero-padded copy.
HR_AVX2 inline __m256 first_lanes8(int64_t left) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// e^x for x <= 88 (below -87 clamped there: about 2^-125.5, never 0 or NaN): 2^n * e^r with
// |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error about 2e-7), 2^n built in the
// exponent bits (n >= -126: always a normal number).
HR_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// Rows per task so that each task streams at least ~64 KiB of weights (thread wake-up costs
// more than a smaller task saves).
inline int64_t grain_rows(int64_t row_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
}

// Rows of x per pass over the weights: a pass keeps its rows of x in L2 (about 256 KiB), so a
// prefill chunk streams the weights a few times instead of streaming x from L3 per weight row.
inline int64_t x_rows_per_pass(int64_t row_bytes) {
  return std::max<int64_t>(16, (256 << 10) / std::max<int64_t>(row_bytes, 1));
}

// Every kernel below computes y[i, r] = sum_k x[i, k] W[r, k] (times row_scale[r] for NVFP4)
// in one order per (r, i) that does not depend on n or on the other rows: each row of y is
// bit-identical to the same row computed alone, for any number of rows (batch_invariance.py).
// x and y are row-major [n, in] and [n, out]; uint16_t is bf16 bits.

// portable.cpp: plain loops, any CPU.
void nvfp4_linear_portable(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                           const float* row_scale, int64_t out, float* y);
void dense_linear_portable(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);
void dense_linear_portable(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

// avx2.cpp: 256-bit FMA on float32 x (bf16 weights widened exactly; bf16 x, for NVFP4 and for
// bf16 weights, widened as it is permuted).
void nvfp4_linear_avx2(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                       const float* row_scale, int64_t out, float* y);
void nvfp4_linear_avx2(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                       const float* row_scale, int64_t out, float* y);
void dense_linear_avx2(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);
void dense_linear_avx2(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);
void dense_linear_avx2(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

// nvfp4_avx512.cpp: E2M1 decoded by a vpermw table (unscaled, one block per lane), then
// vdpbf16ps on bf16 x (AVX512-BF16) or FMA on float32 x (AVX-512F, weights widened exactly),
// block scales after the dot products.
void nvfp4_linear_avx512(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                         const float* row_scale, int64_t out, float* y);
void nvfp4_linear_avx512_bf16(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                              const float* row_scale, int64_t out, float* y);
void nvfp4_dequant_rows_avx512(const uint8_t* codes, const uint8_t* scales, const float* row_scale, int64_t in,
                               int64_t r0, int64_t r1, float* w);
void row_scales(const uint8_t* s, int64_t nblocks, float* out);  // fp8 block scales -> float

// dense_avx512.cpp
void dense_linear_avx512(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);
void dense_linear_avx512(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);
void dense_linear_avx512_bf16(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

// nvfp4_int8.cpp: NVFP4 weights times int8 activations (each block of 16 quantised with its own
// scale), for the drafter on CPUs without AVX-512; the layout of a quantised row is that file's.
// The portable loops and the AVX2 kernel give the same bits. y has y_stride floats a row and
// gets weight rows r0 .. r1 - 1 in its columns 0 .. r1 - r0 - 1.
constexpr int64_t kI8Group = 64, kI8GroupBytes = 128;
inline int64_t i8_groups(int64_t in) { return (in + kI8Group - 1) / kI8Group; }
void quantize_i8_portable(const float* x, int64_t in, uint8_t* out);
void nvfp4_i8_rows_portable(const uint8_t* xq, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                            const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t y_stride);
void quantize_i8_avx2(const float* x, int64_t in, uint8_t* out);
void nvfp4_i8_rows_avx2(const uint8_t* xq, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                        const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t y_stride);

// amx.cpp (bf16 x)
void nvfp4_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                      const float* row_scale, int64_t out, float* y);
void dense_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y);

}  // namespace hetero_run_cpu
