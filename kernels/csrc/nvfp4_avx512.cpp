// NVFP4 x @ W.T with AVX-512: bf16 x on vdpbf16ps (AVX512-BF16), float32 x on FMA (AVX-512F),
// and bit-exact dequantisation.
//
// Decoding costs shuffles, and on the CPUs this targets the permutes share execution ports
// with the dot products, so the decoder spends one permute per 32 weights: the weights come out
// unscaled, each block's fp8 scale multiplies its partial sum instead.
//
// A group of 16 blocks (256 inputs, 128 code bytes) is laid out one block per 32-bit lane: two
// dword permutes gather block m's bytes 0-3 into lane m of V0 and its bytes 4-7 into V1. A
// 16-bit word of V holds four codes (elements e..e+3 of its block); vpermw looks up the word's
// low 5 bits in a 32-entry table (E2M1 as bf16, twice, so bit 4 is ignored), so V, V >> 4,
// V >> 8 and V >> 12 decode to four vectors of 32 exact bf16 weights. All eight vectors of a
// group map lane m to block m, so for each (weight row, x row) pair
//     t = vdpbf16ps chain over the group's vectors 0..7 in order, from 0   (fp32)
//     acc = fma(t, S, acc)                                      (S: the group's 16 block scales)
// and y = reduce(acc) * row_scale. A row's last blocks form a group of 16 (masked) or of 8
// (one vector per code shift, lanes 8-15 holding the blocks' second halves). x is permuted once
// per call to the weights' order (elem() below), zero beyond in. Float32 x uses the same
// weights widened exactly (a bf16 is the top half of its float32), two FMAs per vector.
//
// The products are blocked: R weight rows (1, 2 or 4) meet N rows of x (1..5 on AMD, 1..8 on
// Intel) at once, each weight vector decoded once for the N rows and each x vector loaded once
// for the R rows, R x N chains of dot products in flight (nvfp4_rows() says which R for which
// rows). Every pair
// performs the same operations in the same order whatever R and N are, so rows are
// batch-invariant.
#include <utility>

#include "cpu_kernels.h"
#include "linear_rows.h"

#if HR_X86
#include "rows_avx512.h"

namespace hetero_run_cpu {
namespace {

// The groups of one row: `full` groups of 16 blocks, then one of `tail_blocks` valid blocks in a
// group of 16 (tail_width 16) or of 8 (tail_width 8), or none.
struct Groups {
  int64_t in, full, tail_blocks, tail_width, kp;  // kp: permuted x elements per row
  explicit Groups(int64_t in_) : in(in_) {
    const int64_t nb = in / kGroup;
    full = nb / 16;
    tail_blocks = nb % 16;
    tail_width = tail_blocks > 8 ? 16 : tail_blocks > 0 ? 8 : 0;
    kp = full * 256 + tail_width * 16;
  }
  int64_t count() const { return full + (tail_width ? 1 : 0); }
  int width(int64_t g) const { return g < full ? 16 : static_cast<int>(tail_width); }
  int valid(int64_t g) const { return g < full ? 16 : static_cast<int>(tail_blocks); }
};

// The input (offset within the group) that word p of decoded vector v holds: a group of 16
// blocks has lane l = block l, v = 4h + j (h: bytes 0-3 or 4-7 of the block, j: code shift);
// a group of 8 has lane l = block l % 8, its bytes 4 * (l / 8) .. + 3, v = j.
int elem(int width, int v, int p) {
  const int l = p / 2, w = p % 2;
  const int block = width == 16 ? l : l % 8, h = width == 16 ? v / 4 : l / 8, j = width == 16 ? v % 4 : v;
  return 16 * block + 8 * h + 4 * w + j;
}

alignas(64) constexpr uint16_t kE2M1Bf16x2[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
alignas(64) constexpr int32_t kEvenDwords[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
alignas(64) constexpr int32_t kOddDwords[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
alignas(64) constexpr int32_t kHalves8[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

// 16 fp8 e4m3 values (one per dword of d) -> float, exact, without denormal arithmetic (for when
// the caller has denormals treated as zero): normal numbers by moving the bits into float32
// position, subnormals as m * 2^-9.
HR_AVX512 inline __m512 fp8_to_float_no_denormals(__m512i d) {
  const __m512i mag = _mm512_and_si512(d, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// The same in five operations and no branch: the magnitude's 7 bits moved to float32 bits
// 20-26 make 2^-120 times its value, for normal e4m3 numbers (a float32 exponent of 1-15) and
// subnormal ones (a float32 denormal, m * 2^-129) alike, so one exact multiplication by 2^120
// finishes it; the sign bit goes to bit 31.
HR_AVX512 inline __m512 fp8_to_float(__m512i d) {
  const __m512i bits = _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x7F)), 20);
  const __m512 mag = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  // (mag) | (d << 24 & sign bit)
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), _mm512_slli_epi32(d, 24),
                                                       _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8));
}

// Whether this thread treats denormal inputs as zero (MXCSR DAZ), which fp8_to_float relies on not.
inline bool denormals_are_zero() { return (_mm_getcsr() & 0x0040) != 0; }

// The decoder's constant vectors, loaded once per row range, how it converts scales, and how far
// ahead it prefetches (prefetch_ahead_bytes(), read here rather than in the group loop: a check
// there, even of a static, slowed the loop by a third).
struct Consts {
  __m512i table, even, odd, halves8;
  bool daz;
  int64_t ahead;
  HR_AVX512 Consts()
      : table(_mm512_load_si512(kE2M1Bf16x2)), even(_mm512_load_si512(kEvenDwords)),
        odd(_mm512_load_si512(kOddDwords)), halves8(_mm512_load_si512(kHalves8)), daz(denormals_are_zero()),
        ahead(prefetch_ahead_bytes()) {}
};

// 16 scale bytes (lane l's block scale in byte l) -> 16 floats.
HR_AVX512 inline __m512 lane_scales(const Consts& k, __m128i b) {
  const __m512i d = _mm512_cvtepu8_epi32(b);
  return __builtin_expect(k.daz, 0) ? fp8_to_float_no_denormals(d) : fp8_to_float(d);
}

// One group: `width` 16 or 8 blocks, `valid` of them present -> its code words, one block per
// dword lane (width 16: v[0] the blocks' bytes 0-3, v[1] bytes 4-7; width 8: v[0]), and the
// lanes' block scales.
template <int W>
HR_AVX512 inline void group_words(const Consts& k, const uint8_t* c, const uint8_t* s, int valid,
                                  __m512i (&v)[W / 8], __m512& S) {
  __m128i sb;
  if constexpr (W == 16) {
    __m512i a, b;
    if (valid == 16) {
      a = _mm512_loadu_si512(c);
      b = _mm512_loadu_si512(c + 64);
      sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    } else {  // missing blocks: codes 0 and scale 0
      a = _mm512_loadu_si512(c);
      b = _mm512_maskz_loadu_epi8((1ull << (8 * (valid - 8))) - 1, c + 64);
      sb = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << valid) - 1), s);
    }
    v[0] = _mm512_permutex2var_epi32(a, k.even, b);
    v[1] = _mm512_permutex2var_epi32(a, k.odd, b);
  } else {
    const __m512i a = valid == 8 ? _mm512_loadu_si512(c) : _mm512_maskz_loadu_epi8((1ull << (8 * valid)) - 1, c);
    const __m128i s8 = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << valid) - 1), s);
    sb = _mm_unpacklo_epi64(s8, s8);
    v[0] = _mm512_permutexvar_epi32(k.halves8, a);
  }
  S = lane_scales(k, sb);
}

// How decoded weight vectors meet x: bf16 x with vdpbf16ps, or float32 x with the weights
// widened to two float vectors (low words, high words) and FMA. A vector of x is loaded once and
// meets the weight vectors of every weight row of a block.
struct Bf16Mode {
  using X = uint16_t;
  using XV = __m512i;
  template <int kOffset>
  static HR_AVX512 inline XV load(const uint16_t* x) { return _mm512_loadu_si512(x + kOffset); }
  // register operands through asm: gcc 12 otherwise passes the vector through the stack on its
  // way to the bf16 vector type
  static HR_AVX512BF16 inline __m512 dot(__m512 t, __m512i w, XV x) {
    __asm__("vdpbf16ps %[x], %[w], %[t]" : [t] "+v"(t) : [w] "v"(w), [x] "v"(x));
    return t;
  }
};

struct Fp32Mode {
  using X = float;
  struct XV {
    __m512 lo, hi;
  };
  template <int kOffset>
  static HR_AVX512 inline XV load(const float* x) {
    return {_mm512_loadu_ps(x + kOffset), _mm512_loadu_ps(x + kOffset + 16)};
  }
  static HR_AVX512 inline __m512 dot(__m512 t, __m512i w, XV x) {
    t = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), x.lo, t);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))),
                           x.hi, t);
  }
};

// x [n, in] -> [n, kp] in the decoded weights' order (Fp32Mode: per vector the inputs of its
// low words, then of its high words), zero beyond in.
template <typename X>
void permute_x(const X* x, int64_t n, const Groups& L, X* xp, bool split_words) {
  int map16[256], map8[128];
  for (int v = 0; v < 8; ++v)
    for (int q = 0; q < 32; ++q) {
      const int p = split_words ? (q < 16 ? 2 * q : 2 * (q - 16) + 1) : q;
      map16[v * 32 + q] = elem(16, v, p);
      if (v < 4) map8[v * 32 + q] = elem(8, v, p);
    }
  // a decode's few rows are not worth waking the other threads for (the kernel does that next)
  const int64_t grain = n * L.kp < (1 << 16) ? n : std::max<int64_t>(1, 4096 / std::max<int64_t>(L.kp, 1));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const X* xr = x + i * L.in;
      X* pr = xp + i * L.kp;
      for (int64_t g = 0; g < L.count(); ++g) {
        const int width = L.width(g);
        const int* map = width == 16 ? map16 : map8;
        const int64_t base = g * 256;
        if (base + width * 16 <= L.in) {
          for (int k = 0; k < width * 16; ++k) pr[base + k] = xr[base + map[k]];
        } else {
          for (int k = 0; k < width * 16; ++k) {
            const int64_t src = base + map[k];
            pr[base + k] = src < L.in ? xr[src] : X(0);
          }
        }
      }
    }
  });
}

// The hardware prefetchers fall short of the memory's bandwidth on streams this compute-heavy:
// each weight row asks for its codes prefetch_ahead_bytes() (cpu_kernels.h) ahead of the group
// being decoded, and for its scales as far ahead in their own (8 times slower) stream.

// Every part of a block's group loop is inlined into the block: a call would pass the R x N
// accumulators through memory.
#define HR_ALWAYS_INLINE inline __attribute__((always_inline))

// Where one block of R weight rows and N rows of x reads and writes.
template <typename M>
struct BlockArgs {
  const uint8_t* codes;  // row r's codes; row r + q at codes + q * half
  const uint8_t* scales;  // row r's block scales; row r + q at scales + q * nb
  int64_t half, nb;
  const typename M::X* x;  // permuted x row i0; row i0 + i at x + i * kp
  int64_t kp;
};

// Weight vector VI of a group for each of R weight rows, times N rows of x, into t.
template <typename M, int R, int N, int W, int VI>
HR_AVX512BF16 HR_ALWAYS_INLINE void block_vector(const Consts& k, const __m512i (&v)[R][W / 8], const typename M::X* x,
                                                 int64_t kp, __m512 (&t)[R][N]) {
  constexpr int kShift = 4 * (VI % 4);
  __m512i o[R];
  for (int q = 0; q < R; ++q) {
    __m512i idx = v[q][VI / 4];
    if constexpr (kShift != 0) idx = _mm512_srli_epi16(idx, kShift);
    o[q] = _mm512_permutexvar_epi16(idx, k.table);
  }
  for (int i = 0; i < N; ++i) {
    const auto xv = M::template load<VI * 32>(x + i * kp);
    for (int q = 0; q < R; ++q) t[q][i] = M::dot(t[q][i], o[q], xv);
  }
}

template <typename M, int R, int N, int W, int... VI>
HR_AVX512BF16 HR_ALWAYS_INLINE void block_vectors(const Consts& k, const __m512i (&v)[R][W / 8], const typename M::X* x,
                                                  int64_t kp, __m512 (&t)[R][N], std::integer_sequence<int, VI...>) {
  (block_vector<M, R, N, W, VI>(k, v, x, kp, t), ...);
}

// One group (W = 16 or 8 blocks, `valid` present) of R weight rows against N rows of x: for each
// (weight row q, x row i), t = the chain of dot products over the group's vectors in order, from
// 0; acc[q][i] = fma(t, S_q, acc[q][i]). Each x vector is loaded once for the R weight rows.
template <typename M, int R, int N, int W>
HR_AVX512BF16 HR_ALWAYS_INLINE void block_group(const Consts& k, const BlockArgs<M>& a, int64_t g, int valid,
                                                __m512 (&acc)[R][N]) {
  __m512i v[R][W / 8];
  __m512 S[R];
  for (int q = 0; q < R; ++q) {
    const uint8_t* c = a.codes + q * a.half + g * 128;
    const uint8_t* s = a.scales + q * a.nb + g * 16;
    _mm_prefetch(reinterpret_cast<const char*>(c + k.ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + k.ahead + 64), _MM_HINT_T0);
    if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + k.ahead / 8), _MM_HINT_T0);
    group_words<W>(k, c, s, valid, v[q], S[q]);
  }
  __m512 t[R][N];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < N; ++i) t[q][i] = _mm512_setzero_ps();
  block_vectors<M, R, N, W>(k, v, a.x + g * 256, a.kp, t, std::make_integer_sequence<int, W / 2>{});
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < N; ++i) acc[q][i] = _mm512_fmadd_ps(t[q][i], S[q], acc[q][i]);
}

// Weight rows r .. r + R - 1 against x rows i0 .. i0 + N - 1 (a.codes, a.scales and a.x point at
// them): y[i * out + q] = reduce(acc[q][i]) * row_scale[q], every pair in the one order above.
template <typename M, int R, int N>
HR_AVX512BF16 void block(const Consts& k, const Groups& L, const BlockArgs<M>& a, const float* row_scale, float* y,
                         int64_t out) {
  __m512 acc[R][N];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < N; ++i) acc[q][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < L.full; ++g) block_group<M, R, N, 16>(k, a, g, 16, acc);
  if (L.tail_width == 16)
    block_group<M, R, N, 16>(k, a, L.full, static_cast<int>(L.tail_blocks), acc);
  else if (L.tail_width == 8)
    block_group<M, R, N, 8>(k, a, L.full, static_cast<int>(L.tail_blocks), acc);
  __m512 sums[R * N];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < N; ++i) sums[q * N + i] = acc[q][i];
  float res[R * N];
  reduce_all<R * N>(sums, res);
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < N; ++i) y[i * out + q] = res[q * N + i] * row_scale[q];
}

// Rows of x per block, at most: on AMD 5, so that R x N accumulators and chains stay in
// registers; on Intel 8 (R = 2: 32 accumulators and chains, some in L1), whose vdpbf16ps issues
// one every 2.3 cycles and whose permutes share its ports, so a weight vector decoded once for
// 8 rows instead of twice for 4 saves more than the spills cost (6-16 rows of the target's
// shapes: 0.87-0.94x the time, docs/nvfp4.md). The bits are the same either way.
constexpr int kMaxN = 8;
inline int max_rows_per_piece() { return amd_cpu() ? 5 : kMaxN; }

template <typename M, int R>
void block_n(int n, const Consts& k, const Groups& L, const BlockArgs<M>& a, const float* row_scale, float* y,
             int64_t out) {
  switch (n) {
    case 1: block<M, R, 1>(k, L, a, row_scale, y, out); break;
    case 2: block<M, R, 2>(k, L, a, row_scale, y, out); break;
    case 3: block<M, R, 3>(k, L, a, row_scale, y, out); break;
    case 4: block<M, R, 4>(k, L, a, row_scale, y, out); break;
    case 5: block<M, R, 5>(k, L, a, row_scale, y, out); break;
    case 6: block<M, R, 6>(k, L, a, row_scale, y, out); break;
    case 7: block<M, R, 7>(k, L, a, row_scale, y, out); break;
    default: block<M, R, kMaxN>(k, L, a, row_scale, y, out); break;
  }
}

// Every (weight row, x row) pair runs block()'s operations in block()'s order, whatever the
// blocking: each row of y has the bits of the same row computed alone, for any n.
//
// Blocking (measured on a 2-core Zen 4, both cores streaming; pieces of 8 on Intel, above): rows
// of x are split into pieces of at most max_rows_per_piece(), as even as possible (9 rows: 5 + 4),
// and each piece meets the weights R rows at a time, each vector of x loaded once for the R rows. Short weight rows (four rows' codes within
// kNearBytes) take R = 4 for one row of x and R = 2 for more: four short rows side by side still
// read as one stream, and four chains of dot products are in flight. Long rows read
// side by side stream slower, so one or two rows of x take one weight row at a time (a single
// stream, with enough groups per row to keep the chains busy) and more take R = 2; on Zen 5,
// whose cores stream two long rows at once as fast as one, two rows of x take R = 2 too (the
// down projection [896, 4864], 2 rows: 1.11x one row's time against 1.26x). A block of
// rows stays in L1 from one piece to the next. Rows of x are taken in passes that fit L2, so a
// prefill chunk streams the weights once per pass.
constexpr int64_t kNearBytes = 2048;

inline int rows_per_block(int64_t half, int64_t m) {
  if (4 * half <= kNearBytes) return m == 1 ? 4 : 2;
  return m == 1 || (m == 2 && !amd_zen5_or_later()) ? 1 : 2;
}

template <typename M>
void nvfp4_rows(const typename M::X* xp, int64_t n, const Groups& L, const uint8_t* codes, const uint8_t* scales,
                const float* row_scale, int64_t out, float* y) {
  const int64_t in = L.in, half = in / 2, nb = in / kGroup;
  const int64_t grain = std::max<int64_t>(4, grain_rows(half + nb) / 4 * 4);
  const int64_t pass = x_rows_per_pass(L.kp * static_cast<int64_t>(sizeof(typename M::X)));
  const int64_t most = max_rows_per_piece();
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    const Consts k;
    // the first k.ahead bytes of the range, which the prefetches in the group loop run ahead of
    for (int64_t b = 0; b < std::min(k.ahead, (r1 - r0) * half); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + r0 * half + b), _MM_HINT_T0);
    for (int64_t b = 0; b < std::min(k.ahead / 8, (r1 - r0) * nb); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(scales + r0 * nb + b), _MM_HINT_T0);
    for (int64_t p0 = 0; p0 < n; p0 += pass) {
      const int64_t m = std::min(pass, n - p0);
      const int64_t pieces = (m + most - 1) / most;
      const int want = rows_per_block(half, m);
      for (int64_t r = r0; r < r1; r += 4) {
        const int64_t here = std::min<int64_t>(4, r1 - r);
        for (int64_t piece = 0, i0 = p0; piece < pieces; ++piece) {
          const int size = static_cast<int>((p0 + m - i0 + (pieces - piece) - 1) / (pieces - piece));
          for (int64_t q = 0; q < here;) {
            const int64_t fit = std::min<int64_t>(want, here - q), R = fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
            const BlockArgs<M> a{codes + (r + q) * half, scales + (r + q) * nb, half, nb, xp + i0 * L.kp, L.kp};
            float* ys = y + i0 * out + r + q;
            if (R == 4)  // one row of x
              block<M, 4, 1>(k, L, a, row_scale + r + q, ys, out);
            else if (R == 2)
              block_n<M, 2>(size, k, L, a, row_scale + r + q, ys, out);
            else
              block_n<M, 1>(size, k, L, a, row_scale + r + q, ys, out);
            q += R;
          }
          i0 += size;
        }
      }
    }
  });
}

HR_AVX512 inline __m512 fp8x16_to_float(const uint8_t* s, __mmask16 valid) {
  return fp8_to_float_no_denormals(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, s)));
}

HR_AVX512 void row_scales_avx512(const uint8_t* s, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; b += 16) {
    const int64_t left = std::min<int64_t>(16, nblocks - b);
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(out + b, m, fp8x16_to_float(s + b, m));
  }
}

}  // namespace

void nvfp4_linear_avx512_bf16(const uint16_t* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                              const float* row_scale, int64_t out, float* y) {
  const Groups L(in);
  // on 64-byte boundaries (L.kp is a multiple of 128 elements, so every row is): a load of x
  // split across two cache lines costs two, and a piece of five rows loads five x vectors for
  // every ten dot products (5 rows of the real target's layers on Zen 5: 0.85x the time)
  Aligned<uint16_t> xp(n * L.kp);
  permute_x(x, n, L, xp.data(), false);
  nvfp4_rows<Bf16Mode>(xp.data(), n, L, codes, scales, row_scale, out, y);
}

void nvfp4_linear_avx512(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                         const float* row_scale, int64_t out, float* y) {
  const Groups L(in);
  Aligned<float> xp(n * L.kp);
  permute_x(x, n, L, xp.data(), true);
  nvfp4_rows<Fp32Mode>(xp.data(), n, L, codes, scales, row_scale, out, y);
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
