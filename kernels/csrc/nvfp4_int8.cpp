// NVFP4 weights times int8 activations: the drafter's projections where the CPU has AVX2 but no
// AVX-512 (docs/drafter.md).
//
// With bf16 or float32 activations an NVFP4 row costs an E2M1 decode and a widening per weight,
// and on AVX2 that is compute-bound: SmolLM2-135M's 77 MB step took 10 ms, a quarter of the
// bandwidth two cores have. Twice an E2M1 value is an integer in -12 .. 12, so with each block
// of 16 activations quantised to int8 (its own scale) a block's dot product is integer work:
// vpshufb maps a code to 2 e2m1 + 12 (unsigned, 0 .. 24), vpmaddubsw / vpmaddwd multiply and add
// it with the int8 activations, and 12 times the activations' sum, kept beside them, takes the
// offset off again. One float FMA a block applies the two scales. A drafter's numbers change a
// little (its drafts, never the target's output).
//
// Quantised row (quantize_i8_*): per group of 64 inputs, 128 bytes, so the codes load as they
// are stored (the low nibble of byte m is input 2m, the high one input 2m + 1):
//   int8 even[32]   q of inputs 0, 2, .., 62 of the group
//   int8 odd[32]    q of inputs 1, 3, .., 63
//   int32 corr[8]   lane j: 12 * (sum of q over inputs 8j .. 8j + 7)
//   float a[8]      lane j: the scale of block j / 2 (its 16 inputs 16 (j / 2) ..)
// A block's scale is a = amax / 127 and q = round-to-even(x * (127 / amax)) (0 for an all-zero
// block); inputs past `in` (a last group of fewer than 64) are zero.
//
// y[i, r] = (sum over lanes of acc) * (row_scale[r] / 2), where each group adds to lane j
//   float(dot_j - corr_j) * (s_{j/2} * a_j)      (one FMA, the product rounded first)
// dot_j = sum over m = 4j .. 4j+3 of T[lo(c_m)] even_m + T[hi(c_m)] odd_m, T[c] = 2 e2m1(c) + 12,
// s the block scale as a float, exact: from its bits where every scale of the weight row is a
// positive normal e4m3 number (2 integer operations), else as the integer k = s * 2^9 (every
// e4m3 value is one, |k| <= 448 * 512) times 2^-9, so zero, subnormal and negative scales need
// no float denormal, which a thread flushing denormals would lose. The 2 is T's. Lanes sum in
// reduce8's tree. The portable loops do the same operations in the same order: the same bits as
// the AVX2 kernel, every row on its own.
#include "cpu_kernels.h"

namespace hetero_run_cpu {

namespace {

constexpr int8_t kTable[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // 2 e2m1 + 12
constexpr float kUnit = 1.f / 512.f;  // 2^-9, the unit of scale_units

inline float block_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

// An e4m3 value in units of 2^-9: (8 + m) << (e - 1), or m when e = 0; signed.
inline int32_t scale_units(uint8_t s) {
  const int32_t e = (s >> 3) & 15, m = s & 7;
  const int32_t k = e ? (8 | m) << (e - 1) : m;
  return (s & 0x80) ? -k : k;
}

// The zero-padded copy of a row's last, partial group of codes and block scales.
struct TailGroup {
  alignas(32) uint8_t codes[32] = {};
  uint8_t scales[4] = {};
  TailGroup(const uint8_t* c, const uint8_t* s, int64_t in) {
    const int64_t left = in % kI8Group;
    std::memcpy(codes, c, left / 2);
    std::memcpy(scales, s, left / kGroup);
  }
};

}  // namespace

void quantize_i8_portable(const float* x, int64_t in, uint8_t* out) {
  const int64_t groups = i8_groups(in);
  for (int64_t g = 0; g < groups; ++g) {
    float v[kI8Group] = {};
    const int64_t have = std::min<int64_t>(kI8Group, in - g * kI8Group);
    std::memcpy(v, x + g * kI8Group, have * sizeof(float));
    int8_t q[kI8Group];
    float a[4];
    for (int b = 0; b < 4; ++b) {
      float amax = 0.f;
      for (int e = 0; e < 16; ++e) amax = std::max(amax, std::fabs(v[16 * b + e]));
      const float inv = block_inverse(amax);
      for (int e = 0; e < 16; ++e) q[16 * b + e] = static_cast<int8_t>(std::nearbyint(v[16 * b + e] * inv));
      a[b] = amax / 127.f;
    }
    uint8_t* o = out + g * kI8GroupBytes;
    int32_t corr[8];
    float lanes[8];
    for (int m = 0; m < 32; ++m) {
      o[m] = static_cast<uint8_t>(q[2 * m]);
      o[32 + m] = static_cast<uint8_t>(q[2 * m + 1]);
    }
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int e = 0; e < 8; ++e) s += q[8 * j + e];
      corr[j] = 12 * s;
      lanes[j] = a[j / 2];
    }
    std::memcpy(o + 64, corr, sizeof(corr));
    std::memcpy(o + 96, lanes, sizeof(lanes));
  }
}

void nvfp4_i8_rows_portable(const uint8_t* xq, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                            const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t groups = i8_groups(in), half = in / 2, nb = in / kGroup, xbytes = groups * kI8GroupBytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* cr = codes + r * half;
    const uint8_t* sr = scales + r * nb;
    const TailGroup tail(cr + (in / kI8Group) * 32, sr + (in / kI8Group) * 4, in);
    for (int64_t i = 0; i < n; ++i) {
      float acc[8] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const bool full = (g + 1) * kI8Group <= in;
        const uint8_t* c = full ? cr + g * 32 : tail.codes;
        const uint8_t* s = full ? sr + g * 4 : tail.scales;
        const uint8_t* xg = xq + i * xbytes + g * kI8GroupBytes;
        const auto* even = reinterpret_cast<const int8_t*>(xg);
        const auto* odd = even + 32;
        int32_t corr[8];
        float lanes[8];
        std::memcpy(corr, xg + 64, sizeof(corr));
        std::memcpy(lanes, xg + 96, sizeof(lanes));
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int m = 4 * j; m < 4 * j + 4; ++m)
            dot += kTable[c[m] & 15] * even[m] + kTable[c[m] >> 4] * odd[m];
          const float scale = static_cast<float>(scale_units(s[j / 2])) * kUnit * lanes[j];
          acc[j] = std::fma(static_cast<float>(dot - corr[j]), scale, acc[j]);
        }
      }
      const float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
      y[i * y_stride + r - r0] = sum * (row_scale[r] * 0.5f);
    }
  }
}

#if HR_X86
namespace {

// The 8 int32 sums q[8j] + .. + q[8j + 7] of 8 vectors of 8 int32 each (exact, any order).
HR_AVX2 inline __m256i lane_sums(const __m256i* q) {
  const __m256i t0 = _mm256_hadd_epi32(q[0], q[1]), t1 = _mm256_hadd_epi32(q[2], q[3]);
  const __m256i t2 = _mm256_hadd_epi32(q[4], q[5]), t3 = _mm256_hadd_epi32(q[6], q[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);  // each 128-bit half: 4 partial sums
  const __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(u0), _mm256_extracti128_si256(u0, 1));
  const __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(u1), _mm256_extracti128_si256(u1, 1));
  return _mm256_set_m128i(s1, s0);
}

// scale_units of 8 bytes, one in the low byte of each int32 lane.
HR_AVX2 inline __m256 scale_units8(__m256i v) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(v, 3), _mm256_set1_epi32(15));
  const __m256i normal = _mm256_cmpgt_epi32(e, _mm256_setzero_si256());  // -1 where e > 0
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(7)),
                                       _mm256_and_si256(normal, _mm256_set1_epi32(8)));
  __m256i k = _mm256_sllv_epi32(mant, _mm256_add_epi32(e, normal));
  const __m256i neg = _mm256_cmpgt_epi32(v, _mm256_set1_epi32(127));
  k = _mm256_sub_epi32(_mm256_xor_si256(k, neg), neg);
  return _mm256_cvtepi32_ps(k);
}

// 32 int32 in 4 vectors (inputs 0..31 in order) -> 32 int8: even inputs in the low 16 bytes, odd
// in the high 16.
HR_AVX2 inline __m256i pack_split(const __m256i* q) {
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  __m256i b = _mm256_packs_epi16(w01, w23);  // dwords: q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, ..
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // inputs 0..31 in order
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  b = _mm256_shuffle_epi8(b, split);                  // qwords: even 0-15, odd 0-15 | even 16-31, odd 16-31
  return _mm256_permute4x64_epi64(b, 0xD8);           // even 0-31 | odd 0-31
}

// The block scales of one group, each twice, [s0, s0, s1, s1, s2, s2, s3, s3] as floats: from
// the bits where every scale of the row is a positive normal number (`normal`), else by
// scale_units8.
template <bool normal>
HR_AVX2 inline __m256 group_scales(const uint8_t* s) {
  const __m256i spread = _mm256_setr_epi8(0, -128, -128, -128, 0, -128, -128, -128, 1, -128, -128, -128, 1, -128, -128,
                                          -128, 2, -128, -128, -128, 2, -128, -128, -128, 3, -128, -128, -128, 3, -128,
                                          -128, -128);
  int32_t four;
  std::memcpy(&four, s, 4);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread);
  if (normal)  // e4m3 (e, m) -> float32 (e + 120, m << 20): exact for e >= 1
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(bytes, 20), _mm256_set1_epi32(120 << 23)));
  return _mm256_mul_ps(scale_units8(bytes), _mm256_set1_ps(kUnit));
}

// Whether every byte of s [count] is an e4m3 positive normal number (0x08 .. 0x7F).
HR_AVX2 inline bool all_normal(const uint8_t* s, int64_t count) {
  int64_t e = 0;
  for (; e + 32 <= count; e += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + e));
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi8(v, _mm256_set1_epi8(7))) != -1) return false;
  }
  for (; e < count; ++e)
    if (s[e] < 8 || s[e] > 0x7F) return false;
  return true;
}

// acc[w * T + k] += one group of R weight rows (codes c[w] [32], scales s[w] [4]) against T rows
// of x (xg, xbytes apart): each weight row's codes decoded once for the T rows, each row of x
// loaded once for the R weight rows.
template <int R, int T, bool normal>
HR_AVX2 inline void i8_group(const uint8_t* xg, int64_t xbytes, const uint8_t* const* c, const uint8_t* const* s,
                             __m256* acc) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kTable)));
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i wl[R], wh[R];
  __m256 f[R];
  for (int w = 0; w < R; ++w) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c[w]));
    wl[w] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
    wh[w] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    f[w] = group_scales<normal>(s[w]);
  }
  for (int k = 0; k < T; ++k) {
    const uint8_t* xk = xg + k * xbytes;
    const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk));
    const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + 32));
    const __m256i corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + 64));
    const __m256 a = _mm256_loadu_ps(reinterpret_cast<const float*>(xk + 96));
    for (int w = 0; w < R; ++w) {
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wl[w], xe), _mm256_maddubs_epi16(wh[w], xo));
      const __m256i dot = _mm256_sub_epi32(_mm256_madd_epi16(p, ones), corr);
      acc[w * T + k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(f[w], a), acc[w * T + k]);
    }
  }
}

// sums[w * T + k] = the lane sums of R weight rows (codes cr[w], scales sr[w]) against T rows of x.
// Each weight row's codes are asked for `ahead` bytes before they are used (its scales an eighth
// of that), as the float kernels do: without it a step waited for memory and computed by turns.
template <int R, int T, bool normal>
HR_AVX2 inline void i8_tile(const uint8_t* xq, int64_t xbytes, int64_t in, const uint8_t* const* cr,
                            const uint8_t* const* sr, int64_t ahead, float* sums) {
  __m256 acc[R * T];
  for (int k = 0; k < R * T; ++k) acc[k] = _mm256_setzero_ps();
  const int64_t full = in / kI8Group;
  const uint8_t* c[R];
  const uint8_t* s[R];
  for (int64_t g = 0; g < full; ++g) {
    for (int w = 0; w < R; ++w) {
      c[w] = cr[w] + g * 32, s[w] = sr[w] + g * 4;
      _mm_prefetch(reinterpret_cast<const char*>(c[w] + ahead), _MM_HINT_T0);
      if ((g & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(s[w] + ahead / 8), _MM_HINT_T0);
    }
    i8_group<R, T, normal>(xq + g * kI8GroupBytes, xbytes, c, s, acc);
  }
  if (full < i8_groups(in)) {
    const TailGroup first(cr[0] + full * 32, sr[0] + full * 4, in);
    const TailGroup last(cr[R - 1] + full * 32, sr[R - 1] + full * 4, in);
    c[0] = first.codes, s[0] = first.scales;
    c[R - 1] = last.codes, s[R - 1] = last.scales;
    i8_group<R, T, normal>(xq + full * kI8GroupBytes, xbytes, c, s, acc);
  }
  for (int k = 0; k < R * T; ++k) sums[k] = reduce8(acc[k]);
}

// R weight rows (R = 1 or 2) against all n rows of x, in tiles of up to 4 / R rows of x; row w
// of the weights into y[i * y_stride + w].
template <int R, bool normal>
HR_AVX2 void i8_rows(const uint8_t* xq, int64_t n, int64_t xbytes, int64_t in, const uint8_t* const* cr,
                     const uint8_t* const* sr, const float* rs, int64_t ahead, float* y, int64_t y_stride) {
  constexpr int kMaxT = 4 / R;
  float sums[4];
  for (int64_t i = 0; i < n; i += kMaxT) {
    const int64_t t = std::min<int64_t>(kMaxT, n - i);
    const uint8_t* xi = xq + i * xbytes;
    if (t == 4) i8_tile<R, (kMaxT >= 4 ? 4 : 1), normal>(xi, xbytes, in, cr, sr, ahead, sums);
    else if (t == 3) i8_tile<R, (kMaxT >= 3 ? 3 : 1), normal>(xi, xbytes, in, cr, sr, ahead, sums);
    else if (t == 2) i8_tile<R, 2, normal>(xi, xbytes, in, cr, sr, ahead, sums);
    else i8_tile<R, 1, normal>(xi, xbytes, in, cr, sr, ahead, sums);
    for (int w = 0; w < R; ++w)
      for (int64_t k = 0; k < t; ++k) y[(i + k) * y_stride + w] = sums[w * t + k] * rs[w];
  }
}

}  // namespace

HR_AVX2 void quantize_i8_avx2(const float* x, int64_t in, uint8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const int64_t groups = i8_groups(in);
  for (int64_t g = 0; g < groups; ++g) {
    alignas(32) float v[kI8Group] = {};
    const float* src = x + g * kI8Group;
    if ((g + 1) * kI8Group > in) {
      std::memcpy(v, src, (in - g * kI8Group) * sizeof(float));
      src = v;
    }
    __m256i q[8];
    alignas(32) float lanes[8];
    for (int b = 0; b < 4; ++b) {
      const __m256 x0 = _mm256_loadu_ps(src + 16 * b), x1 = _mm256_loadu_ps(src + 16 * b + 8);
      const float amax = max8(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)));
      const __m256 inv = _mm256_set1_ps(block_inverse(amax));
      q[2 * b] = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv));  // round to nearest even (MXCSR's default)
      q[2 * b + 1] = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv));
      lanes[2 * b] = lanes[2 * b + 1] = amax / 127.f;
    }
    uint8_t* o = out + g * kI8GroupBytes;
    const __m256i lo = pack_split(q), hi = pack_split(q + 4);  // inputs 0..31, 32..63: even | odd
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64), _mm256_mullo_epi32(lane_sums(q), _mm256_set1_epi32(12)));
    std::memcpy(o + 96, lanes, sizeof(lanes));
  }
}

HR_AVX2 void nvfp4_i8_rows_avx2(const uint8_t* xq, int64_t n, int64_t in, const uint8_t* codes, const uint8_t* scales,
                                const float* row_scale, int64_t r0, int64_t r1, float* y, int64_t y_stride) {
  const int64_t half = in / 2, nb = in / kGroup, xbytes = i8_groups(in) * kI8GroupBytes;
  const int64_t ahead = prefetch_ahead_bytes();
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {  // two weight rows at a time (their scales adjacent): x loaded once for both
    const uint8_t* cr[2] = {codes + r * half, codes + (r + 1) * half};
    const uint8_t* sr[2] = {scales + r * nb, scales + (r + 1) * nb};
    const float rs[2] = {row_scale[r] * 0.5f, row_scale[r + 1] * 0.5f};
    if (all_normal(sr[0], 2 * nb)) i8_rows<2, true>(xq, n, xbytes, in, cr, sr, rs, ahead, y + r - r0, y_stride);
    else i8_rows<2, false>(xq, n, xbytes, in, cr, sr, rs, ahead, y + r - r0, y_stride);
  }
  if (r < r1) {
    const uint8_t* cr[1] = {codes + r * half};
    const uint8_t* sr[1] = {scales + r * nb};
    const float rs[1] = {row_scale[r] * 0.5f};
    if (all_normal(sr[0], nb)) i8_rows<1, true>(xq, n, xbytes, in, cr, sr, rs, ahead, y + r - r0, y_stride);
    else i8_rows<1, false>(xq, n, xbytes, in, cr, sr, rs, ahead, y + r - r0, y_stride);
  }
}
#endif

}  // namespace hetero_run_cpu
