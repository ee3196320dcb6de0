// x @ W.T with AVX2 + FMA (CPUs without AVX-512): float32 x, 256-bit FMA, fp32 sums.
// Dense bf16 weights widen exactly. NVFP4 weights decode to exact float32 (E2M1 by byte lookups,
// times the fp8 block scale: at most 6 significant bits) in an order x is permuted to match:
// for up to 6 rows of x in registers, against each row as it is decoded; for more, into a tile
// that every group of x rows reads. Every (weight row, x row) sum runs in one accumulator in one
// order, so the bits do not depend on n. bf16 x arrives widened.
#include "cpu_kernels.h"

#if HR_X86
#include <immintrin.h>

#include <type_traits>

namespace hetero_run_cpu {
namespace {

// Every product below sums each (weight row, x row) pair in one accumulator, 8 elements at a
// time in the kernel's order, then reduce8: the same operations whatever block of rows shares
// the loads, so a row's bits do not depend on n. A block of R weight rows times G rows of x
// keeps R * G accumulators, R weight vectors and one x vector in the 16 registers, each x load
// feeding R FMAs and each weight load G.
//
// Dense weights are read 16 at a time. A 256-bit load of 16 bf16 words gives the even elements
// as float32 (word << 16) and the odd ones (word & 0xFFFF0000): one operation each, no shuffle;
// x is permuted once per call to that order (Bf16Weights::perm). float32 weights (and the
// decoded NVFP4 tile, already in the order its x is permuted to) are read in order.
constexpr int kStep = 16;

struct Bf16Weights {
  using W = uint16_t;
  static constexpr bool kPrefetch = true;  // rows stream from memory
  static constexpr int kGroup = 3;         // 3 x 3 blocks: 9 + 3 + 1 registers, and the mask
  template <int h>                         // the even elements of p[0 .. 15] (h = 0) or the odd ones
  static HR_AVX2 inline __m256 half(const uint16_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(w, 16)
                                      : _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static constexpr int perm(int p) { return p < 8 ? 2 * p : 2 * (p - 8) + 1; }
};

struct Fp32Weights {
  using W = float;
  static constexpr bool kPrefetch = true;
  static constexpr int kGroup = 4;  // 3 x 4 blocks: 12 + 3 + 1 registers
  template <int h>
  static HR_AVX2 inline __m256 half(const float* p) { return _mm256_loadu_ps(p + 8 * h); }
  static constexpr int perm(int p) { return p; }
};

struct DecodedTile : Fp32Weights {  // in L1: nothing to prefetch
  static constexpr bool kPrefetch = false;
};

// One step of kStep elements: R weight rows (from rows[q] + k) times G rows of x (from x + i * ldx
// + xk) into acc, one half of the step at a time (R weight vectors live, not 2R).
template <typename T, int R, int G, int h>
HR_AVX2 inline void half_step(const typename T::W* const (&rows)[R], int64_t k, const float* x, int64_t ldx,
                              int64_t xk, __m256 (&acc)[R][G]) {
  __m256 wv[R];
  for (int q = 0; q < R; ++q) wv[q] = T::template half<h>(rows[q] + k);
  for (int i = 0; i < G; ++i) {
    const __m256 xv = _mm256_load_ps(x + i * ldx + xk + 8 * h);
    for (int q = 0; q < R; ++q) acc[q][i] = _mm256_fmadd_ps(wv[q], xv, acc[q][i]);
  }
}

// R weight rows (row q at w + q * ldw) times G rows of x (row i at x + i * ldx, kernel order,
// zero-padded to whole steps) over `len` elements; the last partial step of the weights (len
// not a multiple of kStep) is read from a zero-padded copy. y[i * ldy + q] = sum * scale[q].
// Rows from memory are asked for one block ahead (at least 2 KiB): R rows read side by side
// are R short streams the hardware prefetchers follow poorly (the bf16 lm_head at 4 rows of x
// on a Zen 3 core: 14.9 ms without, 12.2 with).
template <typename T, int R, int G>
HR_AVX2 void dense_block(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t len,
                         const float* scale, float* y, int64_t ldy) {
  __m256 acc[R][G];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i] = _mm256_setzero_ps();
  const typename T::W* rows[R];
  for (int q = 0; q < R; ++q) rows[q] = w + q * ldw;
  const int64_t ahead = std::max<int64_t>(R * ldw, 2048 / sizeof(typename T::W));
  int64_t k = 0;
  for (; k + kStep <= len; k += kStep) {
    if (T::kPrefetch && (k & 31) == 0)
      for (int q = 0; q < R; ++q) _mm_prefetch(reinterpret_cast<const char*>(rows[q] + k + ahead), _MM_HINT_T0);
    half_step<T, R, G, 0>(rows, k, x, ldx, k, acc);
    half_step<T, R, G, 1>(rows, k, x, ldx, k, acc);
  }
  if (k < len) {
    typename T::W pad[R][kStep] = {};
    const typename T::W* padded[R];
    for (int q = 0; q < R; ++q) {
      for (int64_t p = 0; p < len - k; ++p) pad[q][p] = rows[q][k + p];
      padded[q] = pad[q];
    }
    half_step<T, R, G, 0>(padded, 0, x, ldx, k, acc);
    half_step<T, R, G, 1>(padded, 0, x, ldx, k, acc);
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) {
      const float s = reduce8(acc[q][i]);
      y[i * ldy + q] = scale ? s * scale[q] : s;
    }
}

// One block of R weight rows against n rows of x in groups of at most G, as even as they come
// (7 rows at most 4: 4 + 3, not 4 + 3 x 1): a block keeps R * size accumulation chains, and the
// FMA's 4-cycle latency leaves a block of fewer than 8 waiting (the 3 x 1 block of 5 rows as
// 4 + 1 cost about as much as the 3 x 4 one).
template <typename T, int R, int G>
void block_times_x(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, int64_t len,
                   const float* scale, float* y, int64_t ldy) {
  const int64_t groups = (n + G - 1) / G, base = n / groups, larger = n % groups;
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    const int64_t size = base + (g < larger ? 1 : 0);
    const float* xi = x + i * ldx;
    float* yi = y + i * ldy;
    if constexpr (G >= 4) if (size == 4) dense_block<T, R, 4>(w, ldw, xi, ldx, len, scale, yi, ldy);
    if constexpr (G >= 3) if (size == 3) dense_block<T, R, 3>(w, ldw, xi, ldx, len, scale, yi, ldy);
    if (size == 2) dense_block<T, R, 2>(w, ldw, xi, ldx, len, scale, yi, ldy);
    if (size == 1) dense_block<T, R, 1>(w, ldw, xi, ldx, len, scale, yi, ldy);
    i += size;
  }
}

// Blocks of R weight rows (the last rows one at a time) against groups of up to G rows of x.
template <typename T, int R, int G>
void rows_in_blocks(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, int64_t len,
                    int64_t rows, const float* scale, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    block_times_x<T, R, G>(w + r * ldw, ldw, x, ldx, n, len, scale ? scale + r : nullptr, y + r, ldy);
  for (; r < rows; ++r)
    block_times_x<T, 1, G>(w + r * ldw, ldw, x, ldx, n, len, scale ? scale + r : nullptr, y + r, ldy);
}

// `rows` weight rows (row q at w + q * ldw, its scale scale[q]) times n rows of x (y[i * ldy + q]).
// One row of x reads one weight row at a time (one stream: the bf16 lm_head from memory 9.3 ms
// against 10.7 in blocks of 4, on a Zen 3 core); 2-4 rows blocks of 4 x 2, 3 x 3 and 2 x 4;
// more, blocks of 3 weight rows against groups of up to T::kGroup.
template <typename T>
void rows_times_x(const typename T::W* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, int64_t len,
                  int64_t rows, const float* scale, float* y, int64_t ldy) {
  switch (n) {
    case 1: return rows_in_blocks<T, 1, 1>(w, ldw, x, ldx, n, len, rows, scale, y, ldy);
    case 2: return rows_in_blocks<T, 4, 2>(w, ldw, x, ldx, n, len, rows, scale, y, ldy);
    case 3: return rows_in_blocks<T, 3, 3>(w, ldw, x, ldx, n, len, rows, scale, y, ldy);
    case 4: return rows_in_blocks<T, 2, 4>(w, ldw, x, ldx, n, len, rows, scale, y, ldy);
    default: return rows_in_blocks<T, 3, T::kGroup>(w, ldw, x, ldx, n, len, rows, scale, y, ldy);
  }
}

// x [n, in] (float32, or bf16 widened here) -> xp [n, ld] in the order T reads weights, steps of
// kStep (ld: in rounded up to a whole step, the padding zero).
template <typename T, typename X>
void permute_steps(const X* x, int64_t n, int64_t in, int64_t ld, float* xp) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < ld; k += kStep)
      for (int p = 0; p < kStep; ++p) {
        const int64_t e = k + T::perm(p);
        xp[i * ld + k + p] = e < in ? to_float(x[i * in + e]) : 0.f;
      }
}

inline int64_t whole_steps(int64_t in) { return (in + kStep - 1) / kStep * kStep; }

template <typename X, typename Wt>
void dense_impl(const X* x, int64_t n, int64_t in, const Wt* w, int64_t out, float* y) {
  using T = std::conditional_t<std::is_same_v<Wt, float>, Fp32Weights, Bf16Weights>;
  const int64_t ld = whole_steps(in);
  Aligned<float> permuted(n * ld);
  float* xp = permuted.data();
  permute_steps<T>(x, n, in, ld, xp);
  const int64_t pass = x_rows_per_pass(ld * 4);
  at::parallel_for(0, out, grain_rows(in * static_cast<int64_t>(sizeof(Wt))), [&](int64_t r0, int64_t r1) {
    for (int64_t i0 = 0; i0 < n; i0 += pass)
      rows_times_x<T>(w + r0 * in, in, xp + i0 * ld, ld, std::min(pass, n - i0), in, r1 - r0, nullptr,
                      y + i0 * out + r0, out);
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

// Weight rows r .. r + R - 1 times G rows of permuted x, decoded in registers (R * G
// accumulators; the same sums, in the same order, as dense_block over decode_rows' tile). Each
// row asks for its codes `ahead` bytes ahead and its scales as far ahead in their stream (long
// rows of a one-row product from memory: 3.2 against 3.7 ns per 32 weights on a Zen 3 core).
template <int R, int G>
HR_AVX2 void rows_in_registers(const E2M1Decoder& dec, const uint8_t* codes, const uint8_t* scales, int64_t in,
                               int64_t r, const float* xp, const float* row_scale, float* y, int64_t out,
                               int64_t ahead) {
  const E2M1Decoder d = dec;
  const float* fp8 = fp8_table();
  __m256 acc[R][G];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i] = _mm256_setzero_ps();
  const uint8_t* c[R];
  const uint8_t* s[R];
  for (int q = 0; q < R; ++q) {
    c[q] = codes + (r + q) * (in / 2);
    s[q] = scales + (r + q) * (in / kGroup);
  }
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    if ((k & 127) == 0)
      for (int q = 0; q < R; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(c[q] + k / 2 + ahead), _MM_HINT_T0);
        if ((k & 1023) == 0) _mm_prefetch(reinterpret_cast<const char*>(s[q] + k / kGroup + ahead / 8), _MM_HINT_T0);
      }
    for (int q = 0; q < R; ++q) {
      __m256 v[4];
      d.scaled(fp8, c[q], s[q], k, v);
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < G; ++i)
          acc[q][i] = _mm256_fmadd_ps(v[j], _mm256_load_ps(xp + i * in + k + 8 * j), acc[q][i]);
    }
  }
  if (k < in) {  // a last block of 16
    for (int q = 0; q < R; ++q) {
      __m256 v[4];
      d.scaled<true>(fp8, c[q], s[q], k, v);
      for (int j = 0; j < 2; ++j)
        for (int i = 0; i < G; ++i)
          acc[q][i] = _mm256_fmadd_ps(v[j], _mm256_load_ps(xp + i * in + k + 8 * j), acc[q][i]);
    }
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) y[i * out + r + q] = reduce8(acc[q][i]) * row_scale[r + q];
}

// Rows r .. r + rows - 1 as exact float32 in the decoder's order: tile [rows][in].
HR_AVX2 void decode_rows(const E2M1Decoder& d, const uint8_t* codes, const uint8_t* scales, int64_t in, int64_t r,
                         int64_t rows, float* tile, int64_t ahead) {
  const float* fp8 = fp8_table();
  for (int64_t q = 0; q < rows; ++q) {
    const uint8_t* c = codes + (r + q) * (in / 2);
    const uint8_t* s = scales + (r + q) * (in / kGroup);
    float* t = tile + q * in;
    int64_t k = 0;
    __m256 v[4];
    for (; k + 32 <= in; k += 32) {
      if ((k & 127) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(c + k / 2 + ahead), _MM_HINT_T0);
        if ((k & 1023) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + k / kGroup + ahead / 8), _MM_HINT_T0);
      }
      d.scaled(fp8, c, s, k, v);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(t + k + 8 * j, v[j]);
    }
    if (k < in) {
      d.scaled<true>(fp8, c, s, k, v);
      for (int j = 0; j < 2; ++j) _mm256_store_ps(t + k + 8 * j, v[j]);
    }
  }
}

// Up to this many rows of x, each weight row is decoded in registers once per call, its decode
// overlapping the FMAs; more rows are worth a decoded tile that every group of x rows reads
// (the one step's NVFP4 products of the real target at 5 rows, on a Zen 3 core pair: 31.6 ms in
// registers, 40.4 through the tile; at 8 rows 51.4 against 49.1).
constexpr int64_t kRegisterRowsMax = 6;

// Weight rows in blocks of R (the last ones one at a time) against G rows of x in registers:
// R * G accumulation chains of 4 dependent FMAs per 32 weights, so one row of x takes 4 weight
// rows at a time (one row's 4-cycle FMAs would wait on each other), 2-5 rows two, 6 one (its
// 6 accumulators, 4 decoded vectors and the decoder's tables fill the 16 registers).
template <int R, int G>
void nvfp4_registers(const E2M1Decoder& d, const float* xp, int64_t in, const uint8_t* codes, const uint8_t* scales,
                     const float* row_scale, int64_t out, float* y) {
  const int64_t ahead = prefetch_ahead_bytes();
  at::parallel_for(0, out, grain_rows(in / 2 + in / kGroup), [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) rows_in_registers<R, G>(d, codes, scales, in, r, xp, row_scale, y, out, ahead);
    for (; r < r1; ++r) rows_in_registers<1, G>(d, codes, scales, in, r, xp, row_scale, y, out, ahead);
  });
}

template <typename X>
void nvfp4_impl(const X* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                const float* row_scale, int64_t out, float* y) {
  const E2M1Decoder d;
  Aligned<float> permuted(n * in);
  float* xp = permuted.data();
  permute_x(x, n, in, xp);
  switch (n <= kRegisterRowsMax ? n : 0) {
    case 1: return nvfp4_registers<4, 1>(d, xp, in, codes, scales, row_scale, out, y);
    case 2: return nvfp4_registers<2, 2>(d, xp, in, codes, scales, row_scale, out, y);
    case 3: return nvfp4_registers<2, 3>(d, xp, in, codes, scales, row_scale, out, y);
    case 4: return nvfp4_registers<2, 4>(d, xp, in, codes, scales, row_scale, out, y);
    case 5: return nvfp4_registers<2, 5>(d, xp, in, codes, scales, row_scale, out, y);
    case 6: return nvfp4_registers<1, 6>(d, xp, in, codes, scales, row_scale, out, y);
    default: break;
  }
  // 3 weight rows decoded at a time into a tile (in L1 for rows of up to ~2500 weights), then
  // read by every group of 4 rows of x in 3 x 4 blocks: the decode paid once per weight row, the
  // rest FMAs (8 rows of the 151936 x 896 matrix from memory: 20 ms, against 34 ms in the 16-row
  // tile and 2 x 3 blocks with two accumulators per pair before, on a Zen 3 core pair)
  constexpr int64_t kTileRows = 3;
  const int64_t pass = x_rows_per_pass(in * 4), ahead = prefetch_ahead_bytes();
  at::parallel_for(0, out, grain_rows(in / 2 + in / kGroup), [&](int64_t r0, int64_t r1) {
    Aligned<float> tile(kTileRows * in);
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, r1 - r);
      decode_rows(d, codes, scales, in, r, rows, tile.data(), ahead);
      for (int64_t i0 = 0; i0 < n; i0 += pass)
        rows_times_x<DecodedTile>(tile.data(), in, xp + i0 * in, in, std::min(pass, n - i0), in, rows,
                                  row_scale + r, y + i0 * out + r, out);
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

void dense_linear_avx2(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
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
