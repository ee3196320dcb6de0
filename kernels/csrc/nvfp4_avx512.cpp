// NVFP4 x @ W.T with AVX-512: bf16 x on vdpbf16ps (AVX512-BF16), float32 x on FMA (AVX-512F),
// and bit-exact dequantisation.
//
// Decoding costs shuffles, and on the CPUs this targets shuffles share execution ports with
// the dot products, so the decoder spends one permute per 32 weights: the weights come out
// unscaled, each block's fp8 scale multiplies its partial sum instead.
//
// A group of 16 blocks (256 inputs, 128 code bytes) is laid out one block per 32-bit lane: two
// dword permutes gather block m's bytes 0-3 into lane m of V0 and its bytes 4-7 into V1. A
// 16-bit word of V holds four codes (elements e..e+3 of its block); vpermw looks up the word's
// low 5 bits in a 32-entry table (E2M1 as bf16, twice, so bit 4 is ignored), so V, V >> 4,
// V >> 8 and V >> 12 decode to four vectors of 32 exact bf16 weights. All eight vectors of a
// group map lane m to block m, so for each row of x
//     t0 = sum over vectors 0-3 of vdpbf16ps(weights, x), t1 = over vectors 4-7  (fp32, from 0)
//     acc = fma(t1, S, fma(t0, S, acc))                          (S: the 16 block scales)
// and y = reduce(acc) * row_scale (two short chains of dot products keep more of them in flight
// than one long one). A row's last blocks form a group of 16 (masked) or of 8
// (one vector per code shift, lanes 8-15 holding the blocks' second halves). x is permuted once
// per call to the weights' order (elem() below), zero beyond in. Float32 x uses the same
// weights widened exactly (a bf16 is the top half of its float32), two FMAs per vector.
//
// Up to 16 rows of x (while they fit L1; 4 rows always) each weight row is decoded in registers
// and multiplied straight away, once per group of up to 8 rows of x (one sequential stream of
// codes). More rows: each thread decodes 16 weight rows into an L1/L2 tile (weights and scales
// as above) and multiplies it with every row of x, 3 x rows by 4 weight rows at a time, in
// passes of x that fit L2. Every (weight row, x row) pair performs exactly the same operations
// in the same order either way, so rows are batch-invariant.
#include <utility>

#include "cpu_kernels.h"

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

// No byte with a zero exponent (fp8 subnormal or zero) and no sign bit: the scales convert by
// moving bits. (0: not plain.)
inline bool plain_scales(uint64_t q) {  // usual: ModelOpt's block scales are positive normals
  if (q == 0) return false;
  const uint64_t e = q & 0x7878787878787878ull;
  return ((e - 0x0101010101010101ull) & ~e & 0x8080808080808080ull) == 0 && (q & 0x8080808080808080ull) == 0;
}

// 16 fp8 e4m3 values (one per dword of d) -> float, exact, no denormal arithmetic: normal
// numbers by moving the bits into float32 position, subnormals as m * 2^-9.
HR_AVX512 inline __m512 fp8_to_float(__m512i d) {
  const __m512i mag = _mm512_and_si512(d, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// 16 scale bytes (lane l's block scale in byte l) -> 16 floats.
HR_AVX512 inline __m512 lane_scales(__m128i b, uint64_t lo, uint64_t hi) {
  const __m512i d = _mm512_cvtepu8_epi32(b);
  if (__builtin_expect(plain_scales(lo) && plain_scales(hi), 1))
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(d, 20), _mm512_set1_epi32(120 << 23)));
  return fp8_to_float(d);
}

// The decoder's constant vectors, loaded once per row range.
struct Consts {
  __m512i table, even, odd, halves8;
  HR_AVX512 Consts()
      : table(_mm512_load_si512(kE2M1Bf16x2)), even(_mm512_load_si512(kEvenDwords)),
        odd(_mm512_load_si512(kOddDwords)), halves8(_mm512_load_si512(kHalves8)) {}
};

// One group: `width` 16 or 8 blocks, `valid` of them present -> its code words, one block per
// dword lane (width 16: v[0] the blocks' bytes 0-3, v[1] bytes 4-7; width 8: v[0]), and the
// lanes' block scales.
template <int W>
HR_AVX512 inline void group_words(const Consts& k, const uint8_t* c, const uint8_t* s, int valid,
                                  __m512i (&v)[W / 8], __m512& S) {
  __m128i sb;
  uint64_t lo = 0, hi = 0;
  if constexpr (W == 16) {
    __m512i a, b;
    if (valid == 16) {
      a = _mm512_loadu_si512(c);
      b = _mm512_loadu_si512(c + 64);
      sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      std::memcpy(&lo, s, 8);
      std::memcpy(&hi, s + 8, 8);
    } else {  // missing blocks: codes 0 and scale 0 (not plain: the exact conversion)
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
    if (valid == 8) std::memcpy(&lo, s, 8), hi = lo;
    v[0] = _mm512_permutexvar_epi32(k.halves8, a);
  }
  S = lane_scales(sb, lo, hi);
}

// Weight vector `vi` of a group (width / 2 of them): the codes at shift 4 * (vi % 4) of v[vi / 4].
template <int W>
HR_AVX512 inline __m512i weight_vector(const Consts& k, const __m512i (&v)[W / 8], int vi) {
  const __m512i words = v[vi / 4];
  const int shift = 4 * (vi % 4);
  return _mm512_permutexvar_epi16(shift ? _mm512_srli_epi16(words, shift) : words, k.table);
}

template <int W>
HR_AVX512 inline void decode_group(const Consts& k, const uint8_t* c, const uint8_t* s, int valid,
                                   __m512i (&o)[W / 2], __m512& S) {
  __m512i v[W / 8];
  group_words<W>(k, c, s, valid, v, S);
  for (int vi = 0; vi < W / 2; ++vi) o[vi] = weight_vector<W>(k, v, vi);
}

// How decoded weight vectors meet x: bf16 x with vdpbf16ps, or float32 x with the weights
// widened to two float vectors (low words, high words) and FMA. kUnits: 64-byte vectors a
// decoded bf16 vector takes in a tile.
struct Bf16Mode {
  using X = uint16_t;
  static constexpr int kUnits = 1;
  // x straight from memory into the dot product (gcc 12 otherwise passes the load through the
  // stack on its way to the bf16 vector type)
  static HR_AVX512BF16 inline __m512 dot(__m512 t, __m512i o, const uint16_t* x) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(t) : "v"(o), "m"(*reinterpret_cast<const __m512i*>(x)));
    return t;
  }
  // The same at x + kOffset elements, the offset an immediate: one base register per row of x,
  // which gcc otherwise multiplies into a register (and a spill) per row and vector.
  template <int kOffset>
  static HR_AVX512BF16 inline __m512 dot_at(__m512 t, __m512i o, const uint16_t* x) {
    __asm__("vdpbf16ps %c[off](%[x]), %[o], %[t]" : [t] "+v"(t) : [o] "v"(o), [x] "r"(x), [off] "i"(kOffset * 2));
    return t;
  }
  static HR_AVX512 inline void store(__m512i o, __m512i* t) { _mm512_store_si512(t, o); }
  // A tile unit (the stored vector) against x: the same operation as dot.
  static HR_AVX512 inline __m512i load_x(const uint16_t* x) { return _mm512_loadu_si512(x); }
  static HR_AVX512BF16 inline __m512 dot_unit(__m512 t, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(t, (__m512bh)w, (__m512bh)x);
  }
};

struct Fp32Mode {
  using X = float;
  static constexpr int kUnits = 2;
  static HR_AVX512 inline __m512 low(__m512i o) { return _mm512_castsi512_ps(_mm512_slli_epi32(o, 16)); }
  static HR_AVX512 inline __m512 high(__m512i o) {
    return _mm512_castsi512_ps(_mm512_and_si512(o, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static HR_AVX512 inline __m512 dot(__m512 t, __m512i o, const float* x) {
    t = _mm512_fmadd_ps(low(o), _mm512_loadu_ps(x), t);
    return _mm512_fmadd_ps(high(o), _mm512_loadu_ps(x + 16), t);
  }
  template <int kOffset>
  static HR_AVX512 inline __m512 dot_at(__m512 t, __m512i o, const float* x) {
    const __m512 lo = low(o), hi = high(o);
    __asm__("vfmadd231ps %c[off](%[x]), %[w], %[t]" : [t] "+v"(t) : [w] "v"(lo), [x] "r"(x), [off] "i"(kOffset * 4));
    __asm__("vfmadd231ps %c[off](%[x]), %[w], %[t]" : [t] "+v"(t) : [w] "v"(hi), [x] "r"(x), [off] "i"(kOffset * 4 + 64));
    return t;
  }
  static HR_AVX512 inline void store(__m512i o, __m512i* t) {
    _mm512_store_ps(reinterpret_cast<float*>(t), low(o));
    _mm512_store_ps(reinterpret_cast<float*>(t + 1), high(o));
  }
  // Units: the low-word floats (x + 0..15), then the high-word floats (x + 16..31), as in dot.
  static HR_AVX512 inline __m512 load_x(const float* x) { return _mm512_loadu_ps(x); }
  static HR_AVX512 inline __m512 dot_unit(__m512 t, __m512i w, __m512 x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), x, t);
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

// Weight vector VI of a group (from its code words `words`), times N rows of x, into t.
template <typename M, int N, int VI>
HR_AVX512BF16 inline void dot_vector(const Consts& k, __m512i words, const typename M::X* const (&x)[N],
                                     __m512 (&t)[N]) {
  constexpr int kShift = 4 * (VI % 4);
  __m512i idx = words;
  if constexpr (kShift != 0) idx = _mm512_srli_epi16(words, kShift);
  const __m512i o = _mm512_permutexvar_epi16(idx, k.table);
  for (int i = 0; i < N; ++i) t[i] = M::template dot_at<VI * 32>(t[i], o, x[i]);
}

// One half of a group: its vectors' dot products from 0, then acc[i] = fma(t, S, acc[i]).
template <typename M, int N, int W, int H, int... U>
HR_AVX512BF16 inline void fused_half(const Consts& k, const __m512i (&v)[W / 8], __m512 S,
                                     const typename M::X* const (&x)[N], __m512 (&acc)[N],
                                     std::integer_sequence<int, U...>) {
  __m512 t[N];
  for (int i = 0; i < N; ++i) t[i] = _mm512_setzero_ps();
  constexpr int kHalf = W / 4;  // vectors per half
  (dot_vector<M, N, H * kHalf + U>(k, v[(H * kHalf + U) / 4], x, t), ...);
  for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(t[i], S, acc[i]);
}

// One group of one weight row against N rows of x: for each half of the group's vectors,
// t = its dot products from 0, acc[i] = fma(t, S, acc[i]). Each weight vector is decoded right
// before its dot products, so up to 8 rows of x fit the registers.
template <typename M, int N, int W>
HR_AVX512BF16 inline void fused_group(const Consts& k, const uint8_t* c, const uint8_t* s, int valid,
                                      const typename M::X* x, int64_t ldx, __m512 (&acc)[N]) {
  __m512i v[W / 8];
  __m512 S;
  group_words<W>(k, c, s, valid, v, S);
  const typename M::X* rows[N];
  for (int i = 0; i < N; ++i) rows[i] = x + i * ldx;
  fused_half<M, N, W, 0>(k, v, S, rows, acc, std::make_integer_sequence<int, W / 4>{});
  fused_half<M, N, W, 1>(k, v, S, rows, acc, std::make_integer_sequence<int, W / 4>{});
}

// The hardware prefetchers fall short of the memory's bandwidth on a stream this compute-heavy
// (one core's share of it is about 15 GB/s when both stream): ask for the codes kAheadBytes ahead
// of the group being decoded, and for the scales as far ahead in their own (8 times slower) stream.
constexpr int64_t kAheadBytes = 2048;
inline void prefetch_ahead(const uint8_t* c, const uint8_t* s, int64_t g) {
  _mm_prefetch(reinterpret_cast<const char*>(c + kAheadBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(c + kAheadBytes + 64), _MM_HINT_T0);
  if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(s + kAheadBytes / 8), _MM_HINT_T0);
}

// y[i * out] for one weight row (codes c, scales s) and N rows of x.
template <typename M, int N>
HR_AVX512BF16 void fused_row(const Consts& k, const Groups& L, const uint8_t* c, const uint8_t* s, float row_scale,
                             const typename M::X* xp, float* y, int64_t out) {
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = L.full, kp = L.kp;
  for (int64_t g = 0; g < full; ++g) {
    prefetch_ahead(c + g * 128, s + g * 16, g);
    fused_group<M, N, 16>(k, c + g * 128, s + g * 16, 16, xp + g * 256, kp, acc);
  }
  if (L.tail_width == 16)
    fused_group<M, N, 16>(k, c + full * 128, s + full * 16, static_cast<int>(L.tail_blocks), xp + full * 256, kp, acc);
  else if (L.tail_width == 8)
    fused_group<M, N, 8>(k, c + full * 128, s + full * 16, static_cast<int>(L.tail_blocks), xp + full * 256, kp, acc);
  for (int i = 0; i < N; ++i) y[i * out] = _mm512_reduce_add_ps(acc[i]) * row_scale;
}

// Rows r0 .. r1 - 1 against the n (at most kFusedRows) rows of x, in groups of up to 8 rows of x
// of near-equal size; a weight row is decoded once per group.
template <typename M>
HR_AVX512 void fused_rows(const typename M::X* xp, int64_t n, const Groups& L, const uint8_t* codes,
                          const uint8_t* scales, const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t out) {
  const Consts k;
  const int64_t groups = (n + 7) / 8, half = L.in / 2, nb = L.in / kGroup;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* c = codes + r * half;
    const uint8_t* s = scales + r * nb;
    for (int64_t g = 0, i0 = 0; g < groups; ++g) {
      const int64_t m = (n - i0 + (groups - g) - 1) / (groups - g);
      const typename M::X* xs = xp + i0 * L.kp;
      float* ys = y + i0 * out + r;
      switch (m) {
        case 1: fused_row<M, 1>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 2: fused_row<M, 2>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 3: fused_row<M, 3>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 4: fused_row<M, 4>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 5: fused_row<M, 5>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 6: fused_row<M, 6>(k, L, c, s, row_scale[r], xs, ys, out); break;
        case 7: fused_row<M, 7>(k, L, c, s, row_scale[r], xs, ys, out); break;
        default: fused_row<M, 8>(k, L, c, s, row_scale[r], xs, ys, out); break;
      }
      i0 += m;
    }
  }
}

// A tile row: per group, its decoded vectors (kUnits each) then its scales, 64-byte vectors.
template <typename M>
int64_t tile_row_vectors(const Groups& L) {
  return L.full * (8 * M::kUnits + 1) + (L.tail_width ? L.tail_width / 2 * M::kUnits + 1 : 0);
}

template <typename M, int W>
HR_AVX512 inline __m512i* tile_group(const Consts& k, const uint8_t* c, const uint8_t* s, int valid, __m512i* t) {
  __m512i o[W / 2];
  __m512 S;
  _mm_prefetch(reinterpret_cast<const char*>(c + 1024), _MM_HINT_T0);
  decode_group<W>(k, c, s, valid, o, S);
  for (int v = 0; v < W / 2; ++v) M::store(o[v], t + v * M::kUnits);
  _mm512_store_ps(reinterpret_cast<float*>(t + W / 2 * M::kUnits), S);
  return t + W / 2 * M::kUnits + 1;
}

template <typename M>
HR_AVX512 void decode_tile(const Groups& L, const uint8_t* codes, const uint8_t* scales, int64_t r, int64_t rows,
                           __m512i* tile) {
  const int64_t half = L.in / 2, nb = L.in / kGroup, stride = tile_row_vectors<M>(L);
  const Consts k;
  for (int64_t q = 0; q < rows; ++q) {
    const uint8_t* c = codes + (r + q) * half;
    const uint8_t* s = scales + (r + q) * nb;
    __m512i* t = tile + q * stride;
    for (int64_t g = 0; g < L.full; ++g) t = tile_group<M, 16>(k, c + g * 128, s + g * 16, 16, t);
    const int64_t g = L.full;
    if (L.tail_width == 16)
      tile_group<M, 16>(k, c + g * 128, s + g * 16, L.valid(g), t);
    else if (L.tail_width == 8)
      tile_group<M, 8>(k, c + g * 128, s + g * 16, L.valid(g), t);
  }
}

// R tile rows against G rows of x: the same operations, in the same order, as fused_rows.
template <typename M, int R, int G>
HR_AVX512BF16 void tile_block(const __m512i* tile, int64_t stride, const Groups& L, const typename M::X* x,
                              float (&res)[R][G]) {
  __m512 acc[R][G];
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) acc[q][i] = _mm512_setzero_ps();
  const __m512i* t = tile;
  const int64_t groups = L.count(), full = L.full, kp = L.kp;
  const int tail_vectors = static_cast<int>(L.tail_width / 2);
  for (int64_t g = 0; g < groups; ++g) {
    const int vectors = g < full ? 8 : tail_vectors;
    const typename M::X* xg = x + g * 256;
    for (int h = 0; h < 2; ++h) {  // the group's halves, each summed from 0 then scaled in
      __m512 part[R][G];
      for (int q = 0; q < R; ++q)
        for (int i = 0; i < G; ++i) part[q][i] = _mm512_setzero_ps();
      for (int v = h * vectors / 2; v < (h + 1) * vectors / 2; ++v) {
        for (int u = 0; u < M::kUnits; ++u) {
          __m512i w[R];
          for (int q = 0; q < R; ++q) w[q] = _mm512_load_si512(t + q * stride + v * M::kUnits + u);
          for (int i = 0; i < G; ++i) {
            const auto xv = M::load_x(xg + i * kp + v * 32 + u * 16);
            for (int q = 0; q < R; ++q) part[q][i] = M::dot_unit(part[q][i], w[q], xv);
          }
        }
      }
      for (int q = 0; q < R; ++q) {
        const __m512 S = _mm512_load_ps(reinterpret_cast<const float*>(t + q * stride + vectors * M::kUnits));
        for (int i = 0; i < G; ++i) acc[q][i] = _mm512_fmadd_ps(part[q][i], S, acc[q][i]);
      }
    }
    t += vectors * M::kUnits + 1;
  }
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < G; ++i) res[q][i] = _mm512_reduce_add_ps(acc[q][i]);
}

template <typename M, int R, int G>
void tile_times_x(const __m512i* tile, int64_t stride, const Groups& L, const typename M::X* x, int64_t n,
                  int64_t r, const float* row_scale, float* y, int64_t out) {
  int64_t i0 = 0;
  for (; i0 + G <= n; i0 += G) {
    float res[R][G];
    tile_block<M, R, G>(tile, stride, L, x + i0 * L.kp, res);
    for (int q = 0; q < R; ++q)
      for (int i = 0; i < G; ++i) y[(i0 + i) * out + r + q] = res[q][i] * row_scale[r + q];
  }
  if constexpr (G > 1) {
    if (i0 < n) tile_times_x<M, R, G - 1>(tile, stride, L, x + i0 * L.kp, n - i0, r, row_scale, y + i0 * out, out);
  }
}

constexpr int64_t kFusedRows = 16;  // rows of x up to which weights are decoded in registers
constexpr int64_t kFusedBytes = 32 << 10;  // ... while those rows of x fit L1
constexpr int64_t kTileRows = 16;

template <typename M>
void nvfp4_rows(const typename M::X* xp, int64_t n, const Groups& L, const uint8_t* codes, const uint8_t* scales,
                const float* row_scale, int64_t out, float* y) {
  const int64_t in = L.in;
  int64_t grain = grain_rows(in / 2 + in / kGroup);
  const int64_t x_bytes = n * L.kp * static_cast<int64_t>(sizeof(typename M::X));
  if (n <= 4 || (n <= kFusedRows && x_bytes <= kFusedBytes)) {
    at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
      fused_rows<M>(xp, n, L, codes, scales, row_scale, r0, r1, y, out);
    });
    return;
  }
  grain = (grain + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t stride = tile_row_vectors<M>(L);
  const int64_t pass = x_rows_per_pass(L.kp * static_cast<int64_t>(sizeof(typename M::X)));
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    Aligned<__m512i> tile(kTileRows * stride);
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, r1 - r);
      decode_tile<M>(L, codes, scales, r, rows, tile.data());
      for (int64_t i0 = 0; i0 < n; i0 += pass) {
        const int64_t m = std::min(pass, n - i0);
        const typename M::X* xs = xp + i0 * L.kp;
        float* ys = y + i0 * out;
        int64_t q = 0;
        for (; q + 4 <= rows; q += 4)
          tile_times_x<M, 4, 3>(tile.data() + q * stride, stride, L, xs, m, r + q, row_scale, ys, out);
        for (; q < rows; ++q)
          tile_times_x<M, 1, 4>(tile.data() + q * stride, stride, L, xs, m, r + q, row_scale, ys, out);
      }
    }
  });
}

HR_AVX512 inline __m512 fp8x16_to_float(const uint8_t* s, __mmask16 valid) {
  return fp8_to_float(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, s)));
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
  std::vector<uint16_t> xp(n * L.kp);
  permute_x(x, n, L, xp.data(), false);
  nvfp4_rows<Bf16Mode>(xp.data(), n, L, codes, scales, row_scale, out, y);
}

void nvfp4_linear_avx512(const float* x, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                         const float* row_scale, int64_t out, float* y) {
  const Groups L(in);
  std::vector<float> xp(n * L.kp);
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
