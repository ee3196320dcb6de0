// NVFP4 x @ W.T with AVX-512 for float32 x, and bit-exact dequantisation.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

namespace hetero_run_cpu {
namespace {

// A 64-byte load holds 128 codes; dword lane j holds elements 8j .. 8j+7 of the chunk (nibble m
// of the dword is element 8j + m). permutexvar_ps looks up a 16-entry table using only the low
// 4 bits of each lane, so `d >> 4m` indexes element 8j + m with no masking. x is re-laid out
// once per call to match: xp[chunk][m][j] = x[chunk*128 + 8j + m]. Block scales follow the
// same lanes: lane j belongs to block j / 2 of the chunk.
// Rows whose length is not a multiple of 128 finish in 32-element steps (lane k = byte k:
// low nibble = element 2k, high nibble = element 2k+1) and, if needed, one 16-element step.

struct Layout {
  int64_t in, main, tail32;  // main: elements in 128-chunks; tail32: further elements in 32-steps
  bool tail16;
  explicit Layout(int64_t in_) : in(in_), main(in_ / 128 * 128) {
    tail32 = (in - main) / 32 * 32;
    tail16 = (in - main - tail32) == 16;
  }
};

void permute_x(const float* x, int64_t n, const Layout& L, float* xp) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xr = x + i * L.in;
    float* pr = xp + i * L.in;
    for (int64_t c = 0; c < L.main; c += 128)
      for (int m = 0; m < 8; ++m)
        for (int j = 0; j < 16; ++j) pr[c + m * 16 + j] = xr[c + 8 * j + m];
    int64_t c = L.main;
    for (; c < L.main + L.tail32; c += 32)
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 16; ++k) pr[c + h * 16 + k] = xr[c + 2 * k + h];
    if (L.tail16)
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 8; ++k) pr[c + h * 8 + k] = xr[c + 2 * k + h];
  }
}

// 16 fp8 e4m3 bytes (mask selects the valid ones) -> 16 floats, exact, no denormal arithmetic:
// normal numbers by moving the bits into float32 position, subnormals as m * 2^-9.
HR_AVX512 inline __m512 fp8x16_to_float(const uint8_t* s, __mmask16 valid) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, s));
  const __m512i mag = _mm512_and_si512(d, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

HR_AVX512 void row_scales_avx512(const uint8_t* s, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; b += 16) {
    const int64_t left = std::min<int64_t>(16, nblocks - b);
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(out + b, m, fp8x16_to_float(s + b, m));
  }
}

// R output rows x N input rows, starting at row r0. `sbuf` holds R rows of float block scales.
template <int N, int R>
HR_AVX512 void nvfp4_block_avx512(const float* xp, const Layout& L, const uint8_t* codes, const uint8_t* scales,
                                  const float* row_scale, int64_t r0, float* y, int64_t out, float* sbuf) {
  const int64_t in = L.in, nblocks = in / kGroup;
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const uint8_t* cr[R];
  const float* sr[R];
  for (int r = 0; r < R; ++r) {
    for (int64_t b = 0; b < nblocks; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(scales + (r0 + 2 * R + r) * nblocks + b), _MM_HINT_T0);
    cr[r] = codes + (r0 + r) * (in / 2);
    sr[r] = sbuf + r * nblocks;
    row_scales_avx512(scales + (r0 + r) * nblocks, nblocks, sbuf + r * nblocks);
  }
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) acc[r][i] = _mm512_setzero_ps();

  for (int64_t c = 0; c < L.main; c += 128) {
    __m512i d[R];
    __m512 s[R];
    for (int r = 0; r < R; ++r) {
      // Rows are short (in/2 bytes), too short for the hardware prefetcher to run ahead of us.
      _mm_prefetch(reinterpret_cast<const char*>(cr[r] + c / 2 + 2 * R * (in / 2)), _MM_HINT_T0);
      d[r] = _mm512_loadu_si512(cr[r] + c / 2);
      s[r] = _mm512_permutexvar_ps(dup_lo, _mm512_castps256_ps512(_mm256_loadu_ps(sr[r] + c / kGroup)));
    }
    // Every x row accumulates in this order whatever N is (no cheaper order for N = 1): one
    // row's result must not depend on how many rows came with it.
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) {
      __m512 w[R];
      for (int r = 0; r < R; ++r) {
        const __m512i idx = _mm512_srli_epi32(d[r], 4 * m);
        w[r] = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), s[r]);
      }
      for (int i = 0; i < N; ++i) {
        const __m512 xv = _mm512_loadu_ps(xp + i * in + c + m * 16);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(w[r], xv, acc[r][i]);
      }
    }
  }
  int64_t c = L.main;
  for (; c < L.main + L.tail32; c += 32) {
    for (int r = 0; r < R; ++r) {
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cr[r] + c / 2)));
      const __m512 s2 = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(
                                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sr[r] + c / kGroup)))));
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s2);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s2);
      for (int i = 0; i < N; ++i) {
        acc[r][i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp + i * in + c), acc[r][i]);
        acc[r][i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + i * in + c + 16), acc[r][i]);
      }
    }
  }
  if (L.tail16) {
    for (int r = 0; r < R; ++r) {
      const __m512i d = _mm512_maskz_cvtepu8_epi32(0xFF, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cr[r] + c / 2)));
      const __m512 s1 = _mm512_set1_ps(sr[r][c / kGroup]);
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s1);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s1);
      for (int i = 0; i < N; ++i) {
        acc[r][i] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(0xFF, xp + i * in + c), acc[r][i]);
        acc[r][i] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(0xFF, xp + i * in + c + 8), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) y[i * out + r0 + r] = _mm512_reduce_add_ps(acc[r][i]) * row_scale[r0 + r];
}

template <int N>
void nvfp4_rows_avx512(const float* xp, const Layout& L, const uint8_t* codes, const uint8_t* scales,
                       const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t out) {
  // More rows per step when few x rows: independent accumulators hide FMA latency and every
  // x load feeds R rows.
  constexpr int R = N <= 2 ? 4 : 2;
  std::vector<float> sbuf(R * (L.in / kGroup));
  int64_t r = r0;
  for (; r + R <= r1; r += R) nvfp4_block_avx512<N, R>(xp, L, codes, scales, row_scale, r, y, out, sbuf.data());
  for (; r < r1; ++r) nvfp4_block_avx512<N, 1>(xp, L, codes, scales, row_scale, r, y, out, sbuf.data());
}

}  // namespace

void nvfp4_linear_avx512(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                         const float* row_scale, int64_t out, float* y) {
  const Layout L(in);
  std::vector<float> xp(n * in);
  permute_x(x, n, L, xp.data());
  const int64_t grain = grain_rows(in / 2 + in / kGroup);
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < n; i0 += kMaxBatch) {
      const int64_t nb = std::min<int64_t>(kMaxBatch, n - i0);
      const float* xpi = xp.data() + i0 * in;
      float* yi = y + i0 * out;
      switch (nb) {
        case 1: nvfp4_rows_avx512<1>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 2: nvfp4_rows_avx512<2>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 3: nvfp4_rows_avx512<3>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 4: nvfp4_rows_avx512<4>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 5: nvfp4_rows_avx512<5>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 6: nvfp4_rows_avx512<6>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        case 7: nvfp4_rows_avx512<7>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
        default: nvfp4_rows_avx512<8>(xpi, L, codes, scales, row_scale, r0, r1, yi, out); break;
      }
    }
  });
}

// Dequantise rows to float32 in natural order; same arithmetic as the reference
// (E2M1 * (block_scale * row_scale)), so results are bit-identical.
HR_AVX512 void nvfp4_dequant_rows_avx512(const uint8_t* codes, const uint8_t* scales, const float* row_scale,
                                         int64_t in, int64_t r0, int64_t r1, float* w) {
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  // lo holds even elements, hi odd ones; interleave back: out[2k] = lo[k], out[2k+1] = hi[k].
  const __m512i inter_a = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i inter_b = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const int64_t nblocks = in / kGroup;
  std::vector<float> s(nblocks);
  for (int64_t r = r0; r < r1; ++r) {
    row_scales_avx512(scales + r * nblocks, nblocks, s.data());
    const __m512 g = _mm512_set1_ps(row_scale[r]);
    const uint8_t* cr = codes + r * (in / 2);
    float* wr = w + r * in;
    int64_t c = 0;
    for (; c + 32 <= in; c += 32) {
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cr + c / 2)));
      const __m512 s2 = _mm512_mul_ps(
          _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.data() + c / kGroup))))),
          g);
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s2);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s2);
      _mm512_storeu_ps(wr + c, _mm512_permutex2var_ps(lo, inter_a, hi));
      _mm512_storeu_ps(wr + c + 16, _mm512_permutex2var_ps(lo, inter_b, hi));
    }
    if (c < in) {  // one 16-element block left
      const __m512i d = _mm512_maskz_cvtepu8_epi32(0xFF, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cr + c / 2)));
      const __m512 s1 = _mm512_mul_ps(_mm512_set1_ps(s[c / kGroup]), g);
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s1);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s1);
      _mm512_storeu_ps(wr + c, _mm512_permutex2var_ps(lo, inter_a, hi));
    }
  }
}


void row_scales(const uint8_t* s, int64_t nblocks, float* out) { row_scales_avx512(s, nblocks, out); }

}  // namespace hetero_run_cpu
#endif
