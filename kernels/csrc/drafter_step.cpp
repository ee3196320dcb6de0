// One decode step of a small llama / qwen2 / qwen3 drafter over a KV cache with sequence slots.
//
// A drafter such as SmolLM2-135M has 30 narrow layers (hidden 576); run as ~20 PyTorch
// operations per layer, the dispatch between them costs as much as its weights take to stream,
// and even one call per projection leaves the threads forking and joining 121 times a step
// while each small matrix starts a cold stream from memory. Here one call runs every layer in
// one parallel region: each thread computes a fixed share of every projection's output rows with
// the registered linear ops' own kernels (linear_rows.h: the same bits as the ops), and its
// share of the attention; the threads meet at a barrier where one phase feeds the next (five per
// layer), and before waiting each thread prefetches the start of its next share of weights.
// Everything between the projections is a few plain loops over float32 activations.
//
// Class hetero_run.DraftStep (Python wrapper and plain-PyTorch reference: kernels/drafter_step.py):
//   DraftStep(layers, hidden, heads, kv_heads, head_dim, eps, embed [vocab, hidden], norm [hidden] f32,
//             cos [positions, head_dim] f32, sin [positions, head_dim] f32 (rotate-half sign folded in),
//             k_cache, v_cache [slots, layers, kv_heads, max_tokens, head_dim] (bf16 | f32))
//   set_norms(layer, input_norm f32 [hidden], post_norm f32 [hidden], qk_norm f32 [heads + kv_heads, head_dim]?)
//   set_proj(layer, which, w?, codes?, block_scale?, row_scale?, bias?, bf16_x, int8_x)
//       which: 0 qkv, 1 o, 2 gate_up (gate rows, then up rows), 3 down; layer -1 sets head number `which`
//       dense: w [out, in] bf16 | f32; NVFP4: codes u8 [out, in/2],
//       block_scale u8 (e4m3 bits) [out, in/16], row_scale f32 [out]; bias f32 [out]; bf16_x: x is
//       rounded to bf16 first (bf16 or NVFP4 weights: the kernels' bf16 dot products); int8_x: x is
//       quantised to int8 (NVFP4 weights: hetero_run::nvfp4_linear_i8's kernel)
//   set_paths(few, many, from), paths() -> (few, many, from): the projections' kernels, 0 the best
//       the CPU allows (the registered ops' path 0), 1 the same without AMX (path 1); a forward of
//       fewer than `from` rows takes `few`, one of `from` rows or more `many`
//   forward(ids [n], slots [n], index [n], positions [n], mask [n, W] bool?, head, last)
//       -> logits f32 [n, out] ([1, out]: the last row's alone, when last: a prompt or a catch-up)
//       row r embeds ids[r], writes its keys and values at cache index index[r] of slot slots[r], is
//       rotated by positions[r], and attends to indices 0 .. index[r] of its slot (those where
//       mask[r] is true, when given). Every row's keys and values are written before any row
//       attends, so rows of one slot form a chain (or a tree, with a mask) within one call.
//
// Each row is computed on its own in a fixed order (the linear ops' paths do not depend on the
// number of rows either, and the step's own choice of them only across `from`, set_paths), so a
// row gets the same bits whatever other rows share the call, and every value gets the same bits
// whatever the number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "check.h"
#include "cpu_kernels.h"
#include "linear_rows.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define DS_X86 1
#include <immintrin.h>
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define DS_AVX2 __attribute__((target("avx2,fma")))
#else
#define DS_X86 0
#endif

namespace hetero_run_drafter {
namespace {

using at::Tensor;

// The vector width of the loops between the projections: 16 (AVX-512), 8 (AVX2) or 0 (plain
// loops), as the linear ops' self-tested choice allows (tests restrict it to force each one).
int vector_width() {
#if DS_X86
  if (hetero_run_cpu::has_avx512()) return 16;
  if (hetero_run_cpu::has_avx2()) return 8;
#endif
  return 0;
}

using hetero_run_cpu::store;
using hetero_run_cpu::to_float;

// ---------------------------------------------------------------- small row operations

void rms_norm_scalar(const float* x, const float* w, int64_t d, float eps, float* y) {
  float ss = 0.f;
  for (int64_t e = 0; e < d; ++e) ss += x[e] * x[e];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t e = 0; e < d; ++e) y[e] = x[e] * r * w[e];
}

float silu_scalar(float g) { return g / (1.f + std::exp(-g)); }

#if DS_X86
// e^x for x <= 88: 2^k * e^r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error ~2e-7);
// below -87 the result is 2^-125.5 or so, never NaN.
DS_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

DS_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

DS_AVX512 void rms_norm_avx512(const float* x, const float* w, int64_t d, float eps, float* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) {
    const __mmask16 m = tail_mask(d - e);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + e);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
  for (int64_t e = 0; e < d; e += 16) {
    const __mmask16 m = tail_mask(d - e);
    _mm512_mask_storeu_ps(y + e, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + e), r),
                                                   _mm512_maskz_loadu_ps(m, w + e)));
  }
}

// act[e] = silu(gate[e]) * up[e]
DS_AVX512 void silu_mul_avx512(const float* gate, const float* up, int64_t d, float* act) {
  for (int64_t e = 0; e < d; e += 16) {
    const __mmask16 m = tail_mask(d - e);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + e);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(act + e, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + e)));
  }
}

DS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
DS_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// The same 8 lanes wide (AVX2); tails in a zero-padded copy.
using hetero_run_cpu::exp8;
using hetero_run_cpu::first_lanes8;
using hetero_run_cpu::max8;
using hetero_run_cpu::reduce8;

DS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
DS_AVX2 inline __m256 load8(const uint16_t* p) { return hetero_run_cpu::widen_bf16x8(_mm_loadu_si128((const __m128i*)p)); }
DS_AVX2 inline __m256 load8(const float* p, int64_t left) {  // left < 8: the rest zero
  alignas(32) float part[8] = {};
  std::memcpy(part, p, left * sizeof(float));
  return _mm256_load_ps(part);
}
DS_AVX2 inline void store8(float* p, __m256 v, int64_t left) {
  alignas(32) float part[8];
  _mm256_store_ps(part, v);
  std::memcpy(p, part, std::min<int64_t>(left, 8) * sizeof(float));
}

DS_AVX2 void rms_norm_avx2(const float* x, const float* w, int64_t d, float eps, float* y) {
  __m256 ss = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) {
    const __m256 v = load8(x + e);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  if (e < d) {
    const __m256 v = load8(x + e, d - e);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(reduce8(ss) / static_cast<float>(d) + eps));
  for (e = 0; e + 8 <= d; e += 8) _mm256_storeu_ps(y + e, _mm256_mul_ps(_mm256_mul_ps(load8(x + e), r), load8(w + e)));
  if (e < d) store8(y + e, _mm256_mul_ps(_mm256_mul_ps(load8(x + e, d - e), r), load8(w + e, d - e)), d - e);
}

DS_AVX2 inline __m256 silu_times8(__m256 g, __m256 u) {
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))),
                       u);
}

DS_AVX2 void silu_mul_avx2(const float* gate, const float* up, int64_t d, float* act) {
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) _mm256_storeu_ps(act + e, silu_times8(load8(gate + e), load8(up + e)));
  if (e < d) store8(act + e, silu_times8(load8(gate + e, d - e), load8(up + e, d - e)), d - e);
}
#endif

void rms_norm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
#if DS_X86
  const int width = vector_width();
  if (width == 16) return rms_norm_avx512(x, w, d, eps, y);
  if (width == 8) return rms_norm_avx2(x, w, d, eps, y);
#endif
  rms_norm_scalar(x, w, d, eps, y);
}

void silu_mul_row(const float* gate, const float* up, int64_t d, float* act) {
#if DS_X86
  const int width = vector_width();
  if (width == 16) return silu_mul_avx512(gate, up, d, act);
  if (width == 8) return silu_mul_avx2(gate, up, d, act);
#endif
  for (int64_t e = 0; e < d; ++e) act[e] = silu_scalar(gate[e]) * up[e];
}

// ---------------------------------------------------------------- attention of one row, one KV head
//
// q: the `group` query heads [group, d] that read this KV head (already scaled); K, V: the slot's
// keys / values for this layer and head [max_tokens, d]; keys: indices 0 .. keys - 1 are read,
// those with valid[j] == 0 skipped (valid may be null). scores: scratch [group, keys].

constexpr int64_t kMaxD = 256;

template <typename T>
void attend_scalar(const float* q, int64_t group, const T* K, const T* V, int64_t keys, int64_t d,
                   const bool* valid, float* scores, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * keys;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j) {
      if (valid && !valid[j]) continue;
      float acc = 0.f;
      for (int64_t e = 0; e < d; ++e) acc += q[g * d + e] * to_float(K[j * d + e]);
      s[j] = acc;
      top = std::max(top, acc);
    }
    float total = 0.f;
    for (int64_t e = 0; e < d; ++e) out[g * d + e] = 0.f;
    for (int64_t j = 0; j < keys; ++j) {
      if (valid && !valid[j]) continue;
      const float p = std::exp(s[j] - top);
      total += p;
      for (int64_t e = 0; e < d; ++e) out[g * d + e] += p * to_float(V[j * d + e]);
    }
    for (int64_t e = 0; e < d; ++e) out[g * d + e] /= total;
  }
}

#if DS_X86
template <typename T>
DS_AVX512 void attend_avx512(const float* q, int64_t group, const T* K, const T* V, int64_t keys, int64_t d,
                             const bool* valid, float* scores, float* out) {
  const int64_t parts = d / 16;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < keys; ++j) {  // scores: each key is loaded once for the whole group
    if (valid && !valid[j]) {
      for (int64_t g = 0; g < group; ++g) scores[g * keys + j] = ninf;
      continue;
    }
    __m512 k[kMaxD / 16];
    for (int64_t c = 0; c < parts; ++c) k[c] = load16(K + j * d + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int64_t c = 1; c < parts; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], s);
      scores[g * keys + j] = _mm512_reduce_add_ps(s);
    }
  }
  std::vector<float> inv(group);
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, 16 keys at a time
    float* s = scores + g * keys;
    __m512 top = _mm512_set1_ps(ninf);
    for (int64_t j = 0; j < keys; j += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, tail_mask(keys - j), s + j));
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
      const __mmask16 live = tail_mask(keys - j);
      const __m512 sv = _mm512_maskz_loadu_ps(live, s + j);
      const __mmask16 kept = _mm512_mask_cmp_ps_mask(live, sv, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
      const __m512 p = _mm512_maskz_mov_ps(kept, exp16(_mm512_sub_ps(sv, mv)));
      _mm512_mask_storeu_ps(s + j, live, p);
      sum = _mm512_add_ps(sum, p);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // weighted values, four heads per pass over V
    const int64_t g1 = std::min<int64_t>(group, g0 + 4);
    __m512 acc[4][kMaxD / 16];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < parts; ++c) acc[g - g0][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      if (valid && !valid[j]) continue;
      __m512 v[kMaxD / 16];
      for (int64_t c = 0; c < parts; ++c) v[c] = load16(V + j * d + 16 * c);
      for (int64_t g = g0; g < g1; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * keys + j]);
        for (int64_t c = 0; c < parts; ++c) acc[g - g0][c] = _mm512_fmadd_ps(p, v[c], acc[g - g0][c]);
      }
    }
    for (int64_t g = g0; g < g1; ++g) {
      const __m512 r = _mm512_set1_ps(inv[g]);
      for (int64_t c = 0; c < parts; ++c) _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(acc[g - g0][c], r));
    }
  }
}

// Each of `group` rows of scores [keys] (-inf: a key not seen) -> its softmax numerators, in
// place, 8 keys at a time; inv[g] = 1 / their sum.
DS_AVX2 void softmax_avx2(float* scores, int64_t group, int64_t keys, float* inv) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, 8 keys at a time
    float* s = scores + g * keys;
    __m256 top = _mm256_set1_ps(ninf);
    int64_t j = 0;
    for (; j + 8 <= keys; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
    float m = max8(top);
    for (; j < keys; ++j) m = std::max(m, s[j]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j < keys; j += 8) {
      const int64_t left = keys - j;
      const __m256 sv = left >= 8 ? _mm256_loadu_ps(s + j) : load8(s + j, left);
      const __m256 kept = _mm256_and_ps(first_lanes8(left), _mm256_cmp_ps(sv, _mm256_set1_ps(ninf), _CMP_NEQ_OQ));
      const __m256 p = _mm256_and_ps(kept, exp8(_mm256_sub_ps(sv, mv)));
      if (left >= 8)
        _mm256_storeu_ps(s + j, p);
      else
        store8(s + j, p, left);
      sum = _mm256_add_ps(sum, p);
    }
    inv[g] = 1.f / reduce8(sum);
  }
}

// The next count floats after src asked for from memory (a long context's keys and values
// stream from memory at every step; the prefetchers alone left the loop waiting).
DS_AVX2 inline void prefetch_next(const float* src, int64_t count) {
  const char* next = reinterpret_cast<const char*>(src + count);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(float)); b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
}

// Head size d = 8 P (64, 128), a float32 cache. Keys and values go 32 at a time, every query
// head of the group reading a chunk while it is in L1 (the next chunk prefetched meanwhile); each
// head's scores take 4 keys' chains side by side, summed by one hadd tree (the loop for any d runs
// one chain of dependent FMAs per score); each head's output sums stay in registers over a chunk.
// A key not seen (valid[j] == 0) gets -inf, so a weight of 0.
template <int P>
DS_AVX2 void attend_avx2_f32(const float* q, int64_t group, const float* K, const float* V, int64_t keys,
                             const bool* valid, float* scores, float* out) {
  constexpr int64_t D = 8 * P, kChunk = 32, H = P > 8 ? 8 : P;  // H: output parts in registers at a time
  for (int64_t j0 = 0; j0 < keys; j0 += kChunk) {
    const int64_t m = std::min(kChunk, keys - j0);
    const float* k = K + j0 * D;
    prefetch_next(k, m * D);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * D;
      float* s = scores + g * keys + j0;
      int64_t j = 0;
      for (; j + 4 <= m; j += 4) {
        const float* kj = k + j * D;
        const __m256 q0 = _mm256_loadu_ps(qg);
        __m256 a0 = _mm256_mul_ps(q0, _mm256_loadu_ps(kj)), a1 = _mm256_mul_ps(q0, _mm256_loadu_ps(kj + D));
        __m256 a2 = _mm256_mul_ps(q0, _mm256_loadu_ps(kj + 2 * D)), a3 = _mm256_mul_ps(q0, _mm256_loadu_ps(kj + 3 * D));
        for (int c = 1; c < P; ++c) {
          const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
          a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj + 8 * c), a0);
          a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj + D + 8 * c), a1);
          a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj + 2 * D + 8 * c), a2);
          a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kj + 3 * D + 8 * c), a3);
        }
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      }
      for (; j < m; ++j) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k + j * D));
        for (int c = 1; c < P; ++c)
          a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(k + j * D + 8 * c), a);
        s[j] = reduce8(a);
      }
    }
  }
  if (valid) {
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < keys; ++j)
      if (!valid[j])
        for (int64_t g = 0; g < group; ++g) scores[g * keys + j] = ninf;
  }
  std::vector<float> inv(group);
  softmax_avx2(scores, group, keys, inv.data());
  std::fill(out, out + group * D, 0.f);
  for (int64_t j0 = 0; j0 < keys; j0 += kChunk) {
    const int64_t m = std::min(kChunk, keys - j0);
    const float* v = V + j0 * D;
    prefetch_next(v, m * D);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * keys + j0;
      for (int c0 = 0; c0 < P; c0 += H) {
        float* o = out + g * D + 8 * c0;
        __m256 acc[H];
        for (int c = 0; c < H; ++c) acc[c] = _mm256_loadu_ps(o + 8 * c);
        for (int64_t j = 0; j < m; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j]);
          const float* vj = v + j * D + 8 * c0;
          for (int c = 0; c < H; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), acc[c]);
        }
        for (int c = 0; c < H; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 r = _mm256_set1_ps(inv[g]);
    float* o = out + g * D;
    for (int c = 0; c < P; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * c), r));
  }
}

// 16 bf16 from p + 16 l; the floats of its even and odd elements.
DS_AVX2 inline __m256i row(const uint16_t* p, int64_t l) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * l));
}
DS_AVX2 inline __m256 even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
DS_AVX2 inline __m256 odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Head size d = 8 P (64, 128), a bf16 cache, one head at a time read straight from the cache: a
// 32-bit lane holding elements 2i and 2i + 1 gives both as float32 with one shift (the even one)
// and one AND (the odd one, already in the high half), so the query and the output sums are kept
// split the same way (even elements, odd elements) and interleaved once at the end. No widened
// copy, so a query head needs none of its group's others: the step shares heads, not KV heads,
// between threads. Scores 4 keys side by side (one hadd tree for the 4 sums); a key not seen
// (valid[j] == 0) gets -inf, so a weight of 0.
template <int P>
DS_AVX2 void attend_avx2_bf16(const float* q, int64_t group, const uint16_t* K, const uint16_t* V, int64_t keys,
                              const bool* valid, float* scores, float* out) {
  constexpr int64_t D = 8 * P, L = P / 2;  // L loads of 16 bf16 a row
  alignas(32) float qs[2 * D];  // per 16 elements: the 8 even ones, then the 8 odd ones
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    for (int64_t l = 0; l < L; ++l)
      for (int i = 0; i < 8; ++i) qs[16 * l + i] = qg[16 * l + 2 * i], qs[16 * l + 8 + i] = qg[16 * l + 2 * i + 1];
    float* s = scores + g * keys;
    int64_t j = 0;
    for (; j + 4 <= keys; j += 4) {
      const uint16_t* kj = K + j * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t l = 0; l < L; ++l) {
        const __m256 qe = _mm256_load_ps(qs + 16 * l), qo = _mm256_load_ps(qs + 16 * l + 8);
        const __m256i k0 = row(kj, l), k1 = row(kj + D, l), k2 = row(kj + 2 * D, l), k3 = row(kj + 3 * D, l);
        a0 = _mm256_fmadd_ps(qo, odd(k0), _mm256_fmadd_ps(qe, even(k0), a0));
        a1 = _mm256_fmadd_ps(qo, odd(k1), _mm256_fmadd_ps(qe, even(k1), a1));
        a2 = _mm256_fmadd_ps(qo, odd(k2), _mm256_fmadd_ps(qe, even(k2), a2));
        a3 = _mm256_fmadd_ps(qo, odd(k3), _mm256_fmadd_ps(qe, even(k3), a3));
      }
      _mm_prefetch(reinterpret_cast<const char*>(kj + 16 * D), _MM_HINT_T0);
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      _mm_storeu_ps(s + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
    for (; j < keys; ++j) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        const __m256i k = row(K + j * D, l);
        a = _mm256_fmadd_ps(_mm256_load_ps(qs + 16 * l), even(k), a);
        a = _mm256_fmadd_ps(_mm256_load_ps(qs + 16 * l + 8), odd(k), a);
      }
      s[j] = reduce8(a);
    }
    if (valid)
      for (int64_t k = 0; k < keys; ++k)
        if (!valid[k]) s[k] = -std::numeric_limits<float>::infinity();
    float inv;
    softmax_avx2(s, 1, keys, &inv);
    constexpr int64_t H = L > 4 ? 4 : L;  // loads of the row whose sums stay in registers at a time
    for (int64_t l0 = 0; l0 < L; l0 += H) {
      __m256 ae[H], ao[H];
      for (int64_t l = 0; l < H; ++l) ae[l] = ao[l] = _mm256_setzero_ps();
      for (int64_t k = 0; k < keys; ++k) {
        const __m256 p = _mm256_set1_ps(s[k]);
        const uint16_t* vk = V + k * D;
        if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(vk + 16 * D + 16 * l0), _MM_HINT_T0);
        for (int64_t l = 0; l < H; ++l) {
          const __m256i v = row(vk, l0 + l);
          ae[l] = _mm256_fmadd_ps(p, even(v), ae[l]);
          ao[l] = _mm256_fmadd_ps(p, odd(v), ao[l]);
        }
      }
      const __m256 r = _mm256_set1_ps(inv);
      for (int64_t l = 0; l < H; ++l) {
        const __m256 e = _mm256_mul_ps(ae[l], r), o = _mm256_mul_ps(ao[l], r);
        const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // e0 o0 e1 o1 | e4 o4 e5 o5 ..
        float* dst = out + g * D + 16 * (l0 + l);
        _mm256_storeu_ps(dst, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
  }
}

// The same 8 lanes wide (AVX2), for d a multiple of 8.
template <typename T>
DS_AVX2 void attend_avx2(const float* q, int64_t group, const T* K, const T* V, int64_t keys, int64_t d,
                         const bool* valid, float* scores, float* out) {
  const int64_t parts = d / 8;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < keys; ++j) {
    if (valid && !valid[j]) {
      for (int64_t g = 0; g < group; ++g) scores[g * keys + j] = ninf;
      continue;
    }
    __m256 k[kMaxD / 8];
    for (int64_t c = 0; c < parts; ++c) k[c] = load8(K + j * d + 8 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]);
      for (int64_t c = 1; c < parts; ++c) s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), k[c], s);
      scores[g * keys + j] = reduce8(s);
    }
  }
  std::vector<float> inv(group);
  softmax_avx2(scores, group, keys, inv.data());
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // weighted values, four heads per pass over V
    const int64_t g1 = std::min<int64_t>(group, g0 + 4);
    __m256 acc[4][kMaxD / 8];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < parts; ++c) acc[g - g0][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys; ++j) {
      if (valid && !valid[j]) continue;
      for (int64_t c = 0; c < parts; ++c) {
        const __m256 v = load8(V + j * d + 8 * c);
        for (int64_t g = g0; g < g1; ++g)
          acc[g - g0][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * keys + j]), v, acc[g - g0][c]);
      }
    }
    for (int64_t g = g0; g < g1; ++g) {
      const __m256 r = _mm256_set1_ps(inv[g]);
      for (int64_t c = 0; c < parts; ++c) _mm256_storeu_ps(out + g * d + 8 * c, _mm256_mul_ps(acc[g - g0][c], r));
    }
  }
}
#endif

// Whether attend() reads the cache one query head at a time (attend_avx2_bf16), so the step may
// give a KV head's query heads to different threads at no cost.
template <typename T>
bool attends_by_head(int64_t d) {
#if DS_X86
  return std::is_same_v<T, uint16_t> && vector_width() == 8 && (d == 64 || d == 128);
#else
  return false;
#endif
}

template <typename T>
void attend(const float* q, int64_t group, const T* K, const T* V, int64_t keys, int64_t d, const bool* valid,
            float* scores, float* out) {
#if DS_X86
  const int width = vector_width();
  if (width == 16 && d % 16 == 0 && d <= kMaxD) return attend_avx512(q, group, K, V, keys, d, valid, scores, out);
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (width == 8 && d == 64) return attend_avx2_bf16<8>(q, group, K, V, keys, valid, scores, out);
    if (width == 8 && d == 128) return attend_avx2_bf16<16>(q, group, K, V, keys, valid, scores, out);
  } else {
    if (width == 8 && d == 64) return attend_avx2_f32<8>(q, group, K, V, keys, valid, scores, out);
    if (width == 8 && d == 128) return attend_avx2_f32<16>(q, group, K, V, keys, valid, scores, out);
  }
  if (width >= 8 && d % 8 == 0 && d <= kMaxD) return attend_avx2(q, group, K, V, keys, d, valid, scores, out);
#endif
  attend_scalar(q, group, K, V, keys, d, valid, scores, out);
}

// ---------------------------------------------------------------- the step's threads

// float32 -> bf16 bits, as the linear ops round their output
void to_bf16(const float* x, int64_t count, uint16_t* out) { hetero_run_cpu::round_bf16_row(x, count, out); }

// h[r, a + j] += y[r, j] for the rows of a product's share [a, b) (y [n, b - a])
void add_into(float* h, int64_t hidden, const float* y, int64_t n, int64_t a, int64_t b) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t e = a; e < b; ++e) h[r * hidden + e] += y[r * (b - a) + e - a];
}

// The start of a thread's next share of weights, prefetched before it waits at a barrier so the
// stream is under way when the next product begins.
struct Ahead {
  const char* at[3] = {nullptr, nullptr, nullptr};
  int64_t bytes[3] = {0, 0, 0};
};

struct Team {
  int id = 0, size = 1;
  void barrier(const Ahead& ahead) const {
#if DS_X86
    for (int i = 0; i < 3; ++i)
      for (int64_t b = 0; b < ahead.bytes[i]; b += 64) _mm_prefetch(ahead.at[i] + b, _MM_HINT_T0);
#endif
#ifdef _OPENMP
    if (size > 1) {
#pragma omp barrier
    }
#endif
  }
};

Team this_team() {
#ifdef _OPENMP
  return Team{omp_get_thread_num(), omp_get_num_threads()};
#else
  return Team{};
#endif
}

// The thread's share [a, b) of `rows` output rows, in multiples of 16 rows (the AMX kernels' tile
// height) but for the last; every row is computed by the same kernel whoever computes it.
std::pair<int64_t, int64_t> share(int64_t rows, const Team& t) {
  auto edge = [&](int k) { return k >= t.size ? rows : std::min(rows, (rows * k / t.size + 8) / 16 * 16); };
  return {edge(t.id), edge(t.id + 1)};
}

std::pair<int64_t, int64_t> share_tasks(int64_t tasks, const Team& t) {
  return {tasks * t.id / t.size, tasks * (t.id + 1) / t.size};
}

// An exception inside the parallel region must not skip a barrier (the other threads would wait
// for ever): the first one is kept, later phases do nothing, and it is rethrown after the region.
class Failure {
 public:
  template <typename F>
  void guard(F&& f) {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true);
    }
  }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

// ---------------------------------------------------------------- projections

struct Proj {
  Tensor w, codes, scales, row_scale, bias;
  bool bf16_x = false;
  bool int8_x = false;  // NVFP4 times x quantised to int8 (hetero_run::nvfp4_linear_i8's kernel)
  int64_t out = 0, in = 0;

  bool set() const { return out > 0; }
};

// The start of rows [a, b) of p (of rows li + a .. li + b too, for gate_up's up rows when li > 0).
Ahead ahead_of(const Proj& p, std::pair<int64_t, int64_t> rows, int64_t li = 0) {
  Ahead ah;
  const auto [a, b] = rows;
  if (!p.set() || a >= b) return ah;
  const int64_t window = hetero_run_cpu::prefetch_ahead_bytes();  // what the kernels run ahead of their loop
  if (p.codes.defined()) {
    const int64_t half = p.codes.size(1), nb = p.scales.size(1);
    const auto* c = reinterpret_cast<const char*>(p.codes.data_ptr<uint8_t>());
    const auto* s = reinterpret_cast<const char*>(p.scales.data_ptr<uint8_t>());
    ah.at[0] = c + a * half;
    ah.bytes[0] = std::min(window, (b - a) * half);
    ah.at[1] = s + a * nb;
    ah.bytes[1] = std::min(window / 8, (b - a) * nb);
    if (li > 0) {
      ah.at[2] = c + (li + a) * half;
      ah.bytes[2] = std::min(window, (b - a) * half);
    }
  } else {
    const int64_t row = p.in * static_cast<int64_t>(p.w.element_size());
    const auto* w = reinterpret_cast<const char*>(p.w.data_ptr());
    ah.at[0] = w + a * row;
    ah.bytes[0] = std::min(window, (b - a) * row);
    if (li > 0) {
      ah.at[1] = w + (li + a) * row;
      ah.bytes[1] = std::min(window, (b - a) * row);
    }
  }
  return ah;
}

Tensor contiguous_as(const Tensor& t, at::ScalarType dtype, const char* name) {
  HR_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  HR_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  return t.contiguous();
}

Proj make_proj(const std::optional<Tensor>& w, const std::optional<Tensor>& codes, const std::optional<Tensor>& scales,
               const std::optional<Tensor>& row_scale, const std::optional<Tensor>& bias, bool bf16_x, bool int8_x) {
  Proj p;
  HR_CHECK(!(bf16_x && int8_x), "a projection takes bf16 or int8 activations, not both");
  HR_CHECK(!int8_x || codes.has_value(), "int8 activations need NVFP4 weights");
  if (codes.has_value()) {
    HR_CHECK(!w.has_value() && scales.has_value() && row_scale.has_value(),
             "an NVFP4 projection takes codes, block_scale and row_scale, and no dense w");
    p.codes = contiguous_as(*codes, at::kByte, "codes");
    p.scales = contiguous_as(*scales, at::kByte, "block_scale");
    p.row_scale = contiguous_as(*row_scale, at::kFloat, "row_scale");
    HR_CHECK(p.codes.dim() == 2 && p.scales.dim() == 2 && p.scales.size(0) == p.codes.size(0) &&
                 p.scales.size(1) * 8 == p.codes.size(1) && p.row_scale.numel() == p.codes.size(0),
             "NVFP4 shapes do not fit: codes ", p.codes.sizes(), ", block_scale ", p.scales.sizes(), ", row_scale ",
             p.row_scale.sizes());
    p.out = p.codes.size(0);
    p.in = p.codes.size(1) * 2;
    p.bf16_x = bf16_x;
    p.int8_x = int8_x;
  } else {
    HR_CHECK(w.has_value(), "a projection needs a dense w or NVFP4 codes");
    HR_CHECK(w->scalar_type() == at::kBFloat16 || w->scalar_type() == at::kFloat, "w must be bf16 or f32");
    HR_CHECK(w->dim() == 2 && w->device().is_cpu(), "w must be a 2-D CPU tensor");
    p.w = w->contiguous();
    p.out = p.w.size(0);
    p.in = p.w.size(1);
    p.bf16_x = bf16_x && p.w.scalar_type() == at::kBFloat16;
  }
  if (bias.has_value()) {
    p.bias = contiguous_as(*bias, at::kFloat, "bias");
    HR_CHECK(p.bias.numel() == p.out, "bias needs ", p.out, " values, got ", p.bias.numel());
  }
  return p;
}

// ---------------------------------------------------------------- the class

enum Which : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  Tensor input_norm, post_norm, qk_norm;
  Proj proj[4];
};

struct DraftStep : torch::CustomClassHolder {
  int64_t layers, hidden, heads, kv_heads, d;
  double eps;
  Tensor embed, norm, cos, sin, k_cache, v_cache;
  std::vector<Layer> L;
  std::vector<Proj> head;
  int64_t few_path = 0, many_path = 0, many_from = 1;  // the projections' kernels: set_paths

  DraftStep(int64_t layers_, int64_t hidden_, int64_t heads_, int64_t kv_heads_, int64_t head_dim, double eps_,
            Tensor embed_, Tensor norm_, Tensor cos_, Tensor sin_, Tensor k_cache_, Tensor v_cache_)
      : layers(layers_), hidden(hidden_), heads(heads_), kv_heads(kv_heads_), d(head_dim), eps(eps_), L(layers_) {
    HR_CHECK(layers > 0 && hidden > 0 && heads > 0 && kv_heads > 0 && d > 0 && heads % kv_heads == 0,
             "bad shape: layers ", layers, ", hidden ", hidden, ", heads ", heads, ", kv_heads ", kv_heads,
             ", head_dim ", d);
    HR_CHECK(d % 2 == 0, "head_dim must be even for rotary embeddings, got ", d);
    HR_CHECK(embed_.dim() == 2 && embed_.size(1) == hidden && embed_.device().is_cpu() &&
                 (embed_.scalar_type() == at::kBFloat16 || embed_.scalar_type() == at::kFloat),
             "embed must be a bf16 or f32 CPU tensor [vocab, ", hidden, "]");
    embed = embed_.contiguous();
    norm = contiguous_as(norm_, at::kFloat, "norm");
    HR_CHECK(norm.numel() == hidden, "norm needs ", hidden, " values");
    cos = contiguous_as(cos_, at::kFloat, "cos");
    sin = contiguous_as(sin_, at::kFloat, "sin");
    HR_CHECK(cos.dim() == 2 && cos.size(1) == d && sin.sizes() == cos.sizes(), "cos and sin must be [positions, ",
             d, "]");
    HR_CHECK(k_cache_.dim() == 5 && k_cache_.size(1) == layers && k_cache_.size(2) == kv_heads &&
                 k_cache_.size(4) == d && v_cache_.sizes() == k_cache_.sizes(),
             "k_cache and v_cache must be [slots, ", layers, ", ", kv_heads, ", max_tokens, ", d, "]");
    HR_CHECK(k_cache_.is_contiguous() && v_cache_.is_contiguous(), "the caches must be contiguous");
    HR_CHECK(k_cache_.scalar_type() == v_cache_.scalar_type() &&
                 (k_cache_.scalar_type() == at::kBFloat16 || k_cache_.scalar_type() == at::kFloat),
             "the caches must both be bf16 or both f32");
    k_cache = k_cache_;  // shared with the caller, written in place
    v_cache = v_cache_;
  }

  void set_norms(int64_t layer, Tensor input_norm, Tensor post_norm, std::optional<Tensor> qk_norm) {
    HR_CHECK(0 <= layer && layer < layers, "layer ", layer, " is not in 0..", layers - 1);
    Layer& l = L[layer];
    l.input_norm = contiguous_as(input_norm, at::kFloat, "input_norm");
    l.post_norm = contiguous_as(post_norm, at::kFloat, "post_norm");
    HR_CHECK(l.input_norm.numel() == hidden && l.post_norm.numel() == hidden, "norms need ", hidden, " values");
    l.qk_norm = Tensor();
    if (qk_norm.has_value()) {
      l.qk_norm = contiguous_as(*qk_norm, at::kFloat, "qk_norm");
      HR_CHECK(l.qk_norm.numel() == (heads + kv_heads) * d, "qk_norm must be [", heads + kv_heads, ", ", d, "]");
    }
  }

  void set_proj(int64_t layer, int64_t which, std::optional<Tensor> w, std::optional<Tensor> codes,
                std::optional<Tensor> scales, std::optional<Tensor> row_scale, std::optional<Tensor> bias, bool bf16_x,
                bool int8_x) {
    Proj p = make_proj(w, codes, scales, row_scale, bias, bf16_x, int8_x);
    if (layer == -1) {
      HR_CHECK(which >= 0, "head numbers start at 0, got ", which);
      HR_CHECK(p.in == hidden, "a head takes ", hidden, " inputs, got ", p.in);
      if (static_cast<int64_t>(head.size()) <= which) head.resize(which + 1);
      head[which] = p;
      return;
    }
    HR_CHECK(0 <= layer && layer < layers, "layer ", layer, " is not in 0..", layers - 1);
    HR_CHECK(0 <= which && which < 4, "projection ", which, " is not 0 (qkv), 1 (o), 2 (gate_up) or 3 (down)");
    const int64_t qkv_out = (heads + 2 * kv_heads) * d;
    if (which == kQkv) HR_CHECK(p.in == hidden && p.out == qkv_out, "qkv must be [", qkv_out, ", ", hidden, "]");
    if (which == kO) HR_CHECK(p.in == heads * d && p.out == hidden, "o must be [", hidden, ", ", heads * d, "]");
    if (which == kGateUp) HR_CHECK(p.in == hidden && p.out % 2 == 0, "gate_up must be [2 * intermediate, ", hidden, "]");
    if (which == kDown) HR_CHECK(p.out == hidden, "down must have ", hidden, " outputs");
    L[layer].proj[which] = p;
  }

  // 0: the projections take the best kernels the CPU allows; 1: the same without AMX (whose tiles
  // are the faster for many rows, the vector kernels on some CPUs for one). A forward of fewer
  // than `from` rows takes `few`, a wider one `many`: every row of a forward takes one path, so a
  // row keeps its bits whatever the other rows of a forward as long as the forwards it is
  // compared across fall on the same side of `from`.
  void set_paths(int64_t few, int64_t many, int64_t from) {
    for (int64_t p : {few, many}) HR_CHECK(p == 0 || p == 1, "path must be 0 (best allowed) or 1 (no AMX), got ", p);
    HR_CHECK(from >= 1, "from must be >= 1, got ", from);
    few_path = few, many_path = many, many_from = from;
  }
  std::tuple<int64_t, int64_t, int64_t> get_paths() const { return {few_path, many_path, many_from}; }

  void drop_head(int64_t which) {
    HR_CHECK(which > 0 && which < static_cast<int64_t>(head.size()), "no head ", which, " to drop");
    head[which] = Proj();
  }

  Tensor forward(Tensor ids, Tensor slots, Tensor index, Tensor positions, std::optional<Tensor> mask, int64_t head_no,
                 bool last) {
    const int64_t n = ids.numel();
    HR_CHECK(n > 0, "a forward needs at least one row");
    for (const Tensor* t : {&ids, &slots, &index, &positions})
      HR_CHECK(t->dim() == 1 && t->numel() == n && t->scalar_type() == at::kLong && t->device().is_cpu(),
               "ids, slots, index and positions must be int64 CPU tensors [", n, "]");
    ids = ids.contiguous();
    slots = slots.contiguous();
    index = index.contiguous();
    positions = positions.contiguous();
    HR_CHECK(head_no >= 0 && head_no < static_cast<int64_t>(head.size()) && head[head_no].set(), "no head ", head_no);
    for (int64_t l = 0; l < layers; ++l) {
      HR_CHECK(L[l].input_norm.defined(), "layer ", l, " has no norms");
      for (int w = 0; w < 4; ++w) HR_CHECK(L[l].proj[w].set(), "layer ", l, " lacks projection ", w);
    }
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* ix = index.data_ptr<int64_t>();
    const int64_t* ps = positions.data_ptr<int64_t>();
    const int64_t num_slots = k_cache.size(0), max_tokens = k_cache.size(3);
    int64_t widest = 0;
    for (int64_t r = 0; r < n; ++r) {
      HR_CHECK(0 <= id[r] && id[r] < embed.size(0), "row ", r, ": token id ", id[r], " is not in 0..",
               embed.size(0) - 1);
      HR_CHECK(0 <= sl[r] && sl[r] < num_slots, "row ", r, ": slot ", sl[r], " is not in 0..", num_slots - 1);
      HR_CHECK(0 <= ix[r] && ix[r] < max_tokens, "row ", r, ": cache index ", ix[r], " is not in 0..",
               max_tokens - 1);
      HR_CHECK(0 <= ps[r] && ps[r] < cos.size(0), "row ", r, ": position ", ps[r], " is not in 0..",
               cos.size(0) - 1);
      widest = std::max(widest, ix[r] + 1);
    }
    const bool* mk = nullptr;
    int64_t mask_stride = 0;
    Tensor mask_c;
    if (mask.has_value()) {
      HR_CHECK(mask->dim() == 2 && mask->size(0) == n && mask->size(1) >= widest &&
                   mask->scalar_type() == at::kBool && mask->device().is_cpu(),
               "mask must be a bool CPU tensor [", n, ", >= ", widest, "]");
      mask_c = mask->contiguous();
      mk = mask_c.data_ptr<bool>();
      mask_stride = mask_c.size(1);
      for (int64_t r = 0; r < n; ++r)
        HR_CHECK(mk[r * mask_stride + ix[r]], "row ", r, ": the mask hides the row's own index ", ix[r]);
    }
    if (k_cache.scalar_type() == at::kBFloat16)
      return run<uint16_t>(n, id, sl, ix, ps, mk, mask_stride, head[head_no], last);
    return run<float>(n, id, sl, ix, ps, mk, mask_stride, head[head_no], last);
  }

  template <typename T>
  Tensor run(int64_t n, const int64_t* id, const int64_t* sl, const int64_t* ix, const int64_t* ps, const bool* mk,
             int64_t mask_stride, const Proj& out_head, bool last) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t path = n >= many_from ? many_path : few_path;
    const int64_t group = heads / kv_heads, qkv_width = (heads + 2 * kv_heads) * d, half = d / 2;
    const int64_t max_tokens = k_cache.size(3);
    const float scale = 1.f / std::sqrt(static_cast<float>(d)), feps = static_cast<float>(eps);
    const bool by_head = attends_by_head<T>(d);
    int64_t inter = 0;
    bool att_bf16 = false, act_bf16 = false;
    for (const Layer& ly : L) {
      inter = std::max(inter, ly.proj[kGateUp].out / 2);
      att_bf16 = att_bf16 || ly.proj[kO].bf16_x;
      act_bf16 = act_bf16 || ly.proj[kDown].bf16_x;
    }
    // shared activations: each is written in one phase (every thread its own part) and read
    // after the barrier that ends it
    Tensor h = at::empty({n, hidden}, f32), qkv = at::empty({n, qkv_width}, f32);
    Tensor att = at::empty({n, heads * d}, f32), act = at::empty({n, inter}, f32);
    Tensor att_b = att_bf16 ? at::empty({n, heads * d}, at::kBFloat16) : Tensor();
    Tensor act_b = act_bf16 ? at::empty({n, inter}, at::kBFloat16) : Tensor();
    const int64_t n_out = last ? 1 : n, first_out = n - n_out;  // rows the head computes: all, or the last
    Tensor logits = at::empty({n_out, out_head.out}, f32);
    float* hd = h.data_ptr<float>();
    float* qd = qkv.data_ptr<float>();
    float* ad = att.data_ptr<float>();
    float* actd = act.data_ptr<float>();
    uint16_t* abd = att_bf16 ? reinterpret_cast<uint16_t*>(att_b.data_ptr()) : nullptr;
    uint16_t* actbd = act_bf16 ? reinterpret_cast<uint16_t*>(act_b.data_ptr()) : nullptr;
    float* ld = logits.data_ptr<float>();
    const float* cd = cos.data_ptr<float>();
    const float* sd = sin.data_ptr<float>();
    T* kc = reinterpret_cast<T*>(k_cache.data_ptr());
    T* vc = reinterpret_cast<T*>(v_cache.data_ptr());
    if (embed.scalar_type() == at::kFloat) {
      const float* e = embed.data_ptr<float>();
      for (int64_t r = 0; r < n; ++r) std::memcpy(hd + r * hidden, e + id[r] * hidden, hidden * sizeof(float));
    } else {
      const uint16_t* e = reinterpret_cast<const uint16_t*>(embed.data_ptr());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t c = 0; c < hidden; ++c) hd[r * hidden + c] = to_float(e[id[r] * hidden + c]);
    }
    int64_t widest_out = out_head.out;
    for (const Layer& ly : L)
      for (const Proj& p : ly.proj) widest_out = std::max(widest_out, p.out);
    int64_t keys_total = 0;
    for (int64_t r = 0; r < n; ++r) keys_total += ix[r] + 1;
    // a step worth less than this many multiply-adds runs on one thread (waking another costs more)
    int64_t macs = out_head.out * out_head.in * n_out + keys_total * heads * d * 2 * layers;
    for (const Layer& ly : L)
      for (const Proj& p : ly.proj) macs += p.out * p.in * n;
    const int team_wanted = macs < (1 << 20) ? 1 : static_cast<int>(at::get_num_threads());
    Failure failure;

    // The whole step is one parallel region: each thread takes a fixed share of every
    // projection's output rows (the same kernels and bits as the registered ops) and of the
    // attention tasks, the threads meet at a barrier where one phase's results feed the next,
    // and each thread prefetches the start of its next share of weights before it waits.
#pragma omp parallel num_threads(team_wanted) if (team_wanted > 1)
    {
      const Team tm = this_team();
      Tensor x, xb, y;  // this thread's normed copy of h (float32, bf16) and its rows of a product
      float* xd = nullptr;
      uint16_t* xbd = nullptr;
      float* yd = nullptr;
      std::vector<float> rotated, scores, gate;
      std::vector<uint8_t> xq;  // this thread's int8 copy of a product's input (int8_x projections)
      failure.guard([&] {  // a failed allocation skips every phase, not a barrier
        x = at::empty({n, hidden}, f32);
        xb = at::empty({n, hidden}, at::kBFloat16);
        y = at::empty({n, (widest_out + tm.size - 1) / tm.size + 16}, f32);  // a share is at most 16 rows over even
        xd = x.data_ptr<float>();
        xbd = reinterpret_cast<uint16_t*>(xb.data_ptr());
        yd = y.data_ptr<float>();
        rotated.resize(d);
      });
      // x = norm(h) for rows first .. n - 1 of h (each thread its own copy: no barrier), rounded
      // to bf16 when the product wants it
      auto normed = [&](const float* w, bool bf16, int64_t first = 0) {
        for (int64_t r = first; r < n; ++r) rms_norm_row(hd + r * hidden, w, hidden, feps, xd + (r - first) * hidden);
        if (bf16) to_bf16(xd, (n - first) * hidden, xbd);
      };
      // `in` quantised into xq for an int8_x projection (each thread its own copy: no barrier)
      auto prepare = [&](const Proj& p, const Tensor& in) {
        if (!p.int8_x) return;
        const int64_t rows = in.size(0), width = in.size(1);
        xq.resize(rows * hetero_run_cpu::i8_groups(width) * hetero_run_cpu::kI8GroupBytes);
        hetero_run_cpu::quantize_i8_rows(in.data_ptr<float>(), rows, width, xq.data());
      };
      // rows [a, b) of p's output for every row of `in` into y [rows of in, b - a], bias added
      // (an int8_x projection reads `in` as prepare() left it in xq)
      auto product = [&](const Proj& p, const Tensor& in, int64_t a, int64_t b) {
        if (a >= b) return;
        if (p.int8_x)
          hetero_run_cpu::nvfp4_i8_linear_rows(xq.data(), in.size(0), in.size(1), p.codes, p.scales, p.row_scale, a, b,
                                               yd);
        else if (p.codes.defined())
          hetero_run_cpu::nvfp4_linear_rows(in, p.codes, p.scales, p.row_scale, a, b, yd, path);
        else
          hetero_run_cpu::dense_linear_rows(in, p.w, a, b, yd, path);
        if (p.bias.defined()) {
          const float* bd = p.bias.data_ptr<float>();
          for (int64_t r = 0; r < in.size(0); ++r)
            for (int64_t e = a; e < b; ++e) yd[r * (b - a) + e - a] += bd[e];
        }
      };
      for (int64_t l = 0; l < layers; ++l) {
        const Layer& ly = L[l];
        const Proj& pqkv = ly.proj[kQkv];
        const Proj& po = ly.proj[kO];
        const Proj& pgu = ly.proj[kGateUp];
        const Proj& pdown = ly.proj[kDown];
        const int64_t li = pgu.out / 2;
        // qkv [n, (heads + 2 kv_heads) d]: q heads, k heads, v heads
        failure.guard([&] {
          normed(ly.input_norm.data_ptr<float>(), pqkv.bf16_x);
          const auto [a, b] = share(pqkv.out, tm);
          prepare(pqkv, x);
          product(pqkv, pqkv.bf16_x ? xb : x, a, b);
          for (int64_t r = 0; r < n; ++r) std::memcpy(qd + r * qkv_width + a, yd + r * (b - a), (b - a) * sizeof(float));
        });
        tm.barrier(ahead_of(po, share(po.out, tm)));
        // (row, KV head) tasks: norm (qwen3) and rotate the group's q heads and the k head, write k and v
        const float* qk_norm = ly.qk_norm.defined() ? ly.qk_norm.data_ptr<float>() : nullptr;
        int64_t t0, t1;
        std::tie(t0, t1) = share_tasks(n * kv_heads, tm);
        failure.guard([&] {
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t r = t / kv_heads, g = t % kv_heads;
            float* row = qd + r * qkv_width;
            const float* c = cd + ps[r] * d;
            const float* s = sd + ps[r] * d;
            for (int64_t k = 0; k <= group; ++k) {
              const int64_t hh = k < group ? g * group + k : heads + g;
              float* v = row + hh * d;
              if (qk_norm) rms_norm_row(v, qk_norm + hh * d, d, feps, v);
              for (int64_t e = 0; e < d; ++e) rotated[e] = v[e] * c[e] + v[(e + half) % d] * s[e];
              const float mult = hh < heads ? scale : 1.f;  // q carries the softmax scale from here on
              for (int64_t e = 0; e < d; ++e) v[e] = rotated[e] * mult;
            }
            const int64_t at_ = (((sl[r] * layers + l) * kv_heads + g) * max_tokens + ix[r]) * d;
            const float* kr = row + (heads + g) * d;
            const float* vr = row + (heads + kv_heads + g) * d;
            for (int64_t e = 0; e < d; ++e) {
              store(kc + at_ + e, kr[e]);
              store(vc + at_ + e, vr[e]);
            }
          }
        });
        tm.barrier(Ahead{});  // every row's keys and values are written before any row attends
        // (row, KV head, part) tasks: a part is the whole group of query heads, or one head where
        // the attention reads the cache per head (attends_by_head) and the KV heads are too few to
        // keep the threads equally busy (3 on 2 threads); a head's bits are the same either way
        failure.guard([&] {
          const int64_t parts = by_head && n * kv_heads < 4 * tm.size ? group : 1;  // few tasks: share heads
          int64_t a0, a1;
          std::tie(a0, a1) = share_tasks(n * kv_heads * parts, tm);
          for (int64_t t = a0; t < a1; ++t) {
            const int64_t r = t / (kv_heads * parts), g = (t / parts) % kv_heads, part = t % parts;
            const int64_t h0 = part * group / parts, h1 = (part + 1) * group / parts;
            const int64_t first = g * group + h0, count = h1 - h0;
            const int64_t keys = ix[r] + 1;
            scores.resize(count * keys);
            const int64_t base = ((sl[r] * layers + l) * kv_heads + g) * max_tokens * d;
            float* out = ad + r * heads * d + first * d;
            attend<T>(qd + r * qkv_width + first * d, count, kc + base, vc + base, keys, d,
                      mk ? mk + r * mask_stride : nullptr, scores.data(), out);
            if (po.bf16_x) to_bf16(out, count * d, abd + r * heads * d + first * d);
          }
        });
        tm.barrier(Ahead{});
        // h += o(att), each thread its share of h's columns
        failure.guard([&] {
          const auto [a, b] = share(po.out, tm);
          prepare(po, att);
          product(po, po.bf16_x ? att_b : att, a, b);
          add_into(hd, hidden, yd, n, a, b);
        });
        tm.barrier(ahead_of(pgu, share(li, tm), li));
        // act = silu(gate) * up, each thread the gate rows and the up rows of its share
        failure.guard([&] {
          normed(ly.post_norm.data_ptr<float>(), pgu.bf16_x);
          const auto [a, b] = share(li, tm);
          const Tensor& in = pgu.bf16_x ? xb : x;
          const int64_t w = b - a;
          if (w > 0) {
            prepare(pgu, in);
            product(pgu, in, a, b);  // gate rows into y [n, w]
            gate.assign(yd, yd + n * w);
            product(pgu, in, li + a, li + b);  // up rows
            for (int64_t r = 0; r < n; ++r) {
              float* dst = actd + r * li + a;
              silu_mul_row(gate.data() + r * w, yd + r * w, w, dst);
              if (pdown.bf16_x) to_bf16(dst, w, actbd + r * li + a);
            }
          }
        });
        tm.barrier(ahead_of(pdown, share(pdown.out, tm)));
        // h += down(act)
        failure.guard([&] {
          const auto [a, b] = share(pdown.out, tm);
          const Tensor in = pdown.bf16_x ? at::from_blob(actbd, {n, li}, at::kBFloat16) : at::from_blob(actd, {n, li}, f32);
          prepare(pdown, in);
          product(pdown, in, a, b);
          add_into(hd, hidden, yd, n, a, b);
        });
        const Proj& next = l + 1 < layers ? L[l + 1].proj[kQkv] : out_head;
        tm.barrier(ahead_of(next, share(next.out, tm)));
      }
      failure.guard([&] {
        normed(norm.data_ptr<float>(), out_head.bf16_x, first_out);
        const auto [a, b] = share(out_head.out, tm);
        const Tensor in = out_head.bf16_x ? xb.narrow(0, 0, n_out) : x.narrow(0, 0, n_out);
        prepare(out_head, in);
        product(out_head, in, a, b);
        for (int64_t r = 0; r < n_out; ++r)
          std::memcpy(ld + r * out_head.out + a, yd + r * (b - a), (b - a) * sizeof(float));
      });
    }
    failure.rethrow();
    return logits;
  }
};

}  // namespace
}  // namespace hetero_run_drafter

TORCH_LIBRARY_FRAGMENT(hetero_run, m) {
  m.class_<hetero_run_drafter::DraftStep>("DraftStep")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor,
                       at::Tensor, at::Tensor, at::Tensor>())
      .def("set_norms", &hetero_run_drafter::DraftStep::set_norms)
      .def("set_proj", &hetero_run_drafter::DraftStep::set_proj)
      .def("drop_head", &hetero_run_drafter::DraftStep::drop_head)
      .def("set_paths", &hetero_run_drafter::DraftStep::set_paths)
      .def("paths", &hetero_run_drafter::DraftStep::get_paths)
      .def("forward", &hetero_run_drafter::DraftStep::forward);
}
