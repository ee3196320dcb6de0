// Dense (bf16 / fp32 weights) x @ W.T with AVX-512: exact widening of bf16 for float32 x,
// vdpbf16ps for bf16 x.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

#include <type_traits>

namespace hetero_run_cpu {
namespace {

template <typename W>
HR_AVX512 inline __m512 load16_as_float(const W* p, __mmask16 m);

template <>
HR_AVX512 inline __m512 load16_as_float<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <>
HR_AVX512 inline __m512 load16_as_float<uint16_t>(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 x; weights float32 or bf16 (widened exactly). R rows x N x-rows.
template <typename W, int N, int R>
HR_AVX512 void dense_block_f32(const float* x, int64_t in, const W* w, int64_t r0, float* y, int64_t out) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 16) {
    const __mmask16 m = in - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (in - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + 2 * R + r) * in + k), _MM_HINT_T0);
      wv[r] = load16_as_float<W>(w + (r0 + r) * in + k, m);
    }
    for (int i = 0; i < N; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * in + k);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) y[i * out + r0 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

// bf16 x and bf16 weights: 32 products per vdpbf16ps, accumulated in float32.
template <int N, int R>
HR_AVX512BF16 void dense_block_bf16(const uint16_t* x, int64_t in, const uint16_t* w, int64_t r0, float* y,
                                    int64_t out) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    const __mmask32 m = in - k >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1ull << (in - k)) - 1);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + 2 * R + r) * in + k), _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_epi16(m, w + (r0 + r) * in + k);
    }
    for (int i = 0; i < N; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * in + k);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) y[i * out + r0 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int N, typename X, typename W>
void dense_rows_avx512(const X* x, int64_t in, const W* w, int64_t r0, int64_t r1, float* y, int64_t out) {
  constexpr int R = N <= 2 ? 4 : 2;
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    if constexpr (std::is_same_v<X, float>)
      dense_block_f32<W, N, R>(x, in, w, r, y, out);
    else
      dense_block_bf16<N, R>(x, in, w, r, y, out);
  }
  for (; r < r1; ++r) {
    if constexpr (std::is_same_v<X, float>)
      dense_block_f32<W, N, 1>(x, in, w, r, y, out);
    else
      dense_block_bf16<N, 1>(x, in, w, r, y, out);
  }
}

template <typename X, typename W>
void dense_linear_impl(const X* x, int64_t n, int64_t in, const W* w, int64_t out, float* y) {
  const int64_t grain = grain_rows(in * static_cast<int64_t>(sizeof(W)));
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < n; i0 += kMaxBatch) {
      const int64_t nb = std::min<int64_t>(kMaxBatch, n - i0);
      const X* xi = x + i0 * in;
      float* yi = y + i0 * out;
      switch (nb) {
        case 1: dense_rows_avx512<1>(xi, in, w, r0, r1, yi, out); break;
        case 2: dense_rows_avx512<2>(xi, in, w, r0, r1, yi, out); break;
        case 3: dense_rows_avx512<3>(xi, in, w, r0, r1, yi, out); break;
        case 4: dense_rows_avx512<4>(xi, in, w, r0, r1, yi, out); break;
        case 5: dense_rows_avx512<5>(xi, in, w, r0, r1, yi, out); break;
        case 6: dense_rows_avx512<6>(xi, in, w, r0, r1, yi, out); break;
        case 7: dense_rows_avx512<7>(xi, in, w, r0, r1, yi, out); break;
        default: dense_rows_avx512<8>(xi, in, w, r0, r1, yi, out); break;
      }
    }
  });
}

}  // namespace

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  dense_linear_impl(x, n, in, w, out, y);
}

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl(x, n, in, w, out, y);
}

void dense_linear_avx512(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl(x, n, in, w, out, y);
}

}  // namespace hetero_run_cpu
#endif
