// x @ W.T on AMX tiles for bf16 x (NVFP4 and bf16 weights).
//
// With bf16 activations, AMX tiles multiply 16 output rows by 32 inputs by up to 16 x rows in
// one instruction, so verifying a draft (up to 16 tokens) costs about as much as one token.
// We compute y^T = W x^T: tile A = 16 weight rows x 32 inputs (bf16, row-major), tile B = x^T
// as bf16 pairs ([16 input pairs][n] dwords, built once per call), tile C = [16 outputs][n] fp32.
// NVFP4 rows are dequantised into A exactly: E2M1 * block scale has at most 6 significant bits,
// so the float32 product's low 16 bits are zero and bf16 = its top half. The global scale is
// applied to C. Dense bf16 rows load into A straight from the weight.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

namespace hetero_run_cpu {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Dense, one group of x rows (n <= 16): tmm0 = C [16][n] f32; tmm1 = A [16][32] bf16; tmm2 = B
// [16][n] bf16 pairs.
HR_AMX void amx_configure(int64_t n) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = static_cast<uint16_t>(n * 4);
  cfg.rows[1] = 16, cfg.colsb[1] = 64;
  cfg.rows[2] = 16, cfg.colsb[2] = static_cast<uint16_t>(n * 4);
  // gcc's _tile_loadconfig tells the optimiser it reads 8 bytes only; keep all 64 bytes stored.
  __asm__ volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// NVFP4, one or two groups of x rows, n0 <= 16 and n1 <= 16 (0: one group): tmm0, tmm1 = C of
// group 0 [16][n0] f32 (two accumulators, even and odd chunks) and tmm2, tmm3 = C of group 1;
// tmm4, tmm5 = A [16][32] bf16; tmm6, tmm7 = B of group 0 and 1 [16][n_g] bf16 pairs.
HR_AMX void amx_configure_nvfp4(int64_t n0, int64_t n1) {
  TileConfig cfg;
  for (int t : {0, 1, 6}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(n0 * 4);
  if (n1 > 0)
    for (int t : {2, 3, 7}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(n1 * 4);
  for (int t : {4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  __asm__ volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Up to three groups of x rows (dense): tmm0-2 = C of group g [16][n_g] f32; tmm3 = A; tmm5-7 = B
// of group g [16][n_g]. widths: the groups' row counts.
HR_AMX void amx_configure_groups(const int64_t* widths, int groups) {
  TileConfig cfg;
  for (int g = 0; g < groups; ++g) {
    cfg.rows[g] = 16, cfg.colsb[g] = static_cast<uint16_t>(widths[g] * 4);
    cfg.rows[5 + g] = 16, cfg.colsb[5 + g] = static_cast<uint16_t>(widths[g] * 4);
  }
  cfg.rows[3] = 16, cfg.colsb[3] = 64;
  __asm__ volatile("" : : "m"(cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// xt[p][j] = (x[j][2p], x[j][2p + 1]) as one dword: B tiles for every 32-input chunk.
std::vector<uint32_t> pairs_transposed(const uint16_t* x, int64_t n, int64_t in) {
  std::vector<uint32_t> xt(in / 2 * n);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + j * in);
    for (int64_t p = 0; p < in / 2; ++p) xt[p * n + j] = xr[p];
  }
  return xt;
}

// The 16 x 16 floats of v transposed in place (v[r] lane j <-> v[j] lane r): four rounds of 16
// shuffles.
HR_AMX inline void transpose16(__m512 (&v)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of floats
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)  // 4 x 4: v[i + c] holds column c of each 128-bit lane's 4 x 4 block
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + 2 + h]);
      v[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 16; i += 8)  // 8 x 8: 128-bit lanes 0, 2 / 1, 3 of rows i and i + 4
    for (int h = 0; h < 4; ++h) {
      t[i + h] = _mm512_shuffle_f32x4(v[i + h], v[i + 4 + h], 0x88);
      t[i + 4 + h] = _mm512_shuffle_f32x4(v[i + h], v[i + 4 + h], 0xDD);
    }
  for (int h = 0; h < 8; ++h) {  // 16 x 16
    v[h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0x88);
    v[8 + h] = _mm512_shuffle_f32x4(t[h], t[8 + h], 0xDD);
  }
}

// A block of C tiles stored with a 64-byte stride (c[r * 16 + j]: output row o0 + r, x row j; the
// second accumulator c1, if any, added first) -> y[j * out + o0 + r] = (c + c1) * row_scale[o0 + r]
// (no row_scale: 1) for j < n, r < rows. The same additions and products for every n; from 4 rows
// of x on, one register transpose instead of 16 n scalar stores a block.
HR_AMX void amx_store_block(const float* c, const float* c1, int64_t n, int64_t o0, int64_t rows,
                            const float* row_scale, float* y, int64_t out) {
  if (n < 4) {
    for (int64_t r = 0; r < rows; ++r) {
      const float g = row_scale ? row_scale[o0 + r] : 1.0f;
      for (int64_t j = 0; j < n; ++j) y[j * out + o0 + r] = (c1 ? c[r * 16 + j] + c1[r * 16 + j] : c[r * 16 + j]) * g;
    }
    return;
  }
  const __mmask16 m = static_cast<__mmask16>((1u << rows) - 1);
  __m512 v[16];
  for (int r = 0; r < 16; ++r) {
    v[r] = _mm512_loadu_ps(c + r * 16);
    if (c1) v[r] = _mm512_add_ps(v[r], _mm512_loadu_ps(c1 + r * 16));
  }
  transpose16(v);
  const __m512 g = row_scale ? _mm512_maskz_loadu_ps(m, row_scale + o0) : _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; ++j) _mm512_mask_storeu_ps(y + j * out + o0, m, _mm512_mul_ps(v[j], g));
}

// 16 rows x 128 inputs into four A buffers, with the inputs in the order the codes give them
// cheaply: A buffer q, row r, dword j holds the pair (element 8j + 2q, element 8j + 2q + 1) of the
// chunk. The dot product does not care about the order of the inputs as long as B follows it:
// B row j of step q is x's pair c/2 + 4j + q, i.e. the pair table read with a stride of 4 pairs.
HR_AMX inline void nvfp4_tiles_a128(const uint8_t* codes, const float* sbuf, int64_t in, int64_t rows, int64_t c,
                                    uint16_t (*a)[16 * 32]) {
  const int64_t nblocks = in / kGroup;
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + (r + 16) * (in / 2) + c / 2), _MM_HINT_T0);
    const __m512i d = _mm512_loadu_si512(codes + r * (in / 2) + c / 2);
    const __m512 s = _mm512_permutexvar_ps(dup_lo, _mm512_castps256_ps512(_mm256_loadu_ps(sbuf + r * nblocks + c / kGroup)));
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 8 * q), table), s);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 8 * q + 4), table), s);
      // (hi & 0xFFFF0000) | (lo >> 16): the two exact bf16 values as one pair
      const __m512i pair = _mm512_ternarylogic_epi32(_mm512_castps_si512(hi), top,
                                                     _mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xEA);
      _mm512_store_si512(a[q] + r * 32, pair);
    }
  }
}

// 16 rows x 32 inputs in natural order (element 2p, 2p + 1 in dword p), for rows whose length is
// not a multiple of 128.
HR_AMX inline void nvfp4_tile_a32(const uint8_t* codes, const float* sbuf, int64_t in, int64_t rows, int64_t k,
                                  uint16_t* a) {
  const int64_t nblocks = in / kGroup;
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * (in / 2) + k / 2)));
    const __m512 s2 = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castsi128_ps(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sbuf + r * nblocks + k / kGroup)))));
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, table), s2);                        // element 2p
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s2);  // 2p + 1
    const __m512i pair = _mm512_ternarylogic_epi32(_mm512_castps_si512(hi), top,
                                                   _mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xEA);
    _mm512_store_si512(a + r * 32, pair);
  }
}

// A tile A times the B rows at b (bstride bytes apart) into accumulator C of group 0 and, with a
// second group, C1 of group 1 (tile numbers are spelled into the instructions: a macro).
#define HR_NVFP4_PRODUCTS(A, C, C1, a, b, bstride) \
  _tile_loadd(A, a, 64);                           \
  _tile_loadd(6, b, bstride);                      \
  _tile_dpbf16ps(C, A, 6);                         \
  if constexpr (kTwo) {                            \
    _tile_loadd(7, (b) + 16, bstride);             \
    _tile_dpbf16ps(C1, A, 7);                      \
  }

// Rows [16 * b0, 16 * b1) of y for up to 16 rows of x, or with kTwo for 17-32 in two groups (16
// and n - 16): each A tile decoded once serves both groups, so the weights are read and decoded
// once for 32 rows instead of twice. Each C element sums its row's products in one order
// whatever n is (even chunks in one accumulator, odd in the other, their sum at the end), so a
// row has the same bits in a pass of 1, 17 or 32 rows.
template <bool kTwo>
HR_AMX void nvfp4_blocks_amx(const uint32_t* xt, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                             const float* row_scale, int64_t out, float* y, int64_t b0, int64_t b1) {
  const int64_t nblocks = in / kGroup, main = in / 128 * 128, n0 = kTwo ? 16 : n, n1 = n - n0;
  amx_configure_nvfp4(n0, n1);
  // Two sets of A buffers, used in turn, so writing the next chunk never waits for tile loads
  // of the previous one.
  alignas(64) uint16_t abuf[2][4][16 * 32];
  alignas(64) float c[4][16 * 16];
  std::vector<float> sbuf(16 * nblocks);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t o0 = blk * 16, rows = std::min<int64_t>(16, out - o0);
    for (int64_t r = 0; r < rows; ++r) row_scales(scales + (o0 + r) * nblocks, nblocks, sbuf.data() + r * nblocks);
    if (rows < 16) std::memset(abuf, 0, sizeof(abuf));
    const uint8_t* cb = codes + o0 * (in / 2);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < main; k += 128) {
      uint16_t(*a)[16 * 32] = abuf[(k / 128) & 1];
      nvfp4_tiles_a128(cb, sbuf.data(), in, rows, k, a);
      const uint32_t* b = xt + (k / 2) * n;  // B row j of step q: pair k / 2 + 4j + q
      // Two accumulators a group in turn, so consecutive tile products do not wait for each other.
      HR_NVFP4_PRODUCTS(4, 0, 2, a[0], b, 16 * n)
      HR_NVFP4_PRODUCTS(5, 1, 3, a[1], b + n, 16 * n)
      HR_NVFP4_PRODUCTS(4, 0, 2, a[2], b + 2 * n, 16 * n)
      HR_NVFP4_PRODUCTS(5, 1, 3, a[3], b + 3 * n, 16 * n)
    }
    for (int64_t k = main; k < in; k += 32) {
      uint16_t* a = abuf[(k / 32) & 1][0];
      nvfp4_tile_a32(cb, sbuf.data(), in, rows, k, a);
      const uint32_t* b = xt + (k / 2) * n;
      HR_NVFP4_PRODUCTS(4, 0, 2, a, b, 4 * n)  // natural order: consecutive pairs
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    amx_store_block(c[0], c[1], n0, o0, rows, row_scale, y, out);
    if constexpr (kTwo) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      amx_store_block(c[2], c[3], n1, o0, rows, row_scale, y + 16 * out, out);
    }
  }
  _tile_release();
}

#undef HR_NVFP4_PRODUCTS

}  // namespace

// Any number of x rows, up to 32 a pass (a prefill decodes W once per 32 rows, still faster than
// dequantising once and multiplying in float32). Each C element accumulates its row's products
// in the same order whatever the other rows of the pass are.

void nvfp4_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                      const float* row_scale, int64_t out, float* y) {
  for (int64_t i0 = 0; i0 < n; i0 += 32) {
    const int64_t m = std::min<int64_t>(32, n - i0);
    const std::vector<uint32_t> xt = pairs_transposed(x + i0 * in, m, in);
    at::parallel_for(0, (out + 15) / 16, grain_rows(16 * (in / 2 + in / kGroup)), [&](int64_t b0, int64_t b1) {
      if (m <= 16)
        nvfp4_blocks_amx<false>(xt.data(), m, in, codes, scales, row_scale, out, y + i0 * out, b0, b1);
      else
        nvfp4_blocks_amx<true>(xt.data(), m, in, codes, scales, row_scale, out, y + i0 * out, b0, b1);
    });
  }
}

namespace {

HR_AMX void dense_blocks_amx(const uint32_t* xt, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y,
                             int64_t b0, int64_t b1) {
  amx_configure(n);
  alignas(64) uint16_t a[16 * 32];
  alignas(64) float c[16 * 16];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t o0 = blk * 16, rows = std::min<int64_t>(16, out - o0);
    _tile_zero(0);
    for (int64_t k = 0; k < in; k += 32) {
      if (rows == 16) {
        for (int64_t r = 0; r < 16; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (o0 + 16 + r) * in + k), _MM_HINT_T0);
        _tile_loadd(1, w + o0 * in + k, in * 2);
      } else {  // last block: copy the rows that exist, zero the rest
        std::memset(a, 0, sizeof(a));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(a + r * 32, w + (o0 + r) * in + k, 64);
        _tile_loadd(1, a, 64);
      }
      _tile_loadd(2, xt + (k / 2) * n, n * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    amx_store_block(c, nullptr, n, o0, rows, nullptr, y, out);
  }
  _tile_release();
}

// The same for 17-48 rows of x in two or three groups of up to 16: each A tile loaded once serves
// every group, so the weights stream once for 48 rows. Each C element sums its row's products in
// the same order as above (one accumulator, the inputs in order), so a row has the same bits.
template <int G>
HR_AMX void dense_blocks_amx_groups(const uint32_t* xt, int64_t n, int64_t in, const uint16_t* w, int64_t out,
                                    float* y, int64_t b0, int64_t b1) {
  int64_t widths[3] = {16, 16, 16};
  widths[G - 1] = n - 16 * (G - 1);
  amx_configure_groups(widths, G);
  alignas(64) uint16_t a[16 * 32];
  alignas(64) float c[16 * 16];
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t o0 = blk * 16, rows = std::min<int64_t>(16, out - o0);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (G > 2) _tile_zero(2);
    for (int64_t k = 0; k < in; k += 32) {
      if (rows == 16) {
        for (int64_t r = 0; r < 16; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (o0 + 16 + r) * in + k), _MM_HINT_T0);
        _tile_loadd(3, w + o0 * in + k, in * 2);
      } else {
        std::memset(a, 0, sizeof(a));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(a + r * 32, w + (o0 + r) * in + k, 64);
        _tile_loadd(3, a, 64);
      }
      const uint32_t* b = xt + (k / 2) * n;
      _tile_loadd(5, b, n * 4);
      _tile_dpbf16ps(0, 3, 5);
      _tile_loadd(6, b + 16, n * 4);
      _tile_dpbf16ps(1, 3, 6);
      if constexpr (G > 2) {
        _tile_loadd(7, b + 32, n * 4);
        _tile_dpbf16ps(2, 3, 7);
      }
    }
    _tile_stored(0, c, 64);
    amx_store_block(c, nullptr, 16, o0, rows, nullptr, y, out);
    _tile_stored(1, c, 64);
    amx_store_block(c, nullptr, widths[1], o0, rows, nullptr, y + 16 * out, out);
    if constexpr (G > 2) {
      _tile_stored(2, c, 64);
      amx_store_block(c, nullptr, widths[2], o0, rows, nullptr, y + 32 * out, out);
    }
  }
  _tile_release();
}

}  // namespace

void dense_linear_amx(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  for (int64_t i0 = 0; i0 < n; i0 += 48) {
    const int64_t m = std::min<int64_t>(48, n - i0);
    const std::vector<uint32_t> xt = pairs_transposed(x + i0 * in, m, in);
    at::parallel_for(0, (out + 15) / 16, grain_rows(16 * in * 2), [&](int64_t b0, int64_t b1) {
      if (m <= 16)
        dense_blocks_amx(xt.data(), m, in, w, out, y + i0 * out, b0, b1);
      else if (m <= 32)
        dense_blocks_amx_groups<2>(xt.data(), m, in, w, out, y + i0 * out, b0, b1);
      else
        dense_blocks_amx_groups<3>(xt.data(), m, in, w, out, y + i0 * out, b0, b1);
    });
  }
}

}  // namespace hetero_run_cpu
#endif
