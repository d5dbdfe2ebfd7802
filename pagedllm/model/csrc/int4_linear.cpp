// x @ W.T for GGUF's 4-bit weights (Q4_0, Q4_1) as stored: w = q * d + m, q in 0..15, one d and m per 32 inputs.
// A decode step of a few rows is bound by reading the weights, and 4 bits (plus d, m) are a third of bf16's bytes.
//
// Each group's nibbles become exact bf16 integers (a 16-entry table lookup), their products with the bf16 rows of x
// accumulate in fp32 (AVX512-BF16 dot products), and d and m apply once per group:
//   sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k.
// d and m stay the file's fp16 values, so the weights are exactly the file's; only x is bf16 and the output rounds
// to bf16 once. Rows run in blocks of up to 8, each block's sums in registers over all of K: kept in memory between
// groups, as before 2026-12-02, each group's loads of them waited on the previous group's stores, and 1-8 rows took
// 1.2-2.2x as long (AMD EPYC Zen 4, docs/performance.md). Each block unpacks the nibbles again: 0.8-1.1x the old
// time at 9-64 rows, where bf16_gemm takes the routes anyway.
//
// Layout (Int4Weight packs it): output rows in tiles of 16, inputs in groups of 32, nibble pairs (p, p+1) together:
//   packed [N/16, K/32, 8, 32] uint8: byte 2i + j of [t, g, pp] = q[16t + i, 32g + 4pp + j]
//                                     | q[16t + i, 32g + 4pp + 2 + j] << 4   (i < 16, j < 2)
//   scales, mins [N/16, K/32, 16] fp16: d and m of output row 16t + i in group g.
// so that one 32-byte load gives two k-pairs of 16 rows in the lane order of _mm512_dpbf16_ps.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_args.h"

namespace {

constexpr int64_t kTile = 16, kGroup = int4_args::kGroup, kRows = 8;

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
constexpr bool kSupported = true;

// The 32 bytes of nibble pairs pp as bf16 integers: k-pairs 2pp (low nibbles) and 2pp + 1 (high).
inline void unpack_pair(const uint8_t* bytes, __m512i lut, __m512i low4, __m512bh& lo, __m512bh& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, low4), lut);
  hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
}

inline __m512 group_scale(const at::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// R <= kRows rows of x against one tile: a[r] += d * (x_r . q) + m * sum(x_r over the group) for each group, the sums
// in registers over all of K, each k-pair's weights unpacked as they are used (so that 8 rows' sums fit). C partial
// dot products per row (C * R independent chains) hide the dot product's latency.
template <int R>
void tile_block(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const at::BFloat16* x,
                const float* xsum, int64_t K, int64_t G, __m512i lut, __m512i low4, float* acc) {
  constexpr int C = R <= 2 ? 4 : 2;
  __m512 a[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = packed + g * 8 * 32;
    const at::BFloat16* xg = x + g * kGroup;
    __m512 dot[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int pp = 0; pp < 8; ++pp) {
      __m512bh w0, w1;
      unpack_pair(pg + pp * 32, lut, low4, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        uint32_t p0, p1;
        std::memcpy(&p0, xg + r * K + 4 * pp, 4);
        std::memcpy(&p1, xg + r * K + 4 * pp + 2, 4);
        dot[r][2 * pp % C] = _mm512_dpbf16_ps(dot[r][2 * pp % C], w0, (__m512bh)_mm512_set1_epi32(p0));
        dot[r][(2 * pp + 1) % C] = _mm512_dpbf16_ps(dot[r][(2 * pp + 1) % C], w1, (__m512bh)_mm512_set1_epi32(p1));
      }
    }
    const __m512 d = group_scale(scales + g * kTile), m = group_scale(mins + g * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 sum = dot[r][0];
#pragma GCC unroll 4
      for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, dot[r][c]);
      a[r] = _mm512_fmadd_ps(sum, d, a[r]);
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G + g]), m, a[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kTile, a[r]);
}

// All M rows of x against one tile, kRows at a time (each block unpacks the tile's nibbles again).
void tile_rows(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const at::BFloat16* x,
               const float* xsum, int64_t M, int64_t K, int64_t G, float* acc) {
  // bf16 bit patterns of 0..15, indexed by a nibble
  alignas(64) int16_t table[32] = {0};
  for (int v = 0; v < 16; ++v) {
    const float f = static_cast<float>(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table[v] = static_cast<int16_t>(bits >> 16);
  }
  const __m512i lut = _mm512_load_si512(table);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t r = 0; r < M; r += kRows) {
    const at::BFloat16* xr = x + r * K;
    const float* sr = xsum + r * G;
    float* ar = acc + r * kTile;
    switch (std::min(M - r, kRows)) {
      case 1: tile_block<1>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 2: tile_block<2>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 3: tile_block<3>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 4: tile_block<4>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 5: tile_block<5>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 6: tile_block<6>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      case 7: tile_block<7>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
      default: tile_block<kRows>(packed, scales, mins, xr, sr, K, G, lut, low4, ar); break;
    }
  }
}

void store_tile(const float* acc, at::BFloat16* out, int64_t M, int64_t N) {
  for (int64_t r = 0; r < M; ++r) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * kTile));  // round to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N), (__m256i)v);
  }
}
#else
constexpr bool kSupported = false;
#endif

}  // namespace

bool int4_linear_supported() { return kSupported; }

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(kSupported, "int4_linear needs AVX512-BF16 (this build has no such instructions)");
  const int4_args::Dims dims = int4_args::check(x, at::kBFloat16, "bfloat16", packed, {8, 32},
                                                "[N/16, K/32, 8, 32]", scales, mins, kTile);
  const int64_t T = dims.T, G = dims.G, M = dims.M, K = dims.K, N = dims.N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  std::vector<float> xsum(M * G);  // each row's sum over each group, for the m term
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = 0; k < kGroup; ++k) s += static_cast<float>(xp[r * K + g * kGroup + k]);
      xsum[r * G + g] = s;
    }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(M * kTile);
    for (int64_t t = t0; t < t1; ++t) {
      tile_rows(pk + t * G * 8 * 32, sc + t * G * kTile, mn + t * G * kTile, xp, xsum.data(), M, K, G, acc.data());
      store_tile(acc.data(), op + t * kTile, M, N);
    }
  });
#endif
  return out;
}
