// Dense (bf16 / fp32 weights) x @ W.T with AVX-512: exact widening of bf16 for float32 x,
// vdpbf16ps for bf16 x.
//
// For one x row (a decode step) each thread walks its output rows one weight row at a time, so
// its weights arrive as one sequential stream: the hardware prefetchers keep such a stream at
// the memory's bandwidth, while several rows read side by side, 1-2 KiB apart, fall well short
// of it (about 31 against 22 GB/s on a 2-core Zen 4). Up to four rows of x meet each weight row
// while it sits in L1, so the weights stream once. With more rows of x, or once x no longer fits
// in half of L1 (a long verify, a prefill chunk) four weight rows share each load of x (three x
// rows each load of a weight row), 64 weight rows stay in
// L2 while chunks of x rows that fit L1 pass over them. The order of each (weight row, x row)
// sum is dot_block's in every case.
#include "cpu_kernels.h"

#if HR_X86
#include "rows_avx512.h"

namespace hetero_run_cpu {
namespace {

constexpr int64_t kBlockedAbove = 16 << 10;  // bytes of x: half of L1
// Rows of x one pass of a weight row takes (rows_times_x<T, 1, 4>); more would read each weight
// row several times from L1 with few accumulators: 9 rows cost 1.5-2.2x one row that way against
// 1.5-1.9x from L2 in the blocked path (A/B in one process, both cores, every TP=1 shape).
constexpr int64_t kOnePass = 4;

// Blocks for many rows of x: 64 weight rows (kept in L2) against chunks of x rows that fit half
// of L1, four weight rows by four x rows at a time (dot_block_phased).
constexpr int64_t kWeightChunk = 64;

template <typename W>
void prefetch_rows(const W* rows, int64_t count, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t b = 0; b < count * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

template <typename T>
void dense_linear_impl(const typename T::X* x, int64_t n, int64_t in, const typename T::W* w, int64_t out, float* y) {
  const int64_t x_row = in * static_cast<int64_t>(sizeof(typename T::X));
  const int64_t grain = grain_rows(in * static_cast<int64_t>(sizeof(typename T::W)));
  const bool blocked = n > kOnePass || (n > 1 && n * x_row > kBlockedAbove);
  const int64_t x_chunk = std::max<int64_t>(4, (512 << 10) / x_row / 4 * 4);
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    if (!blocked) {
      for (int64_t r = r0; r < r1; ++r) rows_times_x<T, 1, 4>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
      return;
    }
    for (int64_t c0 = r0; c0 < r1; c0 += kWeightChunk) {
      const int64_t c1 = std::min(r1, c0 + kWeightChunk);
      for (int64_t i0 = 0; i0 < n; i0 += x_chunk) {
        const int64_t m = std::min(x_chunk, n - i0);
        const typename T::X* xs = x + i0 * in;
        float* ys = y + i0 * out;
        int64_t r = c0;
        for (; r + 4 <= c1; r += 4) {
          if (i0 == 0)  // bring the next chunk's rows into cache while this one computes
            prefetch_rows(w + (r + kWeightChunk) * in, std::min<int64_t>(4, std::max<int64_t>(0, r1 - r - kWeightChunk)),
                          in * static_cast<int64_t>(sizeof(typename T::W)));
          four_rows_times_x<T>(w + r * in, in, xs, in, m, in, r, ys, out);
        }
        for (; r < c1; ++r) rows_times_x<T, 1, 4>(w + r * in, in, xs, in, m, in, r, nullptr, ys, out);
      }
    }
  });
}

}  // namespace

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  dense_linear_impl<Fp32Fma<float>>(x, n, in, w, out, y);
}

void dense_linear_avx512(const float* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl<Fp32Fma<uint16_t>>(x, n, in, w, out, y);
}

void dense_linear_avx512_bf16(const uint16_t* x, int64_t n, int64_t in, const uint16_t* w, int64_t out, float* y) {
  dense_linear_impl<Bf16Dot>(x, n, in, w, out, y);
}

}  // namespace hetero_run_cpu
#endif
