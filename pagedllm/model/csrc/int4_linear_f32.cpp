// x @ W.T in fp32 for GGUF's 4-bit weights (Q4_0, Q4_1): w = q * d + m, q in 0..15, one fp16 d and m per 32 inputs.
// For CPUs without AVX512-BF16 (int4_linear.cpp's kernel), where an fp32 model's layers would otherwise run oneDNN's
// fp32 matmul on the dequantized weights, reading 8x the bytes of the 4-bit form.
//
// Each weight is dequantized as fma(float(q), d, m) in fp32: d * q is exact in fp32 (11 + 4 significant bits), so
// this is the one rounding of numpy's (d * q) + m, which the loader's gguf.quants.dequantize computes (for Q4_0,
// d * (q - 8) is exact, m = -8 d): the weights are bit for bit the loader's fp32 ones (up to the sign of a zero,
// which no fp32 sum starting from +0 can show). Products and sums are fp32, as in any fp32 matmul.
//
// Two schedules, both over output tiles of 64 columns, split between threads:
//   - up to kNarrowRows rows (bound by reading the weights): half tiles of 32 columns, every row's accumulators in
//     registers over all of K, each k's weights dequantized in registers and used for every row, the weights of
//     the group kPrefetchGroups ahead prefetched;
//   - more rows (bound by FMAs): a tile's whole panel (K inputs x 64 outputs) is dequantized once per call into a
//     per-thread buffer the L2 holds, then blocks of 6 rows run 6 x 4 zmm accumulators (24 FMAs per k) over all
//     of K; the threads share half tiles, so a tile that does not share evenly runs as two halves (6 x 2).
// On CPUs with AVX2 and FMA but no AVX-512 (int4_f32_avx2.h) the same schedules run on 8-float vectors, in blocks
// that fit 16 registers, with the same arithmetic: the same sums, bit for bit.
//
// Layout (Int4Weight packs it): output columns in tiles of 64, each two halves of 32; inputs in groups of 32:
//   packed [N/64, K/32, 2, 32, 16] uint8: byte b of [t, g, h, k] = q[64t + 32h + b, 32g + k]
//                                                                | q[64t + 32h + 16 + b, 32g + k] << 4
//   scales, mins [N/64, K/32, 64] fp16: d and m of output column 64t + c in group g.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "int4_args.h"

namespace {

constexpr int64_t kTile = 64, kHalf = 32, kGroup = int4_args::kGroup, kNarrowRows = 8, kBlockRows = 6;
constexpr int64_t kHalfBytes = kGroup * 16;  // one half tile's nibbles for one group
constexpr int64_t kPrefetchGroups = 3;  // how far ahead narrow_half fetches (2-4 measured alike, 1 and 6 less)

#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))) && defined(__F16C__)
#define PAGEDLLM_INT4_F32 1
// A later group's nibbles, scales and mins of half h, fetched while this one is computed. A few rows leave the
// loads idle between FMAs and the hardware prefetcher does not run far enough ahead on its own: with it, the model's
// 1-row matmuls in a step's order read their 4-bit weights 1.2-1.3x faster (docs/performance-log.md, 2026-11-27).
inline void prefetch_group(const uint8_t* p, const at::Half* sc, const at::Half* mn, int64_t g, int64_t h) {
#pragma GCC unroll 8
  for (int64_t line = 0; line < kHalfBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc + g * kTile + h * kHalf), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mn + g * kTile + h * kHalf), _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__) && defined(__F16C__)
constexpr bool kSupported = true;

inline __m512 half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One k of a half tile: 32 weights (columns b and 16 + b of 16 bytes) as fma(q, d, m).
struct HalfGroup {
  __m512 d0, d1, m0, m1;
  HalfGroup(const at::Half* sc, const at::Half* mn) : d0(half16(sc)), d1(half16(sc + 16)), m0(half16(mn)),
                                                      m1(half16(mn + 16)) {}
  inline void weights(const uint8_t* p, __m512& w0, __m512& w1) const {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), d0, m0);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1);
  }
};

// R rows (R <= kNarrowRows) x one half tile over all of K. Every output is one chain of FMAs over k in order, as in
// wide_rows: a row gives the same sums alone as in any batch.
template <int R>
void narrow_half(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t h, const float* x,
                 int64_t K, int64_t G, float* out, int64_t N) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const HalfGroup hg(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf);
    const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
    const float* xg = x + g * kGroup;
    if (g + kPrefetchGroups < G) prefetch_group(p + kPrefetchGroups * 2 * kHalfBytes, sc, mn, g + kPrefetchGroups, h);
#pragma GCC unroll 8
    for (int k = 0; k < kGroup; ++k) {
      __m512 w0, w1;
      hg.weights(p + 16 * k, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xg[r * K + k]);
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N + h * kHalf, acc[r][0]);
    _mm512_storeu_ps(out + r * N + h * kHalf + 16, acc[r][1]);
  }
}

// Halves [h0, h1) of a tile's weights as fp32 [K][64 columns] in `w` (the panel stays in L2 while every block of
// rows reads it).
void dequantize_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t G, int64_t h0,
                     int64_t h1, float* w) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = h0; h < h1; ++h) {
      const HalfGroup hg(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf);
      const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
      float* wg = w + g * kGroup * kTile + h * kHalf;
#pragma GCC unroll 4
      for (int k = 0; k < kGroup; ++k) {
        __m512 w0, w1;
        hg.weights(p + 16 * k, w0, w1);
        _mm512_store_ps(wg + k * kTile, w0);
        _mm512_store_ps(wg + k * kTile + 16, w1);
      }
    }
}

// R rows (R <= kBlockRows) x C vectors of 16 columns of a panel (4: a tile, 2: a half): out[r, 0:16C] = x[r] @ w,
// accumulators in registers over all of K.
template <int R, int C>
void wide_rows(const float* w, const float* x, int64_t K, float* out, int64_t N) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wk[c] = _mm512_load_ps(w + k * kTile + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wk[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * N + 16 * c, acc[r][c]);
}

using WideRows = void (*)(const float*, const float*, int64_t, float*, int64_t);
constexpr WideRows kWideRows[2][kBlockRows + 1] = {  // [halves - 1][rows]
    {nullptr, wide_rows<1, 2>, wide_rows<2, 2>, wide_rows<3, 2>, wide_rows<4, 2>, wide_rows<5, 2>, wide_rows<6, 2>},
    {nullptr, wide_rows<1, 4>, wide_rows<2, 4>, wide_rows<3, 4>, wide_rows<4, 4>, wide_rows<5, 4>, wide_rows<6, 4>}};
using NarrowHalf = void (*)(const uint8_t*, const at::Half*, const at::Half*, int64_t, const float*, int64_t,
                            int64_t, float*, int64_t);
constexpr NarrowHalf kNarrowHalf[kNarrowRows + 1] = {nullptr, narrow_half<1>, narrow_half<2>, narrow_half<3>,
                                                     narrow_half<4>, narrow_half<5>, narrow_half<6>, narrow_half<7>,
                                                     narrow_half<8>};

// M rows (M <= kNarrowRows) x half h of a tile.
void narrow_rows(int64_t M, const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t h,
                 const float* x, int64_t K, int64_t G, float* out, int64_t N) {
  kNarrowHalf[M](packed, sc, mn, h, x, K, G, out, N);
}

// All M rows of x against halves [h0, h1) of a tile (`out` at its first column), through its dequantized panel.
void wide_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, const float* x, int64_t K, int64_t G,
               int64_t h0, int64_t h1, int64_t M, float* out, int64_t N, float* w) {
  dequantize_tile(packed, sc, mn, G, h0, h1, w);
  for (int64_t r = 0; r < M; r += kBlockRows)
    kWideRows[h1 - h0 - 1][std::min(kBlockRows, M - r)](w + h0 * kHalf, x + r * K, K, out + r * N + h0 * kHalf, N);
}
#elif defined(PAGEDLLM_INT4_F32)
constexpr bool kSupported = true;
#include "int4_f32_avx2.h"
#else
constexpr bool kSupported = false;
#endif

}  // namespace

bool int4_linear_f32_supported() { return kSupported; }

at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins) {
  TORCH_CHECK(kSupported, "int4_linear_f32 needs AVX-512F, or AVX2 and FMA, and F16C (this build has none)");
  const int4_args::Dims dims = int4_args::check(x, at::kFloat, "float32", packed, {2, kGroup, 16},
                                                "[N/64, K/32, 2, 32, 16]", scales, mins, kTile);
  const int64_t T = dims.T, G = dims.G, M = dims.M, K = dims.K, N = dims.N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(PAGEDLLM_INT4_F32)
  const float* xp = x.data_ptr<float>();
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  const int64_t tile_bytes = G * 2 * kHalfBytes;
  if (M <= kNarrowRows) {  // half tiles: twice the pieces to share between threads
    at::parallel_for(0, 2 * T, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / 2;
        narrow_rows(M, pk + t * tile_bytes, sc + t * G * kTile, mn + t * G * kTile, i % 2, xp, K, G, op + t * kTile,
                    N);
      }
    });
    return out;
  }
  // The threads share half tiles, each running its share as whole tiles but for a lone half at either end: 9 tiles
  // (576 columns) give each of 2 threads 4.5, not 5 and 4 (splitting the odd tile by rows instead dequantized it
  // twice: 9-16% slower at 32-96 rows).
  at::parallel_for(0, 2 * T, 1, [&](int64_t i0, int64_t i1) {
    // kept per thread: a fresh 147-393 KB buffer per call could come from mmap, and fault its pages in every time
    thread_local std::vector<float> panel;
    if (panel.size() < static_cast<size_t>(K * kTile + 16)) panel.resize(K * kTile + 16);
    float* w = panel.data() + (16 - reinterpret_cast<uintptr_t>(panel.data()) / 4 % 16) % 16;  // 64-byte aligned
    for (int64_t i = i0; i < i1;) {
      const int64_t t = i / 2, h0 = i % 2, h1 = std::min<int64_t>(2, h0 + i1 - i);  // halves [h0, h1) of tile t
      wide_tile(pk + t * tile_bytes, sc + t * G * kTile, mn + t * G * kTile, xp, K, G, h0, h1, M, op + t * kTile, N,
                w);
      i += h1 - h0;
    }
  });
#endif
  return out;
}
