// x @ W.T with AVX2 + FMA (CPUs without AVX-512): float32 x, 256-bit FMA, fp32 sums.
// Dense bf16 weights widen exactly; NVFP4 rows decode to exact float32 tiles (E2M1 magnitude
// looked up with vpermps, the sign moved into place, times the fp8 block scale: at most 6
// significant bits) in natural order, then multiply like dense rows. bf16 x arrives widened.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

namespace hetero_run_cpu {
namespace {

template <typename Wt>
struct Avx2Fma {
  using W = Wt;
  static constexpr int V = 8;
  static HR_AVX2 inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static HR_AVX2 inline __m256 load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  template <typename P>
  static HR_AVX2 inline __m256 load(const P* p, int64_t left) {  // fewer than V left: zero-padded copy
    P part[V] = {};
    for (int64_t k = 0; k < left; ++k) part[k] = p[k];
    return load(part);
  }
};

// As rows_avx512.h's dot_block: two accumulators over k in steps of 2V, the tail in steps of V
// into the first, then a0 + a1 reduced; one order per (weight row, x row) whatever R, G and n.
// Registers: R * G * 2 accumulators + R weight vectors + one x vector, at most 15 of 16.
template <typename T, int R, int G>
HR_AVX2 inline void dot_block(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t len,
                              float (&res)[R][G]) {
  __m256 acc[R][G][2];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i][0] = acc[q][i][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * T::V <= len; k += 2 * T::V) {
    for (int j = 0; j < 2; ++j) {
      __m256 wv[R];
      for (int q = 0; q < R; ++q) wv[q] = T::load(w + q * ldw + k + j * T::V);
      for (int i = 0; i < G; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + k + j * T::V);
        for (int q = 0; q < R; ++q) acc[q][i][j] = _mm256_fmadd_ps(wv[q], xv, acc[q][i][j]);
      }
    }
  }
  for (; k < len; k += T::V) {
    const int64_t left = len - k;
    for (int i = 0; i < G; ++i) {
      const __m256 xv = left >= T::V ? _mm256_loadu_ps(x + i * ldx + k) : T::load(x + i * ldx + k, left);
      for (int q = 0; q < R; ++q) {
        const __m256 wv = left >= T::V ? T::load(w + q * ldw + k) : T::load(w + q * ldw + k, left);
        acc[q][i][0] = _mm256_fmadd_ps(wv, xv, acc[q][i][0]);
      }
    }
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) res[q][i] = reduce8(_mm256_add_ps(acc[q][i][0], acc[q][i][1]));
}

template <typename T, int R, int G>
void rows_times_x(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, int64_t len, int64_t r,
                  const float* scale, float* y, int64_t out) {
  int64_t i0 = 0;
  for (; i0 + G <= n; i0 += G) {
    float res[R][G];
    dot_block<T, R, G>(w, ldw, x + i0 * ldx, ldx, len, res);
    for (int q = 0; q < R; ++q)
      for (int i = 0; i < G; ++i) y[(i0 + i) * out + r + q] = scale ? res[q][i] * scale[q] : res[q][i];
  }
  if constexpr (G > 1) {
    if (i0 < n) rows_times_x<T, R, G - 1>(w, ldw, x + i0 * ldx, ldx, n - i0, len, r, scale, y + i0 * out, out);
  }
}

constexpr int64_t kBlockedAbove = 16 << 10;  // bytes of x: half of L1

template <typename Wt>
void dense_impl(const float* x, int64_t n, int64_t in, const Wt* w, int64_t out, float* y) {
  using T = Avx2Fma<Wt>;
  const int64_t x_row = in * 4;
  const bool blocked = n > 1 && n * x_row > kBlockedAbove;
  const int64_t pass = x_rows_per_pass(x_row);
  at::parallel_for(0, out, grain_rows(in * static_cast<int64_t>(sizeof(Wt))), [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < n; i0 += pass) {
      const int64_t m = std::min(pass, n - i0);
      int64_t r = r0;
      if (blocked)
        for (; r + 2 <= r1; r += 2) rows_times_x<T, 2, 3>(w + r * in, in, x + i0 * in, in, m, in, r, nullptr, y + i0 * out, out);
      for (; r < r1; ++r) rows_times_x<T, 1, 4>(w + r * in, in, x + i0 * in, in, m, in, r, nullptr, y + i0 * out, out);
    }
  });
}

// Rows r .. r + rows - 1 as exact float32, natural order: tile [rows][in].
HR_AVX2 void decode_rows(const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t r, int64_t rows,
                         float* tile) {
  const float* fp8 = fp8_table();
  const __m256 magnitude = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t q = 0; q < rows; ++q) {
    const uint8_t* c = codes + (r + q) * (in / 2);
    const uint8_t* s = scales + (r + q) * (in / kGroup);
    float* t = tile + q * in;
    for (int64_t k = 0; k < in; k += 8) {  // 4 bytes: nibble m is element k + m
      int32_t word;
      std::memcpy(&word, c + k / 2, 4);
      const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);  // code in bits 0-3
      const __m256 mag = _mm256_permutevar8x32_ps(magnitude, nib);             // uses bits 0-2
      const __m256i sgn = _mm256_and_si256(_mm256_slli_epi32(nib, 28), sign);  // bit 3 -> bit 31
      const __m256 v = _mm256_or_ps(mag, _mm256_castsi256_ps(sgn));
      _mm256_storeu_ps(t + k, _mm256_mul_ps(v, _mm256_set1_ps(fp8[s[k / kGroup]])));
    }
  }
}

}  // namespace

void dense_linear_avx2(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  dense_impl(x, n, in, w, out, y);
}

void dense_linear_avx2(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_impl(x, n, in, w, out, y);
}

void nvfp4_linear_avx2(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                       const float* row_scale, int64_t out, float* y) {
  using T = Avx2Fma<float>;
  const int64_t tile_rows = n <= 4 ? 4 : 16;
  const int64_t grain = (grain_rows(in / 2 + in / kGroup) + tile_rows - 1) / tile_rows * tile_rows;
  const int64_t pass = x_rows_per_pass(in * 4);
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> tile(tile_rows * in);
    for (int64_t r = r0; r < r1; r += tile_rows) {
      const int64_t rows = std::min(tile_rows, r1 - r);
      decode_rows(codes, scales, in, r, rows, tile.data());
      for (int64_t i0 = 0; i0 < n; i0 += pass) {
        const int64_t m = std::min(pass, n - i0);
        int64_t q = 0;
        for (; q + 2 <= rows; q += 2)
          rows_times_x<T, 2, 3>(tile.data() + q * in, in, x + i0 * in, in, m, in, r + q, row_scale + r + q,
                                y + i0 * out, out);
        for (; q < rows; ++q)
          rows_times_x<T, 1, 4>(tile.data() + q * in, in, x + i0 * in, in, m, in, r + q, row_scale + r + q,
                                y + i0 * out, out);
      }
    }
  });
}

}  // namespace hetero_run_cpu
#endif
