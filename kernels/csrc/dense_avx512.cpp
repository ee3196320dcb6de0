// Dense (bf16 / fp32 weights) x @ W.T with AVX-512: exact widening of bf16 for float32 x,
// vdpbf16ps for bf16 x.
//
// For one x row (a decode step) each thread walks its output rows one weight row at a time, so
// its weights arrive as one sequential stream: the hardware prefetchers keep such a stream at
// the memory's bandwidth, while several rows read side by side, 1-2 KiB apart, fall well short
// of it (about 31 against 22 GB/s on a 2-core Zen 4). The weight rows meet every row of x while
// they sit in L1, so the weights stream once whatever n is.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

namespace hetero_run_cpu {
namespace {

// How one (x type, w type) pair loads V inputs and accumulates their V products into 16 floats.
struct Bf16Dot {  // bf16 x, bf16 w: 32 products per vdpbf16ps
  using X = uint16_t;
  using W = uint16_t;
  using Vec = __m512i;
  static constexpr int V = 32;
  static HR_AVX512 inline Vec load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static HR_AVX512 inline Vec load(const uint16_t* p, int64_t left) {
    return _mm512_maskz_loadu_epi16(left >= V ? ~__mmask32{0} : static_cast<__mmask32>((1ull << left) - 1), p);
  }
  static HR_AVX512BF16 inline __m512 fma(__m512 acc, Vec w, Vec x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};

template <typename Wt>
struct Fp32Fma {  // float32 x; float32 w, or bf16 w widened exactly: 16 FMAs
  using X = float;
  using W = Wt;
  static constexpr int V = 16;
  static HR_AVX512 inline __mmask16 mask(int64_t left) {
    return left >= V ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  }
  static HR_AVX512 inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static HR_AVX512 inline __m512 load(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(mask(left), p); }
  static HR_AVX512 inline __m512 load(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static HR_AVX512 inline __m512 load(const uint16_t* p, int64_t left) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask(left), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static HR_AVX512 inline __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

// Weight rows r .. r + R - 1 against x rows i0 .. i0 + G - 1. Every (weight row, x row) pair
// sums in this one order, whatever R, G and n are: two accumulators over k in steps of 2V, the
// tail in steps of V into the first, then a0 + a1 reduced. So row i of an n-row product equals
// the one-row product bit for bit (batch_invariance.py). Compiled for AVX-512 BF16 because the
// Bf16Dot instantiation needs it; the Fp32Fma ones use nothing beyond AVX-512F/BW and run
// wherever has_avx512() holds.
template <typename T, int R, int G>
HR_AVX512BF16 void rows_times_x(const typename T::W* w, const typename T::X* x, int64_t in, int64_t r, int64_t i0,
                                float* y, int64_t out) {
  __m512 acc[R][G][2];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i][0] = acc[q][i][1] = _mm512_setzero_ps();
  const typename T::W* wr = w + r * in;
  const typename T::X* xs = x + i0 * in;
  int64_t k = 0;
  for (; k + 2 * T::V <= in; k += 2 * T::V) {
    for (int j = 0; j < 2; ++j) {
      decltype(T::load(wr)) wv[R];
      for (int q = 0; q < R; ++q) wv[q] = T::load(wr + q * in + k + j * T::V);
      for (int i = 0; i < G; ++i) {
        const auto xv = T::load(xs + i * in + k + j * T::V);
        for (int q = 0; q < R; ++q) acc[q][i][j] = T::fma(acc[q][i][j], wv[q], xv);
      }
    }
  }
  for (; k < in; k += T::V) {
    for (int i = 0; i < G; ++i) {
      const auto xv = T::load(xs + i * in + k, in - k);
      for (int q = 0; q < R; ++q) acc[q][i][0] = T::fma(acc[q][i][0], T::load(wr + q * in + k, in - k), xv);
    }
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) y[(i0 + i) * out + r + q] = _mm512_reduce_add_ps(_mm512_add_ps(acc[q][i][0], acc[q][i][1]));
}

// One weight row against x in passes of up to four rows (a single weight stream), or, once x
// no longer fits in half of L1, four weight rows against x in passes of up to three rows, so x,
// read from L2, is read a quarter as often (for 5 rows of 4864 inputs about 25 against 16 GB/s).
// Registers: G * R * 2 accumulators + R weight vectors + one x vector, at most 29 of 32.
template <typename T, int R, int G>
void rows_times_all_x(const typename T::W* w, const typename T::X* x, int64_t n, int64_t in, int64_t r, float* y,
                      int64_t out) {
  int64_t i0 = 0;
  for (; i0 + G <= n; i0 += G) rows_times_x<T, R, G>(w, x, in, r, i0, y, out);
  switch (n - i0) {
    case 1: rows_times_x<T, R, 1>(w, x, in, r, i0, y, out); break;
    case 2: rows_times_x<T, R, 2>(w, x, in, r, i0, y, out); break;
    case 3: if constexpr (G > 3) rows_times_x<T, R, 3>(w, x, in, r, i0, y, out); break;
    default: break;
  }
}

constexpr int64_t kBlockedAbove = 16 << 10;  // bytes of x: half of L1

template <typename T>
void dense_linear_impl(const typename T::X* x, int64_t n, int64_t in, const typename T::W* w, int64_t out, float* y) {
  const int64_t grain = grain_rows(in * static_cast<int64_t>(sizeof(typename T::W)));
  const bool blocked = n > 1 && n * in * static_cast<int64_t>(sizeof(typename T::X)) > kBlockedAbove;
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
    if (blocked)
      for (; r + 4 <= r1; r += 4) rows_times_all_x<T, 4, 3>(w, x, n, in, r, y, out);
    for (; r < r1; ++r) rows_times_all_x<T, 1, 4>(w, x, n, in, r, y, out);
  });
}

}  // namespace

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  dense_linear_impl<Fp32Fma<float>>(x, n, in, w, out, y);
}

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl<Fp32Fma<uint16_t>>(x, n, in, w, out, y);
}

void dense_linear_avx512(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl<Bf16Dot>(x, n, in, w, out, y);
}

}  // namespace hetero_run_cpu
#endif
