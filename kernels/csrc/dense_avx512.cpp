// Dense (bf16 / fp32 weights) x @ W.T with AVX-512: exact widening of bf16 for float32 x,
// vdpbf16ps for bf16 x.
//
// Up to 16 rows of x that fit in L1 beside two weight rows (a decode step, a speculative verify,
// a batch of decode rows) are "staged": each pair of weight rows is first copied into an L1
// buffer, then meets the rows of x in pieces of at most five (2 x 5 pairs, 20 accumulators: 7
// loads per 10 dot products). A pair is two adjacent rows, so the weights still arrive as one
// sequential stream, which the hardware prefetchers keep near the memory's bandwidth (several
// rows read side by side, 1-2 KiB apart, fall well short of it: about 31 against 22 GB/s on a
// 2-core Zen 4). The copy reads the pair as one burst of independent loads, so many misses are in
// flight at once; dot products reading the weights straight from memory leave it nearly idle
// while they compute, and a verify costs the memory's time plus the arithmetic's.
//
// Whether each pair also asks for the pair two ahead in L2 (`prefetcht1`), and whether one row of
// x is staged too, depends on the CPU (the sums are the same either way), measured on the lm_head
// ([151936, 896] bf16):
// - a 2-core Zen 4: staged without the prefetch, 5 rows cost 1.0-1.1x one row (dot products
//   reading memory: 1.6-2.0x), with it 1.25x; the prefetch pays only once a pair takes several
//   pieces of x (9 rows: 1.5x against 1.9x). One row of x walks its weight rows one at a time.
// - a 2-vCPU Intel Xeon (AVX512-BF16, no AMX; vdpbf16ps takes two cycles), median of 7 runs
//   taken in turn: the prefetch for every pair brings 2 rows to 12.5 ms from 17.7 and 5 rows to
//   16.7 from 23.1, and one row staged takes 12.6-13.4 ms against 15.5-21.7 for the walk (12 MLP
//   gate/up projections [9728, 896] read from memory: 9.9-11.1 against 13.2-18.1).
// - a 2-vCPU Zen 5 guest (AMD family 0x1A; about 90 GB/s for two cores), neither: staging a pair
//   costs more than it saves there (2 rows 2.3x one row's time, 5 rows 2.5x on the whole bf16
//   target), and each thread reading its weight rows straight from memory keeps up with the
//   memory for several rows of x. So the third way (`kStreamingDirect`): up to 8 rows of x that
//   fit in half of L1 meet one weight row at a time (16 accumulators; the lm_head, 5 rows: 1.00x
//   one row's time against 2.3x staged), up to 12 rows within L1 two weight rows at a time in
//   pieces of five (the whole bf16 target, 9 rows: 2.1x one row's time against 2.55x blocked);
//   more rows take the first way (16 rows: 3.4x against 3.65x).
// Zen 5 and later take the third way, earlier AMD CPUs the first, the others the second
// (streaming()).
//
// With more rows of x, or once they no longer fit in L1 (a long verify, a prefill chunk, wide
// layers) four weight rows share each load of x (three x rows each load of a weight row), 64
// weight rows stay in L2 while chunks of x rows that fit L1 pass over them. The order of each
// (weight row, x row) sum is dot_block's in every case.
#include "cpu_kernels.h"

#if HR_X86
#include "rows_avx512.h"

namespace hetero_run_cpu {
namespace {

constexpr int64_t kBlockedAbove = 16 << 10;  // bytes of x: half of L1
// Rows of x one pass of a weight row takes (rows_times_x<T, 1, 4>) when they are not staged (x
// beyond L1); more would read each weight row several times from L1 with few accumulators.
constexpr int64_t kOnePass = 4;

// Staged rows of x: at most 16, and with the staged pair of weight rows within L1's 32 KiB.
constexpr int64_t kStagedRows = 16;
constexpr int64_t kStagedBytes = 32 << 10;
constexpr int64_t kPiece = 5;       // rows of x per dot_block<T, 2, G> (G <= 5)
constexpr int64_t kPairsAhead = 2;  // the pair prefetched into L2 while a pair computes (kStreamingStaged)

// Which way at the top of the file few rows of x stream: the first (kStreamingWalk: one row
// walked, a pair staged with the prefetch only for pairs that take several pieces of x), the
// second (kStreamingStaged: one row staged too, and every pair asking for the pair kPairsAhead
// on) or the third (kStreamingDirect: weight rows read straight from memory).
int streaming() {
  const int forced = dense_streaming();
  if (forced != kStreamingByCpu) return forced;
  return amd_zen5_or_later() ? kStreamingDirect : amd_cpu() ? kStreamingWalk : kStreamingStaged;
}

// The third way's two sizes: rows of x one weight row meets at once, and the most rows two
// weight rows meet in pieces of kPiece (bytes of x: within half of L1, and within L1).
constexpr int64_t kDirectOne = 8;
constexpr int64_t kDirectPairs = 12;

// Blocks for many rows of x: 64 weight rows (kept in L2) against chunks of x rows that fit half
// of L1, four weight rows by four x rows at a time (dot_block_phased).
constexpr int64_t kWeightChunk = 64;

template <typename W>
void prefetch_rows(const W* rows, int64_t count, int64_t row_bytes) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t b = 0; b < count * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Output rows r0 .. r1 - 1 against n rows of x, two weight rows at a time, each pair copied to
// an L1 buffer first, the pair kPairsAhead on asked into L2 for every pair (`every_pair`) or for
// pairs of several pieces (see the top of the file); the pieces split n as evenly as possible
// (9: 5 + 4).
template <typename T>
void staged_rows(const typename T::W* w, int64_t in, const typename T::X* x, int64_t n, int64_t r0, int64_t r1,
                 float* y, int64_t out, bool every_pair) {
  using W = typename T::W;
  const int64_t pair_bytes = 2 * in * static_cast<int64_t>(sizeof(W));
  std::vector<W> storage(2 * in + 64 / sizeof(W));
  W* buf = reinterpret_cast<W*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  const bool prefetch = every_pair || pieces > 1;
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {
    std::memcpy(buf, w + r * in, pair_bytes);
    if (prefetch && r + 2 * kPairsAhead + 2 <= r1) {
      const char* ahead = reinterpret_cast<const char*>(w + (r + 2 * kPairsAhead) * in);
      for (int64_t b = 0; b < pair_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    }
    int64_t i0 = 0;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t g = (n - i0) / (pieces - p);
      const typename T::X* xs = x + i0 * in;
      float* ys = y + i0 * out + r;
      switch (g) {
        case 5: dot_block<T, 2, 5>(buf, in, xs, in, in, nullptr, ys, out); break;
        case 4: dot_block<T, 2, 4>(buf, in, xs, in, in, nullptr, ys, out); break;
        case 3: dot_block<T, 2, 3>(buf, in, xs, in, in, nullptr, ys, out); break;
        case 2: dot_block<T, 2, 2>(buf, in, xs, in, in, nullptr, ys, out); break;
        default: dot_block<T, 2, 1>(buf, in, xs, in, in, nullptr, ys, out); break;
      }
      i0 += g;
    }
  }
  for (; r < r1; ++r) rows_times_x<T, 1, 4>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
}

template <typename T>
void dense_linear_impl(const typename T::X* x, int64_t n, int64_t in, const typename T::W* w, int64_t out, float* y) {
  const int64_t x_row = in * static_cast<int64_t>(sizeof(typename T::X));
  const int64_t grain = grain_rows(in * static_cast<int64_t>(sizeof(typename T::W)));
  const bool blocked = n > kOnePass || (n > 1 && n * x_row > kBlockedAbove);
  const int64_t x_chunk = std::max<int64_t>(4, (512 << 10) / x_row / 4 * 4);
  const int64_t pair_bytes = 2 * in * static_cast<int64_t>(sizeof(typename T::W));
  const int way = streaming();  // read once per call, not per thread
  const bool every_pair = way == kStreamingStaged;
  const bool direct_one = way == kStreamingDirect && n <= kDirectOne && n * x_row <= kBlockedAbove;
  const bool direct_pairs = way == kStreamingDirect && !direct_one && n <= kDirectPairs && n * x_row <= 2 * kBlockedAbove;
  const bool staged = !direct_one && !direct_pairs && n >= 1 && (n > 1 || every_pair) && n <= kStagedRows &&
                      n * x_row + pair_bytes <= kStagedBytes;
  at::parallel_for(0, out, grain, [&](int64_t r0, int64_t r1) {
    if (direct_one) {
      for (int64_t r = r0; r < r1; ++r) rows_times_x<T, 1, kDirectOne>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
      return;
    }
    if (direct_pairs) {
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) rows_times_x<T, 2, kPiece>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
      for (; r < r1; ++r) rows_times_x<T, 1, kPiece>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
      return;
    }
    if (staged) return staged_rows<T>(w, in, x, n, r0, r1, y, out, every_pair);
    if (!blocked) {
      for (int64_t r = r0; r < r1; ++r) rows_times_x<T, 1, kOnePass>(w + r * in, in, x, in, n, in, r, nullptr, y, out);
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
