// x @ W.T with AVX2 + FMA (CPUs without AVX-512): float32 x, 256-bit FMA, fp32 sums.
// Dense bf16 weights widen exactly. NVFP4 weights decode to exact float32 (E2M1 by byte lookups,
// times the fp8 block scale: at most 6 significant bits) in an order x is permuted to match:
// for up to 4 rows of x in registers, against each row as it is decoded; for more, into a tile
// that every group of x rows reads. Both sum in one order, so the bits do not depend on n. bf16
// x arrives widened.
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

// Up to this many rows of x each weight row streams once against groups of up to 6 rows (12
// accumulators); more rows take two weight rows against 3 rows of x at a time, sharing each x
// load. On a Zen 3 core the pairs cost more below this: 5 rows of the bf16 lm_head 21-34 ms
// paired against 15-17 ms one row at a time (one row: 12 ms).
constexpr int64_t kPairedAbove = 12;

template <typename Wt>
void dense_impl(const float* x, int64_t n, int64_t in, const Wt* w, int64_t out, float* y) {
  using T = Avx2Fma<Wt>;
  const int64_t pass = x_rows_per_pass(in * 4);
  at::parallel_for(0, out, grain_rows(in * static_cast<int64_t>(sizeof(Wt))), [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < n; i0 += pass) {
      const int64_t m = std::min(pass, n - i0);
      int64_t r = r0;
      if (m > kPairedAbove)
        for (; r + 2 <= r1; r += 2) rows_times_x<T, 2, 3>(w + r * in, in, x + i0 * in, in, m, in, r, nullptr, y + i0 * out, out);
      for (; r < r1; ++r) rows_times_x<T, 1, 6>(w + r * in, in, x + i0 * in, in, m, in, r, nullptr, y + i0 * out, out);
    }
  });
}

// NVFP4 codes -> exact float32 E2M1 values, by two byte lookups (vpshufb) per 32 weights: a
// code's float32 has only its top two bytes set (sign, exponent and one mantissa bit), one
// table gives byte 3 and one byte 2. The 16 code bytes of 32 weights are broadcast to both
// 128-bit lanes, the low nibbles kept in lane 0 and the high ones in lane 1 (elements 2b and
// 2b + 1 of byte b); interleaving the looked-up bytes makes bf16 words, and a word shifted up
// (even words) or masked (odd words) is its float32. Per 32 weights the vectors hold elements
//   v0 = {0, 4, 8, 12, 1, 5, 9, 13}, v1 = {2, 6, 10, 14, 3, 7, 11, 15}, v2, v3 = those + 16,
// so v0, v1 are block 0 and v2, v3 block 1; x is permuted once per call to match (kPerm).
// About 10 vector operations per 32 weights where a vpermps per 8 took about 24.
constexpr int kPerm[32] = {0,  4,  8,  12, 1,  5,  9,  13, 2,  6,  10, 14, 3,  7,  11, 15,
                           16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31};

struct E2M1Decoder {
  __m256i low, high, shifts, nibble, top;
  HR_AVX2 E2M1Decoder() {
    alignas(16) uint8_t lo[16], hi[16];
    for (int c = 0; c < 16; ++c) {
      uint32_t bits;
      std::memcpy(&bits, &kE2M1[c], 4);
      lo[c] = static_cast<uint8_t>(bits >> 16);
      hi[c] = static_cast<uint8_t>(bits >> 24);
    }
    low = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lo)));
    high = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(hi)));
    shifts = _mm256_setr_epi64x(0, 0, 4, 4);
    nibble = _mm256_set1_epi8(15);
    top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  }
  // Codes of 32 weights (16 bytes) -> v[0..3]; of 16 (8 bytes, `half`) -> v[0..1].
  template <bool half = false>
  HR_AVX2 inline void operator()(const uint8_t* c, __m256* v) const {
    const __m128i bytes = half ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))
                               : _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(bytes), shifts), nibble);
    const __m256i lo = _mm256_shuffle_epi8(low, codes), hi = _mm256_shuffle_epi8(high, codes);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, top));
    if (!half) {
      const __m256i w1 = _mm256_unpackhi_epi8(lo, hi);
      v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      v[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, top));
    }
  }
  // Weights k .. k + 31 (k + 15, `half`) of the row with codes c and block scales s, times their
  // blocks' fp8 scales (fp8: fp8_table()).
  template <bool half = false>
  HR_AVX2 inline void scaled(const float* fp8, const uint8_t* c, const uint8_t* s, int64_t k, __m256* v) const {
    operator()<half>(c + k / 2, v);
    const __m256 s0 = _mm256_broadcast_ss(fp8 + s[k / kGroup]);
    v[0] = _mm256_mul_ps(v[0], s0);
    v[1] = _mm256_mul_ps(v[1], s0);
    if (!half) {
      const __m256 s1 = _mm256_broadcast_ss(fp8 + s[k / kGroup + 1]);
      v[2] = _mm256_mul_ps(v[2], s1);
      v[3] = _mm256_mul_ps(v[3], s1);
    }
  }
};

// x [n, in] (float32, or bf16 widened here) -> xp in the decoder's order, 32 elements at a time
// (a last 16 take the first half of the pattern, which stays within them).
template <typename X>
void permute_x(const X* x, int64_t n, int64_t in, float* xp) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < in; k += 32) {
      const int64_t m = std::min<int64_t>(32, in - k);
      for (int64_t p = 0; p < m; ++p) xp[i * in + k + p] = to_float(x[i * in + k + kPerm[p]]);
    }
}

// Weight rows r .. r + R - 1 times G rows of permuted x, decoded in registers (R * G * 2
// accumulators; the same sums, in the same order, as rows_times_x over decode_rows' tile). Each
// row asks for its codes `ahead` bytes ahead and its scales as far ahead in their stream (long
// rows of a one-row product from memory: 3.2 against 3.7 ns per 32 weights on a Zen 3 core).
template <int R, int G>
HR_AVX2 void rows_in_registers(const E2M1Decoder& dec, const uint8_t* codes, const uint8_t* scales, int64_t in,
                               int64_t r, const float* xp, const float* row_scale, float* y, int64_t out,
                               int64_t ahead) {
  const E2M1Decoder d = dec;
  const float* fp8 = fp8_table();
  __m256 acc[R][G][2];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i][0] = acc[q][i][1] = _mm256_setzero_ps();
  const uint8_t* c[R];
  const uint8_t* s[R];
  for (int q = 0; q < R; ++q) {
    c[q] = codes + (r + q) * (in / 2);
    s[q] = scales + (r + q) * (in / kGroup);
  }
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m256 v[R][4];
    if ((k & 127) == 0)
      for (int q = 0; q < R; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(c[q] + k / 2 + ahead), _MM_HINT_T0);
        if ((k & 1023) == 0) _mm_prefetch(reinterpret_cast<const char*>(s[q] + k / kGroup + ahead / 8), _MM_HINT_T0);
      }
    for (int q = 0; q < R; ++q) d.scaled(fp8, c[q], s[q], k, v[q]);
    for (int i = 0; i < G; ++i)
      for (int j = 0; j < 4; ++j) {
        const __m256 xv = _mm256_load_ps(xp + i * in + k + 8 * j);
        for (int q = 0; q < R; ++q) acc[q][i][j & 1] = _mm256_fmadd_ps(v[q][j], xv, acc[q][i][j & 1]);
      }
  }
  if (k < in) {  // a last block of 16
    __m256 v[R][4];
    for (int q = 0; q < R; ++q) d.scaled<true>(fp8, c[q], s[q], k, v[q]);
    for (int i = 0; i < G; ++i)
      for (int j = 0; j < 2; ++j) {
        const __m256 xv = _mm256_load_ps(xp + i * in + k + 8 * j);
        for (int q = 0; q < R; ++q) acc[q][i][j] = _mm256_fmadd_ps(v[q][j], xv, acc[q][i][j]);
      }
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) y[i * out + r + q] = reduce8(_mm256_add_ps(acc[q][i][0], acc[q][i][1])) * row_scale[r + q];
}

// Rows r .. r + rows - 1 as exact float32 in the decoder's order: tile [rows][in].
HR_AVX2 void decode_rows(const E2M1Decoder& d, const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t r,
                         int64_t rows, float* tile) {
  const float* fp8 = fp8_table();
  for (int64_t q = 0; q < rows; ++q) {
    const uint8_t* c = codes + (r + q) * (in / 2);
    const uint8_t* s = scales + (r + q) * (in / kGroup);
    float* t = tile + q * in;
    int64_t k = 0;
    __m256 v[4];
    for (; k + 32 <= in; k += 32) {
      d.scaled(fp8, c, s, k, v);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(t + k + 8 * j, v[j]);
    }
    if (k < in) {
      d.scaled<true>(fp8, c, s, k, v);
      for (int j = 0; j < 2; ++j) _mm256_store_ps(t + k + 8 * j, v[j]);
    }
  }
}

// Up to this many rows of x, each weight row is decoded in registers once per call; more rows
// are worth a decoded tile in L1 that every group of x rows reads.
constexpr int64_t kRegisterRowsMax = 4;

template <int G>
void nvfp4_registers(const E2M1Decoder& d, const float* xp, int64_t in, const uint8_t* codes, const uint8_t* scales,
                     const float* row_scale, int64_t out, float* y) {
  const int64_t ahead = prefetch_ahead_bytes();
  at::parallel_for(0, out, grain_rows(in / 2 + in / kGroup), [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
    if constexpr (G == 1)
      for (; r + 2 <= r1; r += 2) rows_in_registers<2, 1>(d, codes, scales, in, r, xp, row_scale, y, out, ahead);
    for (; r < r1; ++r) rows_in_registers<1, G>(d, codes, scales, in, r, xp, row_scale, y, out, ahead);
  });
}

template <typename X>
void nvfp4_impl(const X* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                const float* row_scale, int64_t out, float* y) {
  using T = Avx2Fma<float>;
  const E2M1Decoder d;
  Aligned<float> permuted(n * in);
  float* xp = permuted.data();
  permute_x(x, n, in, xp);
  switch (n <= kRegisterRowsMax ? n : 0) {
    case 1: return nvfp4_registers<1>(d, xp, in, codes, scales, row_scale, out, y);
    case 2: return nvfp4_registers<2>(d, xp, in, codes, scales, row_scale, out, y);
    case 3: return nvfp4_registers<3>(d, xp, in, codes, scales, row_scale, out, y);
    case 4: return nvfp4_registers<4>(d, xp, in, codes, scales, row_scale, out, y);
    default: break;
  }
  const int64_t tile_rows = 16;
  const int64_t grain = (grain_rows(in / 2 + in / kGroup) + tile_rows - 1) / tile_rows * tile_rows;
  const int64_t pass = x_rows_per_pass(in * 4);
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    Aligned<float> tile(tile_rows * in);
    for (int64_t r = r0; r < r1; r += tile_rows) {
      const int64_t rows = std::min(tile_rows, r1 - r);
      decode_rows(d, codes, scales, in, r, rows, tile.data());
      for (int64_t i0 = 0; i0 < n; i0 += pass) {
        const int64_t m = std::min(pass, n - i0);
        int64_t q = 0;
        for (; q + 2 <= rows; q += 2)
          rows_times_x<T, 2, 3>(tile.data() + q * in, in, xp + i0 * in, in, m, in, r + q, row_scale + r + q,
                                y + i0 * out, out);
        for (; q < rows; ++q)
          rows_times_x<T, 1, 4>(tile.data() + q * in, in, xp + i0 * in, in, m, in, r + q, row_scale + r + q,
                                y + i0 * out, out);
      }
    }
  });
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
  nvfp4_impl(x, n, in, codes, scales, row_scale, out, y);
}

void nvfp4_linear_avx2(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                       const float* row_scale, int64_t out, float* y) {
  nvfp4_impl(x, n, in, codes, scales, row_scale, out, y);
}

}  // namespace hetero_run_cpu
#endif
