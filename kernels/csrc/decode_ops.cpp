// The per-token operations between a decoder layer's matrix products, for decode and verify
// forwards on the CPU: causal attention of a few new query rows over the KV cache, and RMS norm.
//
// PyTorch's CPU scaled_dot_product_attention costs about 0.75 ms per layer for one bf16 query
// row over 1000 cached keys (0.15 ms over 200): more than the layer's weights take to stream at
// long contexts. Here each (query row, head) is one task over exactly the keys a one-token
// decode of that row sees, in one fixed order, so the result does not depend on how many rows
// came together (batch_invariance.py), and a bf16 cache is widened as it is read.
//
// Ops (namespace hetero_run; references in kernels/decode_ops.py):
//   decode_attention(q [n, heads, d], k [kv_heads, slots, d], v [kv_heads, slots, d], start, scale)
//       -> [n, heads, d]: row i attends to slots 0 .. start + i; query head h reads KV head
//       h / (heads / kv_heads); q, k, v float32 or bfloat16 (one dtype); softmax in float32.
//   paged_attention(q [n, heads, d], k [kv_heads, slots, d], v [kv_heads, slots, d], key_slots [total],
//                   key_offsets [n + 1], scale) -> [n, heads, d]: row i attends, in order, to the slots
//       key_slots[key_offsets[i] .. key_offsets[i + 1] - 1] (a paged cache's blocks, a tree row's
//       prefix and ancestors); a row reading the same keys as a decode gets the decode's bits.
//   rms_norm(x [n, d], w [d], eps) -> [n, d]: x / sqrt(mean(x^2) + eps) * w, in float32, rounded once.
//   silu_mul(gate_up [n, 2 * f]) -> [n, f]: silu(gate) * up (gate the first f columns), in float32,
//       rounded once; float32 or bfloat16. torch's silu_ then mul_ on the halves of a bf16 [8, 9728]
//       took 0.18 ms a layer, one thread each (the halves are strided views).
//   rope_write(qk [n, heads + kv_heads, d], v [n, kv_heads, d], cos [n, d], sin [n, d], k_cache
//              [kv_heads, slots, d], v_cache [kv_heads, slots, d], write_slots [n] int64, heads) -> q [n, heads, d]:
//       rotary position embedding x * cos + roll(x, d / 2) * sin (sin's sign folded in, as
//       runtime/models/rotary.py builds it) on the q and k heads, each product and the sum rounded to
//       bf16 as PyTorch's three bf16 operations round them (the same bits); the rotated k and the v rows
//       written to their cache slots; q returned contiguous. bfloat16 only. It replaces 4 PyTorch
//       operations, 2 index_put and a copy of q per layer (about 1.5 ms of Python and dispatch a
//       one-row step of the CPU target, 24 layers).
//   row_argmax(x [n, v] float32) -> [n] int64: torch.argmax(x, -1) (the first index of the largest
//       value; a row holding NaN gives its first NaN's index, as torch does). PyTorch's CPU argmax
//       reads a 152k vocabulary at about 2.3 GB/s (0.26 ms a row, once per verified row).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "check.h"
#include "cpu_kernels.h"
#include "ops.h"

#if HR_X86
#include <immintrin.h>
#endif

namespace hetero_run_cpu {
namespace {


// ---------------------------------------------------------------- portable loops

// Where key j of a row lives: slot j of the cache (a one-token decode's keys 0 .. keys - 1), or
// slot slots[j] (a paged cache, a tree row's ancestors). Both feed the same arithmetic in the
// same order, so a row's result depends only on the sequence of keys it reads.
struct Contiguous {
  int64_t operator[](int64_t j) const { return j; }
};
struct Listed {
  const int64_t* slots;
  int64_t operator[](int64_t j) const { return slots[j]; }
};

template <typename T, typename Slots>
void attend_generic(const T* q, const T* k, const T* v, int64_t keys, int64_t d, int64_t key_stride, float scale,
                    float* scores, float* acc, T* out, Slots slot) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < keys; ++j) {
    const T* kj = k + slot[j] * key_stride;
    float s = 0.f;
    for (int64_t e = 0; e < d; ++e) s += to_float(q[e]) * to_float(kj[e]);
    scores[j] = s * scale;
    top = std::max(top, scores[j]);
  }
  float total = 0.f;
  for (int64_t e = 0; e < d; ++e) acc[e] = 0.f;
  for (int64_t j = 0; j < keys; ++j) {
    const float p = std::exp(scores[j] - top);
    total += p;
    const T* vj = v + slot[j] * key_stride;
    for (int64_t e = 0; e < d; ++e) acc[e] += p * to_float(vj[e]);
  }
  for (int64_t e = 0; e < d; ++e) store(out + e, acc[e] / total);
}

template <typename T>
void rms_norm_generic(const T* x, const T* w, int64_t d, float eps, T* y) {
  float ss = 0.f;
  for (int64_t e = 0; e < d; ++e) ss += to_float(x[e]) * to_float(x[e]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t e = 0; e < d; ++e) store(y + e, to_float(x[e]) * r * to_float(w[e]));
}

constexpr int kMaxD = 256;  // head_dim up to this takes the vector path

// ---------------------------------------------------------------- AVX-512 (d a multiple of 16)

#if HR_X86
HR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
HR_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
HR_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
HR_AVX512 inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16x16(v));
}

// exp for the softmax: 2^n * e^r with |r| <= ln2/2, e^r by a degree-6 polynomial (relative
// error about 2e-7); inputs are <= 0 here, and below -87 the result is 0.
HR_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}


template <typename T, typename Slots>
HR_AVX512 void attend_avx512(const T* q, const T* k, const T* v, int64_t keys, int64_t d, int64_t key_stride,
                             float scale, float* scores, T* out, Slots slot) {
  const int64_t parts = d / 16;
  __m512 qv[kMaxD / 16];
  for (int64_t c = 0; c < parts; ++c) qv[c] = _mm512_mul_ps(load16(q + 16 * c), _mm512_set1_ps(scale));
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < keys; ++j) {
    const T* kj = k + slot[j] * key_stride;
    __m512 s = _mm512_mul_ps(qv[0], load16(kj));
    for (int64_t c = 1; c < parts; ++c) s = _mm512_fmadd_ps(qv[c], load16(kj + 16 * c), s);
    scores[j] = _mm512_reduce_add_ps(s);
  }
  int64_t j = 0;
  for (; j + 16 <= keys; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j));
  float m = _mm512_reduce_max_ps(top);
  for (; j < keys; ++j) m = std::max(m, scores[j]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < keys; j += 16) {  // probabilities, 16 at a time (the tail masked)
    const __mmask16 live = keys - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (keys - j)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j), mv));
    _mm512_mask_storeu_ps(scores + j, live, p);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, p));
  }
  __m512 acc[kMaxD / 16];
  for (int64_t c = 0; c < parts; ++c) acc[c] = _mm512_setzero_ps();
  for (j = 0; j < keys; ++j) {
    const T* vj = v + slot[j] * key_stride;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < parts; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vj + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t c = 0; c < parts; ++c) store16(out + 16 * c, _mm512_mul_ps(acc[c], inv));
}

template <typename T>
HR_AVX512 void rms_norm_avx512(const T* x, const T* w, int64_t d, float eps, T* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) {
    const __m512 xv = load16(x + e);
    ss = _mm512_fmadd_ps(xv, xv, ss);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
  for (int64_t e = 0; e < d; e += 16) store16(y + e, _mm512_mul_ps(_mm512_mul_ps(load16(x + e), r), load16(w + e)));
}

// ---------------------------------------------------------------- AVX2 (d a multiple of 8)
//
// The same steps 8 lanes wide (a CPU without AVX-512: Zen 3, many client CPUs). Tails are taken
// in a zero-padded copy, masked where they feed a sum, so every key or element takes the same
// operations wherever it lies.

HR_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
HR_AVX2 inline __m256 load8(const uint16_t* p) { return widen_bf16x8(_mm_loadu_si128((const __m128i*)p)); }
HR_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
HR_AVX2 inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16x8(v)); }

// One head's scores in place as e^(s - max) (unnormalised), in this fixed order; returns their sum.
HR_AVX2 inline float softmax_avx2(float* scores, int64_t keys) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
  float m = max8(top);
  for (; j < keys; ++j) m = std::max(m, scores[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= keys; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    _mm256_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  if (j < keys) {
    alignas(32) float part[8] = {};
    std::memcpy(part, scores + j, (keys - j) * sizeof(float));
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(part), mv)), first_lanes8(keys - j));
    _mm256_store_ps(part, p);
    std::memcpy(scores + j, part, (keys - j) * sizeof(float));
    sum = _mm256_add_ps(sum, p);
  }
  return reduce8(sum);
}

// One query head over its keys, for any d a multiple of 8 up to kMaxD: the score of key j is
// (q * scale) . k_j summed as s = q_0 k_0, then s += q_c k_c for each further 8 lanes c, then
// reduce8(s); the output sum_j p_j v_j accumulates in key order per 8 lanes, then times 1 / sum p.
template <typename T, typename Slots>
HR_AVX2 void attend_avx2_any(const T* q, const T* k, const T* v, int64_t keys, int64_t d, int64_t key_stride,
                             float scale, float* scores, T* out, Slots slot) {
  const int64_t parts = d / 8;
  __m256 qv[kMaxD / 8];
  for (int64_t c = 0; c < parts; ++c) qv[c] = _mm256_mul_ps(load8(q + 8 * c), _mm256_set1_ps(scale));
  for (int64_t j = 0; j < keys; ++j) {
    const T* kj = k + slot[j] * key_stride;
    __m256 s = _mm256_mul_ps(qv[0], load8(kj));
    for (int64_t c = 1; c < parts; ++c) s = _mm256_fmadd_ps(qv[c], load8(kj + 8 * c), s);
    scores[j] = reduce8(s);
  }
  const float total = softmax_avx2(scores, keys);
  __m256 acc[kMaxD / 8];
  for (int64_t c = 0; c < parts; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    const T* vj = v + slot[j] * key_stride;
    const __m256 p = _mm256_set1_ps(scores[j]);
    for (int64_t c = 0; c < parts; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vj + 8 * c), acc[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int64_t c = 0; c < parts; ++c) store8(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

// Keys a chunk when several query heads read one KV head: the chunk's keys or values, widened
// to float32 (8 KiB at d = 64), stay in L1 while every head reads them.
constexpr int64_t kKeyChunk = 32;

// Key j of a chunk starting at key j0: row j - j0 of the chunk's widened copy.
struct ChunkRows {
  int64_t j0;
  int64_t operator[](int64_t j) const { return j - j0; }
};

template <typename T, typename Slots>
HR_AVX2 void widen_rows(const T* src, int64_t key_stride, Slots slot, int64_t j0, int64_t j1, int64_t d, float* rows) {
  for (int64_t j = j0; j < j1; ++j) {
    const T* r = src + slot[j] * key_stride;
    float* w = rows + (j - j0) * d;
    for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(w + e, load8(r + e));
  }
}

// Scores of keys j0 .. j1 - 1 for query heads 0 .. hn - 1 (row h of scores, keys long): per key
// s = (q * scale)_0 k_0, then s += (q * scale)_c k_c for each further 8 lanes c, then reduce8(s),
// attend_avx2_any's operations; R keys' chains run side by side.
template <int P, typename T, typename K, typename Slots>
HR_AVX2 void chunk_scores(const T* q, int64_t hn, float scale, const K* k, int64_t key_stride, Slots slot, int64_t j0,
                          int64_t j1, float* scores, int64_t keys) {
  constexpr int R = P <= 8 ? 4 : 2;  // R chains, q's P vectors and a load: at most 16 registers
  for (int64_t h = 0; h < hn; ++h) {
    __m256 qv[P];
    for (int c = 0; c < P; ++c) qv[c] = _mm256_mul_ps(load8(q + h * 8 * P + 8 * c), _mm256_set1_ps(scale));
    float* sh = scores + h * keys;
    int64_t j = j0;
    for (; j + R <= j1; j += R) {
      const K* kr[R];
      __m256 s[R];
      for (int r = 0; r < R; ++r) kr[r] = k + slot[j + r] * key_stride;
      for (int r = 0; r < R; ++r) s[r] = _mm256_mul_ps(qv[0], load8(kr[r]));
      for (int c = 1; c < P; ++c)
        for (int r = 0; r < R; ++r) s[r] = _mm256_fmadd_ps(qv[c], load8(kr[r] + 8 * c), s[r]);
      for (int r = 0; r < R; ++r) sh[j + r] = reduce8(s[r]);
    }
    for (; j < j1; ++j) {
      const K* kj = k + slot[j] * key_stride;
      __m256 s = _mm256_mul_ps(qv[0], load8(kj));
      for (int c = 1; c < P; ++c) s = _mm256_fmadd_ps(qv[c], load8(kj + 8 * c), s);
      sh[j] = reduce8(s);
    }
  }
}

// Values j0 .. j1 - 1 into each head's output sums (row h of acc, 8 P long), in key order per
// lane, 8 lanes-groups at a time in registers (attend_avx2_any's operations).
template <int P, typename V, typename Slots>
HR_AVX2 void chunk_values(int64_t hn, const V* v, int64_t key_stride, Slots slot, int64_t j0, int64_t j1,
                          const float* scores, int64_t keys, float* acc) {
  constexpr int W = P < 8 ? P : 8;
  static_assert(P % W == 0, "P must be below 8 or a multiple of it");
  for (int c0 = 0; c0 < P; c0 += W) {
    for (int64_t h = 0; h < hn; ++h) {
      float* ah = acc + h * 8 * P + 8 * c0;
      const float* ph = scores + h * keys;
      __m256 a[W];
      for (int c = 0; c < W; ++c) a[c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(ah + 8 * c);
      for (int64_t j = j0; j < j1; ++j) {
        const V* vj = v + slot[j] * key_stride + 8 * c0;
        const __m256 p = _mm256_set1_ps(ph[j]);
        for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(p, load8(vj + 8 * c), a[c]);
      }
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(ah + 8 * c, a[c]);
    }
  }
}

// Query heads 0 .. hn - 1 of one row (contiguous in q and out), all on one KV head, d = 8 P known
// at compile time (64 and 128, the usual head sizes). The same operations in the same order per
// head, key and lane as attend_avx2_any, so the same bits; only the schedule differs. That one
// keeps q and the output sums in memory and runs one key's chain of P dependent FMAs at a time
// (about 69 cycles a key and head at d = 64 on Zen 3), and each head streams and widens its keys
// and values itself. Here q and the sums sit in registers, R keys' chains run side by side, and
// the heads take the keys and values a chunk at a time: a bf16 chunk read by several heads is
// widened once into `rows` (kKeyChunk * 8 P floats), which they then read from L1.
// scores holds hn * keys floats, acc hn * 8 P.
template <int P, typename T, typename Slots>
HR_AVX2 void attend_heads_avx2(const T* q, int64_t hn, const T* k, const T* v, int64_t keys, int64_t key_stride,
                               float scale, float* scores, float* rows, float* acc, T* out, Slots slot) {
  constexpr int64_t d = 8 * P;
  const bool widen = std::is_same_v<T, uint16_t> && hn > 1;
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyChunk) {
    const int64_t j1 = std::min(keys, j0 + kKeyChunk);
    if (widen) {
      widen_rows(k, key_stride, slot, j0, j1, d, rows);
      chunk_scores<P>(q, hn, scale, rows, d, ChunkRows{j0}, j0, j1, scores, keys);
    } else {
      chunk_scores<P>(q, hn, scale, k, key_stride, slot, j0, j1, scores, keys);
    }
  }
  float totals_inv[kMaxD];  // hn <= one KV head's query heads (split_heads keeps groups beyond kMaxD to one a task)
  for (int64_t h = 0; h < hn; ++h) totals_inv[h] = 1.f / softmax_avx2(scores + h * keys, keys);
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyChunk) {
    const int64_t j1 = std::min(keys, j0 + kKeyChunk);
    if (widen) {
      widen_rows(v, key_stride, slot, j0, j1, d, rows);
      chunk_values<P>(hn, rows, d, ChunkRows{j0}, j0, j1, scores, keys, acc);
    } else {
      chunk_values<P>(hn, v, key_stride, slot, j0, j1, scores, keys, acc);
    }
  }
  for (int64_t h = 0; h < hn; ++h) {
    const __m256 inv = _mm256_set1_ps(totals_inv[h]);
    for (int c = 0; c < P; ++c) store8(out + h * d + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + 8 * c), inv));
  }
}

// Whether attend_heads_avx2 takes head size d (else one head at a time in attend_avx2_any).
inline bool fixed_head_size(int64_t d) { return d == 64 || d == 128; }

template <typename T, typename Slots>
HR_AVX2 void attend_avx2(const T* q, int64_t hn, const T* k, const T* v, int64_t keys, int64_t d, int64_t key_stride,
                         float scale, float* scores, float* rows, float* acc, T* out, Slots slot) {
  if (d == 64) return attend_heads_avx2<8>(q, hn, k, v, keys, key_stride, scale, scores, rows, acc, out, slot);
  if (d == 128) return attend_heads_avx2<16>(q, hn, k, v, keys, key_stride, scale, scores, rows, acc, out, slot);
  for (int64_t h = 0; h < hn; ++h)
    attend_avx2_any(q + h * d, k, v, keys, d, key_stride, scale, scores + h * keys, out + h * d, slot);
}

template <typename T>
HR_AVX2 void rms_norm_avx2(const T* x, const T* w, int64_t d, float eps, T* y) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; e += 8) {
    const __m256 xv = load8(x + e);
    ss = _mm256_fmadd_ps(xv, xv, ss);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(reduce8(ss) / static_cast<float>(d) + eps));
  for (int64_t e = 0; e < d; e += 8) store8(y + e, _mm256_mul_ps(_mm256_mul_ps(load8(x + e), r), load8(w + e)));
}
#endif

// The vector width of a loop over a whole row of d values (RMS norm): 16 (AVX-512), 8 (AVX2) or
// 0 (plain loops), as d's remainder and the CPU allow. It depends on the CPU and d only, never
// on the rows.
int row_vector_width(int64_t d) {
#if HR_X86
  if (has_avx512() && d % 16 == 0) return 16;
  if (has_avx2() && d % 8 == 0) return 8;
#else
  (void)d;
#endif
  return 0;
}

// The vector width the attention loops take for head size d: the same, for heads of at most
// kMaxD values (they keep a head in registers).
int vector_width(int64_t d) { return d > kMaxD ? 0 : row_vector_width(d); }

// Query heads per task. On the AVX2 path with d 64 or 128 a task takes several heads of one KV
// head's group, which read its keys and values from L1 after the first; the group is cut into
// parts only so that every thread gets a share when rows x KV heads are few (one row of a TP=2
// rank reads one KV head). Elsewhere a task is one head. This decides who computes a head, never
// how: no row's bits depend on it.
struct HeadSplit {
  int64_t size, parts;  // heads a task (the last part of a group may have fewer), parts a group
};

HeadSplit split_heads(int64_t row_kv_tasks, int64_t group, int vec, int64_t d) {
  if (vec != 8 || !fixed_head_size(d) || group == 1 || group > kMaxD) return {1, group};
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t parts = 1;
  while (parts < group && (row_kv_tasks * parts) % threads != 0 && row_kv_tasks * parts < 4 * threads) ++parts;
  const int64_t size = (group + parts - 1) / parts;
  return {size, (group + size - 1) / size};
}

// Both attention ops: row i's query heads attend to the keys row_keys(i) = {count, Slots} names,
// at most `longest` of them.
template <typename T, typename RowKeys>
void attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t longest, float scale,
                    RowKeys row_keys, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0);
  const int64_t group = heads / kv_heads;
  const T* qd = reinterpret_cast<const T*>(q.data_ptr());
  const T* kd = reinterpret_cast<const T*>(k.data_ptr());
  const T* vd = reinterpret_cast<const T*>(v.data_ptr());
  T* od = reinterpret_cast<T*>(out.data_ptr());
  const int64_t k_head = k.stride(0), v_head = v.stride(0), k_slot = k.stride(1);
  const int vec = vector_width(d);
  const HeadSplit split = split_heads(n * kv_heads, group, vec, d);
  at::parallel_for(0, n * kv_heads * split.parts, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(split.size * std::max<int64_t>(longest, 1)), acc(split.size * d);
    std::vector<float> rows(split.size > 1 ? kKeyChunk * d : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / (kv_heads * split.parts), g = t / split.parts % kv_heads, part = t % split.parts;
      const int64_t h0 = g * group + part * split.size, hn = std::min(split.size, group - part * split.size);
      const auto [keys, slot] = row_keys(i);
      const T* qi = qd + (i * heads + h0) * d;
      const T* kg = kd + g * k_head;
      const T* vg = vd + g * v_head;
      T* oi = od + (i * heads + h0) * d;
#if HR_X86
      if (vec == 16) {  // one head a task (split_heads)
        attend_avx512(qi, kg, vg, keys, d, k_slot, scale, scores.data(), oi, slot);
        continue;
      }
      if (vec == 8) {
        attend_avx2(qi, hn, kg, vg, keys, d, k_slot, scale, scores.data(), rows.data(), acc.data(), oi, slot);
        continue;
      }
#endif
      (void)vec;
      attend_generic(qi, kg, vg, keys, d, k_slot, scale, scores.data(), acc.data(), oi, slot);
    }
  });
}

// What both attention ops need of q [n, heads, d] and k, v [kv_heads, slots, d].
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  HR_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be 3-D");
  HR_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "q, k and v must be on the CPU");
  HR_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
           "q, k and v must share a dtype");
  HR_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  HR_CHECK(q.is_contiguous(), "q must be contiguous");
  HR_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == v.stride(1), "k and v need contiguous rows "
           "with one slot stride");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                            double scale) {
  check_qkv(q, k, v);
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0);
  HR_CHECK(k.size(2) == d && v.size(2) == d && v.size(0) == kv_heads, "q, k and v head_dim / kv heads differ");
  HR_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " KV heads");
  HR_CHECK(start >= 0 && start + n <= k.size(1) && start + n <= v.size(1), "slots 0 .. ", start + n - 1,
           " are not all in the cache of ", k.size(1));
  at::Tensor out = at::empty_like(q);
  const auto row_keys = [start](int64_t i) { return std::pair{start + i + 1, Contiguous{}}; };
  if (q.scalar_type() == at::kFloat)
    attention_impl<float>(q, k, v, start + n, static_cast<float>(scale), row_keys, out);
  else
    attention_impl<uint16_t>(q, k, v, start + n, static_cast<float>(scale), row_keys, out);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_slots,
                           const at::Tensor& key_offsets, double scale) {
  check_qkv(q, k, v);
  HR_CHECK(key_slots.scalar_type() == at::kLong && key_offsets.scalar_type() == at::kLong &&
           key_slots.is_contiguous() && key_offsets.is_contiguous() && key_slots.dim() == 1 &&
           key_offsets.dim() == 1, "key_slots and key_offsets must be contiguous 1-D int64");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0), cached = k.size(1);
  HR_CHECK(k.size(2) == d && v.size(2) == d && v.size(0) == kv_heads && v.size(1) == cached,
           "q, k and v head_dim / kv heads / slots differ");
  HR_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads do not share ", kv_heads, " KV heads");
  HR_CHECK(key_offsets.numel() == n + 1, "key_offsets needs n + 1 = ", n + 1, " entries");
  const int64_t* off = key_offsets.data_ptr<int64_t>();
  const int64_t* sl = key_slots.data_ptr<int64_t>();
  HR_CHECK(off[0] == 0 && off[n] == key_slots.numel(), "key_offsets must run from 0 to len(key_slots)");
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    HR_CHECK(off[i + 1] > off[i], "row ", i, " attends to no key");
    longest = std::max(longest, off[i + 1] - off[i]);
  }
  for (int64_t j = 0; j < key_slots.numel(); ++j)
    HR_CHECK(sl[j] >= 0 && sl[j] < cached, "key slot ", sl[j], " is outside the cache of ", cached);
  at::Tensor out = at::empty_like(q);
  const auto row_keys = [sl, off](int64_t i) { return std::pair{off[i + 1] - off[i], Listed{sl + off[i]}}; };
  if (q.scalar_type() == at::kFloat)
    attention_impl<float>(q, k, v, longest, static_cast<float>(scale), row_keys, out);
  else
    attention_impl<uint16_t>(q, k, v, longest, static_cast<float>(scale), row_keys, out);
  return out;
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, float eps, at::Tensor& y) {
  const int64_t n = x.size(0), d = x.size(1);
  const T* xd = reinterpret_cast<const T*>(x.data_ptr());
  const T* wd = reinterpret_cast<const T*>(w.data_ptr());
  T* yd = reinterpret_cast<T*>(y.data_ptr());
  const int vec = row_vector_width(d);
  for (int64_t i = 0; i < n; ++i) {  // a few rows of a few thousand values: not worth waking threads
#if HR_X86
    if (vec == 16) {
      rms_norm_avx512(xd + i * d, wd, d, eps, yd + i * d);
      continue;
    }
    if (vec == 8) {
      rms_norm_avx2(xd + i * d, wd, d, eps, yd + i * d);
      continue;
    }
#endif
    (void)vec;
    rms_norm_generic(xd + i * d, wd, d, eps, yd + i * d);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  HR_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous 2-D CPU tensor");
  HR_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "w must be [", x.size(1), "]");
  HR_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  HR_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_impl<float>(x, w, static_cast<float>(eps), y);
  else
    rms_norm_impl<uint16_t>(x, w, static_cast<float>(eps), y);
  return y;
}

template <typename T>
void silu_mul_generic(const T* g, const T* u, int64_t f, T* y) {
  for (int64_t e = 0; e < f; ++e) {
    const float gv = to_float(g[e]);
    const float sv = gv < -88.f ? 0.f : gv / (1.f + std::exp(-gv));  // silu(-inf) = 0, not -inf / inf
    store(y + e, sv * to_float(u[e]));
  }
}

#if HR_X86
HR_AVX512 inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}
HR_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
HR_AVX512 inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
HR_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
HR_AVX512 inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, round_bf16x16(v));
}

// Every element takes the same operations wherever it lies (a tail is masked, not looped), so a
// row's result does not depend on its length's remainder or on the other rows.
template <typename T>
HR_AVX512 void silu_mul_avx512(const T* g, const T* u, int64_t f, T* y) {
  for (int64_t e = 0; e < f; e += 16) {
    const __mmask16 m = lanes(f - e);
    const __m512 gv = load16(g + e, m);
    // -g clamped to exp16's domain; below g = -88 silu(g) is under 1e-36, taken as 0 (as the
    // generic loop does: -inf gives 0, not -inf / inf)
    const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f));
    const __m512 s = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(gv, _mm512_set1_ps(-88.f), _CMP_NLT_UQ),
                                         _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg))));
    store16(y + e, _mm512_mul_ps(s, load16(u + e, m)), m);
  }
}
#endif

#if HR_X86
// The same 8 lanes wide; the tail in a zero-padded copy.
template <typename T>
HR_AVX2 inline __m256 silu_times8(const T* g, const T* u) {
  const __m256 gv = load8(g);
  const __m256 neg = _mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f));
  const __m256 s = _mm256_and_ps(_mm256_cmp_ps(gv, _mm256_set1_ps(-88.f), _CMP_NLT_UQ),
                                 _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg))));
  return _mm256_mul_ps(s, load8(u));
}

template <typename T>
HR_AVX2 void silu_mul_avx2(const T* g, const T* u, int64_t f, T* y) {
  int64_t e = 0;
  for (; e + 8 <= f; e += 8) store8(y + e, silu_times8(g + e, u + e));
  if (e < f) {
    T gp[8] = {}, up[8] = {}, yp[8];
    std::memcpy(gp, g + e, (f - e) * sizeof(T));
    std::memcpy(up, u + e, (f - e) * sizeof(T));
    store8(yp, silu_times8(gp, up));
    std::memcpy(y + e, yp, (f - e) * sizeof(T));
  }
}
#endif

template <typename T>
void silu_mul_impl(const at::Tensor& x, at::Tensor& y) {
  const int64_t n = x.size(0), f = x.size(1) / 2;
  const T* xd = reinterpret_cast<const T*>(x.data_ptr());
  T* yd = reinterpret_cast<T*>(y.data_ptr());
#if HR_X86
  const bool vec = has_avx512(), vec8 = has_avx2();
#endif
  // about 1 ns an element: pieces of at least 16k elements are worth a thread
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(f, 1));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
#if HR_X86
      if (vec) {
        silu_mul_avx512(xd + i * 2 * f, xd + i * 2 * f + f, f, yd + i * f);
        continue;
      }
      if (vec8) {
        silu_mul_avx2(xd + i * 2 * f, xd + i * 2 * f + f, f, yd + i * f);
        continue;
      }
#endif
      silu_mul_generic(xd + i * 2 * f, xd + i * 2 * f + f, f, yd + i * f);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  HR_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "gate_up must be a contiguous 2-D CPU tensor");
  HR_CHECK(x.size(1) % 2 == 0, "gate_up needs an even number of columns, got ", x.size(1));
  HR_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  at::Tensor y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_mul_impl<float>(x, y);
  else
    silu_mul_impl<uint16_t>(x, y);
  return y;
}

// d / 2 positions of rotary: out[e] = bf16(bf16(x[e] c[e]) + bf16(r[e] s[e])), r = x rolled by
// half (x's other half). Products of two bf16 are exact in float32; the sum rounds in float32 and
// then to bf16, as PyTorch's bf16 add does. The vector loop does the same operations.
void rope_generic(const uint16_t* x, const uint16_t* c, const uint16_t* sn, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; ++e) {
    const float r = bf16_to_float(x[e < half ? e + half : e - half]);
    const float a = bf16_to_float(round_bf16(bf16_to_float(x[e]) * bf16_to_float(c[e])));
    const float b = bf16_to_float(round_bf16(r * bf16_to_float(sn[e])));
    out[e] = round_bf16(a + b);
  }
}

#if HR_X86
HR_AVX512 inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// d / 2 a multiple of 16
HR_AVX512 void rope_avx512(const uint16_t* x, const uint16_t* c, const uint16_t* sn, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; e += 16) {
    const __m512 r = widen16(x + (e < half ? e + half : e - half));
    const __m512 a = through_bf16(_mm512_mul_ps(widen16(x + e), widen16(c + e)));
    const __m512 b = through_bf16(_mm512_mul_ps(r, widen16(sn + e)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), round_bf16x16(_mm512_add_ps(a, b)));
  }
}

// d / 2 a multiple of 8
HR_AVX2 void rope_avx2(const uint16_t* x, const uint16_t* c, const uint16_t* sn, int64_t d, uint16_t* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < d; e += 8) {
    const __m256 r = load8(x + (e < half ? e + half : e - half));
    const __m256 a = through_bf16x8(_mm256_mul_ps(load8(x + e), load8(c + e)));
    const __m256 b = through_bf16x8(_mm256_mul_ps(r, load8(sn + e)));
    store8(out + e, _mm256_add_ps(a, b));
  }
}
#endif

at::Tensor rope_write(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, int64_t heads) {
  for (const at::Tensor* t : {&qk, &v, &cos, &sin, &k_cache, &v_cache})
    HR_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "rope_write takes bfloat16 CPU tensors");
  HR_CHECK(qk.dim() == 3 && v.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "qk, v and the caches are 3-D");
  const int64_t n = qk.size(0), all = qk.size(1), d = qk.size(2), kv = all - heads;
  HR_CHECK(heads > 0 && kv > 0 && d % 2 == 0, "qk [n, heads + kv_heads, d] with an even d");
  HR_CHECK(qk.stride(2) == 1 && qk.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
           "each row's heads must be contiguous");
  HR_CHECK(v.size(0) == n && v.size(1) == kv && v.size(2) == d, "v must be [n, kv_heads, d]");
  HR_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * d && sin.numel() == n * d,
           "cos and sin must be contiguous [n, d]");
  HR_CHECK(k_cache.size(0) == kv && v_cache.size(0) == kv && k_cache.size(2) == d && v_cache.size(2) == d &&
               k_cache.stride(2) == 1 && k_cache.stride(1) == d && v_cache.stride(2) == 1 && v_cache.stride(1) == d,
           "the caches must be [kv_heads, slots, d] with contiguous slots");
  HR_CHECK(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == at::kLong && slots.is_contiguous(),
           "write_slots must be [n] int64");
  const int64_t capacity = std::min(k_cache.size(1), v_cache.size(1));
  const int64_t* sd = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    HR_CHECK(sd[i] >= 0 && sd[i] < capacity, "write slot ", sd[i], " is outside the cache of ", capacity);
  at::Tensor q = at::empty({n, heads, d}, qk.options());
  const auto* x = reinterpret_cast<const uint16_t*>(qk.data_ptr());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const auto* cd = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* sn = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  auto* qd = reinterpret_cast<uint16_t*>(q.data_ptr());
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr());
#if HR_X86
  const bool vec = has_avx512() && (d / 2) % 16 == 0, vec8 = has_avx2() && (d / 2) % 8 == 0;
#endif
  for (int64_t i = 0; i < n; ++i) {  // a few rows of a few heads: not worth waking threads
    for (int64_t h = 0; h < all; ++h) {
      const uint16_t* src = x + i * qk.stride(0) + h * d;
      uint16_t* dst = h < heads ? qd + (i * heads + h) * d : kc + (h - heads) * k_cache.stride(0) + sd[i] * d;
#if HR_X86
      if (vec) {
        rope_avx512(src, cd + i * d, sn + i * d, d, dst);
        continue;
      }
      if (vec8) {
        rope_avx2(src, cd + i * d, sn + i * d, d, dst);
        continue;
      }
#endif
      rope_generic(src, cd + i * d, sn + i * d, d, dst);
    }
    for (int64_t h = 0; h < kv; ++h)
      std::memcpy(vc + h * v_cache.stride(0) + sd[i] * d, vd + i * v.stride(0) + h * d, d * sizeof(uint16_t));
  }
  return q;
}

int64_t argmax_generic(const float* x, int64_t v) {
  int64_t best = 0;
  for (int64_t e = 0; e < v; ++e) {
    if (std::isnan(x[e])) return e;
    if (x[e] > x[best]) best = e;
  }
  return best;
}

#if HR_X86
// Lane l keeps the largest value it has seen and, for ties, its first index (a strict > moves
// it); the row's answer is the smallest index among the lanes holding the largest value. A NaN
// (never greater than anything) sends the row to the generic scan, which returns the first NaN.
HR_AVX512 int64_t argmax_avx512(const float* x, int64_t v) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = where;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t e = 0;
  for (; e + 16 <= v; e += 16) {
    const __m512 xv = _mm512_loadu_ps(x + e);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, xv);
    where = _mm512_mask_mov_epi32(where, more, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (e < v) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (v - e)) - 1);
    const __m512 xv = _mm512_mask_loadu_ps(lowest, tail, x + e);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, xv);
    where = _mm512_mask_mov_epi32(where, more, idx);
  }
  if (nan) return argmax_generic(x, v);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const __m512i candidates = _mm512_mask_mov_epi32(_mm512_set1_epi32(std::numeric_limits<int32_t>::max()), holders,
                                                   where);
  return _mm512_reduce_min_epi32(candidates);
}

// The same 8 lanes wide; a tail is padded with -inf (never greater, never a NaN).
struct Argmax8 {
  __m256 best, nan;
  __m256i where, idx;
};

HR_AVX2 inline void argmax_take(Argmax8& a, __m256 xv) {
  a.nan = _mm256_or_ps(a.nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
  const __m256 more = _mm256_cmp_ps(xv, a.best, _CMP_GT_OQ);
  a.best = _mm256_blendv_ps(a.best, xv, more);
  a.where = _mm256_blendv_epi8(a.where, a.idx, _mm256_castps_si256(more));
  a.idx = _mm256_add_epi32(a.idx, _mm256_set1_epi32(8));
}

HR_AVX2 int64_t argmax_avx2(const float* x, int64_t v) {
  Argmax8 a{_mm256_set1_ps(-std::numeric_limits<float>::infinity()), _mm256_setzero_ps(),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)};
  int64_t e = 0;
  for (; e + 8 <= v; e += 8) argmax_take(a, _mm256_loadu_ps(x + e));
  if (e < v) {
    alignas(32) float part[8];
    for (int k = 0; k < 8; ++k) part[k] = e + k < v ? x[e + k] : -std::numeric_limits<float>::infinity();
    argmax_take(a, _mm256_load_ps(part));
  }
  const __m256 best = a.best, nan = a.nan;
  const __m256i where = a.where;
  if (_mm256_movemask_ps(nan)) return argmax_generic(x, v);
  alignas(32) float b[8];
  alignas(32) int32_t w[8];
  _mm256_store_ps(b, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), where);
  const float top = max8(best);
  int32_t first = std::numeric_limits<int32_t>::max();
  for (int k = 0; k < 8; ++k)
    if (b[k] == top) first = std::min(first, w[k]);
  return first;
}
#endif

at::Tensor row_argmax(const at::Tensor& x) {
  HR_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == at::kFloat,
           "x must be a contiguous 2-D float32 CPU tensor");
  const int64_t n = x.size(0), v = x.size(1);
  HR_CHECK(v > 0 && v < std::numeric_limits<int32_t>::max(), "rows of 1 .. 2^31 - 2 values, got ", v);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xd = x.data_ptr<float>();
  int64_t* od = out.data_ptr<int64_t>();
#if HR_X86
  const bool vec = has_avx512(), vec8 = has_avx2();
#endif
  for (int64_t i = 0; i < n; ++i) {  // a row streams in about 30 us: not worth waking threads
#if HR_X86
    if (vec) {
      od[i] = argmax_avx512(xd + i * v, v);
      continue;
    }
    if (vec8) {
      od[i] = argmax_avx2(xd + i * v, v);
      continue;
    }
#endif
    od[i] = argmax_generic(xd + i * v, v);
  }
  return out;
}

}  // namespace

namespace ops {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return hetero_run_cpu::rms_norm(x, w, eps); }
at::Tensor silu_mul(const at::Tensor& gate_up) { return hetero_run_cpu::silu_mul(gate_up); }
at::Tensor rope_write(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_slots,
                      int64_t heads) {
  return hetero_run_cpu::rope_write(qk, v, cos, sin, k_cache, v_cache, write_slots, heads);
}
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_slots,
                           const at::Tensor& key_offsets, double scale) {
  return hetero_run_cpu::paged_attention(q, k, v, key_slots, key_offsets, scale);
}
}  // namespace ops
}  // namespace hetero_run_cpu

TORCH_LIBRARY_FRAGMENT(hetero_run, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, int start, float scale) -> Tensor",
        &hetero_run_cpu::decode_attention);
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor key_slots, Tensor key_offsets, float scale) -> Tensor",
        &hetero_run_cpu::paged_attention);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &hetero_run_cpu::rms_norm);
  m.def("row_argmax(Tensor x) -> Tensor", &hetero_run_cpu::row_argmax);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &hetero_run_cpu::silu_mul);
  m.def("rope_write(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor write_slots, int heads) -> Tensor",
        &hetero_run_cpu::rope_write);
}
