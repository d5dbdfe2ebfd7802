// x @ W.T in bf16 for the layer matmuls of decode-sized steps (tens of rows), where oneDNN's packed matmul spends
// ~12% of its time at 64 rows on the first reads of each weight from memory (docs/scripts/linear_cold_weights.py):
// a decode step reads every layer's weights once.
// Here the weight is packed once at load into panels of 64 output columns that are each one contiguous stream.
// Threads claim panels as they go (claimed_for.h), so a thread's next panel is not the adjacent one and the hardware
// prefetchers cannot run into it: the thread prefetches it itself, into L2, a slice during each pass of rows over
// the current panel (NextPanel), so that memory and arithmetic overlap. Before, only its first 8 KB were fetched
// ahead and the first pass over each panel waited on memory: the kernel table (`pagedllm bench kernels`) timed it
// 3-24% slower at 16-128 rows on Zen 5, level at 256.
//
// Layout (Bf16Weight.pack): packed [P, K/2, 4, 32] bf16: element 2i + j of [p, kp, c] = W[64p + 16c + i, 2kp + j]
// (i < 16, j < 2): one 64-byte load is one tile's k-pair in vdpbf16ps's lane order.
//
// Register blocking: 6 rows x 4 tiles of fp32 sums (24 zmm), the 4 weight vectors and a row's activation pair: the
// inner loop is 4 weight loads, 6 broadcasts and 24 vdpbf16ps. Each pair is broadcast once into a register, not
// from memory in every vdpbf16ps ({1to16}, 24 loads): with 28 loads for 24 products the loads were the bound
// (~700 against ~830 GFLOP/s at 64-90 rows on Zen 5, docs/scripts/gemm_kernels_speed.py). Inline
// assembly, as int8_gemm.cpp does for vpdpbusd: GCC 12 copies the accumulator around every _mm512_dpbf16_ps.
// Sums are fp32 over all of K (vdpbf16ps: products of bf16 exact in fp32, round to nearest even), rounded to bf16
// once into the output.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "claimed_for.h"

namespace {

constexpr int64_t kTile = 16, kTiles = 4, kPanel = kTile * kTiles, kRows = 6;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSupported = true;

// Cache lines of one slice, prefetched a few per step of a loop of `steps` (`step()`), not in one burst.
class SlicePrefetch {
 public:
  SlicePrefetch(const char* from, int64_t lines, int64_t steps)
      : p_(from), left_(lines), per_(steps > 0 ? (lines + steps - 1) / steps : lines) {}

  inline void step() {
    for (int64_t j = 0; j < per_ && left_ > 0; ++j, --left_, p_ += 64) _mm_prefetch(p_, _MM_HINT_T1);
  }

 private:
  const char* p_;
  int64_t left_, per_;
};

// The next panel (`bytes` long, or none: nullptr) cut into `passes` slices: slice j for pass j over the current one,
// prefetched over a loop of `steps`.
struct NextPanel {
  const char* base;
  int64_t lines, passes;

  NextPanel(const void* next, int64_t bytes, int64_t passes)
      : base(static_cast<const char*>(next)), lines(next != nullptr ? bytes / 64 : 0),
        passes(passes > 0 ? passes : 1) {}

  SlicePrefetch slice(int64_t j, int64_t steps) const {
    const int64_t lo = j * lines / passes, hi = (j + 1) * lines / passes;
    return SlicePrefetch(base + lo * 64, hi - lo, steps);
  }
};

inline void dpbf16(__m512& acc, __m512 w, __m512i x2) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x2));
}

// R rows of x (row stride K) against one panel: sums in registers over all of K, then rounded into out; `pf`, a
// slice of the thread's next panel, streams into L2 meanwhile.
template <int R>
inline void panel_rows(const uint16_t* panel, const uint16_t* x, int64_t K, at::BFloat16* out, int64_t ldo,
                       SlicePrefetch pf) {
  __m512 acc[R][kTiles];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kTiles; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t KP = K / 2;
  for (int64_t kp = 0; kp < KP; ++kp) {
    pf.step();
    const uint16_t* wk = panel + kp * kPanel * 2;
    __m512 w[kTiles];
#pragma GCC unroll 4
    for (int c = 0; c < kTiles; ++c) w[c] = _mm512_loadu_ps(wk + c * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * kp, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c) dpbf16(acc[r][c], w[c], xb);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kTiles; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + c * kTile),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

// The last n < kRows rows of a block.
template <int R>
inline void panel_tail(int64_t n, const uint16_t* panel, const uint16_t* x, int64_t K, at::BFloat16* out,
                       int64_t ldo, SlicePrefetch pf) {
  if constexpr (R >= 1) {
    if (n == R) return panel_rows<R>(panel, x, K, out, ldo, pf);
    panel_tail<R - 1>(n, panel, x, K, out, ldo, pf);
  }
}
#else
constexpr bool kSupported = false;
#endif

}  // namespace

bool bf16_gemm_supported() { return kSupported; }

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(kSupported, "bf16_gemm needs AVX512-BF16 (this build has no such instructions)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bfloat16 CPU matrix [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(2) == kTiles && packed.size(3) == 32,
              "packed must be a contiguous bfloat16 [N/64, K/2, 4, 32]");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = P * kPanel;
  TORCH_CHECK(packed.size(1) * 2 == K, "x has ", K, " columns, the weight ", packed.size(1) * 2);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* pk = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t panel_elems = K * kPanel, panel_bytes = panel_elems * 2;
  // Blocks of rows only when there are too few panels to share among the threads (each block reads its panel again,
  // from the cache the first one left it in).
  const int64_t threads = at::get_num_threads();
  int64_t blocks = 1;
  while (blocks * P < 4 * threads && M / (2 * blocks) >= kRows) blocks *= 2;
  const int64_t row_block = (M + blocks - 1) / blocks;
  for_each_claimed(blocks * P, 1, [&](int64_t i, int64_t after) {
    const int64_t p = i / blocks, rb = i % blocks;
    const uint16_t* panel = pk + p * panel_elems;
    const int64_t r0 = rb * row_block, r1 = std::min(M, (rb + 1) * row_block);
    const bool ahead = after >= 0 && after / blocks != p;  // after: claimed before this item started
    const NextPanel next(ahead ? pk + after / blocks * panel_elems : nullptr, panel_bytes,
                         (r1 - r0 + kRows - 1) / kRows);
    int64_t r = r0, j = 0;
    for (; r + kRows <= r1; r += kRows, ++j)
      panel_rows<kRows>(panel, xp + r * K, K, op + r * N + p * kPanel, N, next.slice(j, K / 2));
    if (r < r1) panel_tail<kRows - 1>(r1 - r, panel, xp + r * K, K, op + r * N + p * kPanel, N, next.slice(j, K / 2));
  });
#endif
  return out;
}
