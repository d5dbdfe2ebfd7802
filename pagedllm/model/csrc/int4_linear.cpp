// x @ W.T for GGUF's 4-bit weights (Q4_0, Q4_1) as stored: w = q * d + m, q in 0..15, one d and m per 32 inputs.
// A decode step of a few rows is bound by reading the weights, and 4 bits (plus d, m) are a third of bf16's bytes.
//
// Each group's nibbles become exact bf16 integers (a 16-entry table lookup), their products with the bf16 rows of x
// accumulate in fp32 (AVX512-BF16 dot products), and d and m apply once per group:
//   sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k.
// d and m stay the file's fp16 values, so the weights are exactly the file's; only x is bf16 and the output rounds
// to bf16 once. A group's nibbles are unpacked once and used for every row of x.
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

#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_args.h"

namespace {

constexpr int64_t kTile = 16, kGroup = int4_args::kGroup, kRowsPerBlock = 4;

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
constexpr bool kSupported = true;

// R rows of x against one tile's group of dequantized weights w[16] (bf16 integers, one k-pair each):
// acc[r] += d * (x_r . q) + m * sum(x_r over the group). C partial sums per row (C * R independent chains) hide the
// dot product's latency.
template <int R>
inline void rows_block(const __m512i* w, __m512 d, __m512 m, const at::BFloat16* x, int64_t K, const float* xsum,
                       int64_t G, float* acc) {
  constexpr int C = R <= 2 ? 4 : 2;
  __m512 dot[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    const __m512bh wp = (__m512bh)w[p];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, 4);
      dot[r][p % C] = _mm512_dpbf16_ps(dot[r][p % C], wp, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512 a = _mm512_loadu_ps(acc + r * kTile);
    __m512 sum = dot[r][0];
#pragma GCC unroll 4
    for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, dot[r][c]);
    a = _mm512_fmadd_ps(sum, d, a);
    a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * G]), m, a);
    _mm512_storeu_ps(acc + r * kTile, a);
  }
}

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
  std::memset(acc, 0, sizeof(float) * M * kTile);
  __m512i w[16];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = packed + g * 8 * 32;
#pragma GCC unroll 8
    for (int pp = 0; pp < 8; ++pp) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + pp * 32)));
      w[2 * pp] = _mm512_permutexvar_epi16(_mm512_and_si512(v, low4), lut);
      w[2 * pp + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * kTile)));
    const at::BFloat16* xg = x + g * kGroup;
    int64_t r = 0;
    for (; r + kRowsPerBlock <= M; r += kRowsPerBlock)
      rows_block<kRowsPerBlock>(w, d, m, xg + r * K, K, xsum + r * G + g, G, acc + r * kTile);
    switch (M - r) {
      case 3: rows_block<3>(w, d, m, xg + r * K, K, xsum + r * G + g, G, acc + r * kTile); break;
      case 2: rows_block<2>(w, d, m, xg + r * K, K, xsum + r * G + g, G, acc + r * kTile); break;
      case 1: rows_block<1>(w, d, m, xg + r * K, K, xsum + r * G + g, G, acc + r * kTile); break;
      default: break;
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
