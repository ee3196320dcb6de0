// The AVX-512 dot-product block every AVX-512 linear kernel ends in: R weight rows against G
// rows of x, both laid out the same way along the inputs (dense weights and x as they are;
// decoded NVFP4 tiles and x permuted alike, see nvfp4_avx512.cpp).
#pragma once

#include <immintrin.h>

#include <array>
#include <utility>

#include "cpu_kernels.h"

namespace hetero_run_cpu {

// How one (x type, w type) pair loads V inputs and accumulates their V products into 16 floats.
struct Bf16Dot {  // bf16 x, bf16 w: 32 products per vdpbf16ps, exact products, fp32 sums
  using X = uint16_t;
  using W = uint16_t;
  static constexpr int V = 32;
  static HR_AVX512 inline __m512i load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static HR_AVX512 inline __m512i load(const uint16_t* p, int64_t left) {
    return _mm512_maskz_loadu_epi16(left >= V ? ~__mmask32{0} : static_cast<__mmask32>((1ull << left) - 1), p);
  }
  static HR_AVX512BF16 inline __m512 fma(__m512 acc, __m512i w, __m512i x) {
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

// 16 vectors -> their 16 horizontal sums, each summed by _mm512_reduce_add_ps's own tree (lanes
// l + l+8, then l + l+4, l + l+2, l + l+1), so a sum's bits do not depend on which vectors are
// reduced with it; three times fewer operations than 16 reductions. The sum of v[4e + k] lands
// in lane 4k + e.
HR_AVX512 inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 u[8], s[4], w[2];
  for (int m = 0; m < 8; ++m)
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; ++p)
    s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0xDD));
  for (int t = 0; t < 2; ++t)
    w[t] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * t], s[2 * t + 1], 0x44), _mm512_shuffle_ps(s[2 * t], s[2 * t + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

// sums[j] = the horizontal sum of v[j], j < count (at most 16), by one tree whatever count is.
template <int count>
HR_AVX512 inline void reduce_all(const __m512 (&v)[count], float* sums) {
  if constexpr (count <= 4) {  // few: one at a time is cheaper than the network
    for (int j = 0; j < count; ++j) sums[j] = _mm512_reduce_add_ps(v[j]);
  } else {
    __m512 all[16];
    for (int j = 0; j < 16; ++j) all[j] = j < count ? v[j] : _mm512_setzero_ps();
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, reduce16(all));
    for (int j = 0; j < count; ++j) sums[j] = lanes[4 * (j % 4) + j / 4];
  }
}

// y[i * out + q] = (sum over `len` inputs of w[q * ldw + k] * x[i * ldx + k]) * scale[q] (no scale: 1).
// Every (q, i) pair sums in this one order, whatever R and G are: two accumulators over k in
// steps of 2V, the tail in steps of V into the first, then a0 + a1 reduced by reduce_all's tree.
// So a row of x gets the same bits whichever rows share its block. Two accumulators keep a
// decode's single weight row (one chain per accumulator) near the memory's speed; a block holds
// up to 4 x 3 pairs (24 accumulators, 4 weight vectors, one x vector). Compiled for AVX512-BF16
// because the Bf16Dot instantiation needs it; the Fp32Fma ones use nothing beyond AVX-512F/BW
// and run wherever AVX-512 does.
template <typename T, int R, int G>
HR_AVX512BF16 void dot_block(const typename T::W* w, int64_t ldw, const typename T::X* x, int64_t ldx, int64_t len,
                             const float* scale, float* y, int64_t out) {
  __m512 acc[R][G][2];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i][0] = acc[q][i][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * T::V <= len; k += 2 * T::V) {
    for (int j = 0; j < 2; ++j) {
      decltype(T::load(w)) wv[R];
      for (int q = 0; q < R; ++q) wv[q] = T::load(w + q * ldw + k + j * T::V);
      for (int i = 0; i < G; ++i) {
        const auto xv = T::load(x + i * ldx + k + j * T::V);
        for (int q = 0; q < R; ++q) acc[q][i][j] = T::fma(acc[q][i][j], wv[q], xv);
      }
    }
  }
  for (; k < len; k += T::V) {
    for (int i = 0; i < G; ++i) {
      const auto xv = T::load(x + i * ldx + k, len - k);
      for (int q = 0; q < R; ++q) acc[q][i][0] = T::fma(acc[q][i][0], T::load(w + q * ldw + k, len - k), xv);
    }
  }
  __m512 sum[R * G];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) sum[q * G + i] = _mm512_add_ps(acc[q][i][0], acc[q][i][1]);
  float res[R * G];
  reduce_all<R * G>(sum, res);
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) y[i * out + q] = scale ? res[q * G + i] * scale[q] : res[q * G + i];
}

// dot_block's sums, computed in two phases: first every first accumulator (the even steps of V,
// then the tail), spilled, then every second one (the odd steps), so a block needs only one
// accumulator per pair in registers and holds 4 x 4 pairs: 8 loads per 16 dot products, near the
// dot-product throughput for many rows of x. Each accumulator adds the same values in the same
// order as in dot_block, so the results are bit-identical.
template <typename T, int R, int G>
HR_AVX512BF16 void dot_block_phased(const typename T::W* w, int64_t ldw, const typename T::X* x, int64_t ldx,
                                    int64_t len, const float* scale, float* y, int64_t out) {
  __m512 first[R * G], acc[R * G];
  const int64_t steps = len / (2 * T::V) * (2 * T::V);
  for (int phase = 0; phase < 2; ++phase) {
    for (int j = 0; j < R * G; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t k = phase * T::V; k < steps; k += 2 * T::V) {
      decltype(T::load(w)) wv[R];
      for (int q = 0; q < R; ++q) wv[q] = T::load(w + q * ldw + k);
      for (int i = 0; i < G; ++i) {
        const auto xv = T::load(x + i * ldx + k);
        for (int q = 0; q < R; ++q) acc[q * G + i] = T::fma(acc[q * G + i], wv[q], xv);
      }
    }
    if (phase == 0) {
      for (int64_t k = steps; k < len; k += T::V) {
        for (int i = 0; i < G; ++i) {
          const auto xv = T::load(x + i * ldx + k, len - k);
          for (int q = 0; q < R; ++q) acc[q * G + i] = T::fma(acc[q * G + i], T::load(w + q * ldw + k, len - k), xv);
        }
      }
      for (int j = 0; j < R * G; ++j) first[j] = acc[j];
    }
  }
  __m512 sum[R * G];
  for (int j = 0; j < R * G; ++j) sum[j] = _mm512_add_ps(first[j], acc[j]);
  float res[R * G];
  reduce_all<R * G>(sum, res);
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) y[i * out + q] = scale ? res[q * G + i] * scale[q] : res[q * G + i];
}

template <typename T>
using DotBlock = void (*)(const typename T::W*, int64_t, const typename T::X*, int64_t, int64_t, const float*, float*,
                          int64_t);

// dot_block<T, R, g> for g = 1 .. G, by g - 1.
template <typename T, int R, int... g>
constexpr std::array<DotBlock<T>, sizeof...(g)> dot_blocks(std::integer_sequence<int, g...>) {
  return {&dot_block<T, R, g + 1>...};
}

// R weight rows (starting at output row r) against all n rows of x, G at a time, the rest in one
// block of fewer: y[i, r + q] = res * scale[q] (no scale: res). Same order per pair whatever the
// grouping. The rest's block is looked up, not reached through a chain of calls for G - 1, G - 2,
// ...: called once per weight row, that chain cost 0.6 ms of a one-row step (the 151936-row lm_head).
template <typename T, int R, int G>
void rows_times_x(const typename T::W* w, int64_t ldw, const typename T::X* x, int64_t ldx, int64_t n, int64_t len,
                  int64_t r, const float* scale, float* y, int64_t out) {
  static constexpr auto blocks = dot_blocks<T, R>(std::make_integer_sequence<int, G>{});
  int64_t i0 = 0;
  for (; i0 + G <= n; i0 += G) dot_block<T, R, G>(w, ldw, x + i0 * ldx, ldx, len, scale, y + i0 * out + r, out);
  if (i0 < n) blocks[n - i0 - 1](w, ldw, x + i0 * ldx, ldx, len, scale, y + i0 * out + r, out);
}

// Four weight rows against n rows of x, four at a time by dot_block_phased, the rest by dot_block.
template <typename T>
void four_rows_times_x(const typename T::W* w, int64_t ldw, const typename T::X* x, int64_t ldx, int64_t n,
                       int64_t len, int64_t r, float* y, int64_t out) {
  int64_t i0 = 0;
  for (; i0 + 4 <= n; i0 += 4) dot_block_phased<T, 4, 4>(w, ldw, x + i0 * ldx, ldx, len, nullptr, y + i0 * out + r, out);
  if (i0 < n) rows_times_x<T, 4, 3>(w, ldw, x + i0 * ldx, ldx, n - i0, len, r, nullptr, y + i0 * out, out);
}

}  // namespace hetero_run_cpu
