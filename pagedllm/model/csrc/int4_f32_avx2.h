// int4_linear_f32.cpp's two schedules on CPUs with AVX2 and FMA but no AVX-512 (desktop and laptop CPUs, AMD EPYC
// before Zen 4), included there inside its anonymous namespace. The same layout and the same arithmetic for every
// output (each weight fma(float(q), d, m), then one chain of FMAs over k in order), so the same sums bit for bit as
// the AVX-512 schedules; 8-float vectors and 16 registers instead of 16 and 32, so the blocks are narrower:
//   - a half tile's 32 columns run as two quarters of 16: bytes 0-7 of each k hold columns 0-7 (low nibbles) and
//     16-23 (high), bytes 8-15 columns 8-15 and 24-31; at most kQuarterRows rows a pass (2 accumulators each, beside
//     a quarter's scales and mins and its two weight vectors); 1 or 2 rows run both quarters in one pass (4
//     accumulators a row: with 2, a row's FMA chains left the FMA units idle);
//   - the wide schedule's panel (the same [K][64] fp32) is read 16 columns at a time by blocks of 6 rows, 6 x 2
//     accumulators (12 FMAs per k), the usual AVX2 GEMM block.
#pragma once

constexpr int64_t kQuarterRows = 4;

inline __m256 half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One k of quarter j of a half tile: 16 weights (columns 8j.. and 16 + 8j.. of the half) as fma(q, d, m).
struct QuarterGroup {
  __m256 d0, d1, m0, m1;
  QuarterGroup(const at::Half* sc, const at::Half* mn, int64_t j)
      : d0(half8(sc + 8 * j)), d1(half8(sc + 16 + 8 * j)), m0(half8(mn + 8 * j)), m1(half8(mn + 16 + 8 * j)) {}
  inline void weights(const uint8_t* p, __m256& w0, __m256& w1) const {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F))), d0, m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1);
  }
};

// R rows (R <= kQuarterRows) x quarter j of half h over all of K: each k's 16 weights dequantized once for the R rows.
template <int R>
void narrow_quarter(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t h, int64_t j,
                    const float* x, int64_t K, int64_t G, float* out, int64_t N) {
  __m256 acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const QuarterGroup qg(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf, j);
    const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
    const float* xg = x + g * kGroup;
    if (j == 0 && g + kPrefetchGroups < G)  // the second quarter finds the half's bytes in the cache
      prefetch_group(p + kPrefetchGroups * 2 * kHalfBytes, sc, mn, g + kPrefetchGroups, h);
#pragma GCC unroll 8
    for (int k = 0; k < kGroup; ++k) {
      __m256 w0, w1;
      qg.weights(p + 16 * k + 8 * j, w0, w1);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(xg[r * K + k]);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * N + h * kHalf + 8 * j, acc[r][0]);
    _mm256_storeu_ps(out + r * N + h * kHalf + 16 + 8 * j, acc[r][1]);
  }
}

using NarrowQuarter = void (*)(const uint8_t*, const at::Half*, const at::Half*, int64_t, int64_t, const float*,
                               int64_t, int64_t, float*, int64_t);
constexpr NarrowQuarter kNarrowQuarter[kQuarterRows + 1] = {nullptr, narrow_quarter<1>, narrow_quarter<2>,
                                                            narrow_quarter<3>, narrow_quarter<4>};

// R rows (R <= kHalfRows) x half h of a tile over all of K, both quarters at once: 4 accumulators a row, where a
// quarter alone keeps 2, each waiting on its own FMA chain over k (the chains are the same, so are the sums).
constexpr int64_t kHalfRows = 2;

template <int R>
void narrow_half(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t h, const float* x,
                 int64_t K, int64_t G, float* out, int64_t N) {
  __m256 acc[R][4];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const QuarterGroup q0(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf, 0);
    const QuarterGroup q1(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf, 1);
    const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
    const float* xg = x + g * kGroup;
    if (g + kPrefetchGroups < G)
      prefetch_group(p + kPrefetchGroups * 2 * kHalfBytes, sc, mn, g + kPrefetchGroups, h);
#pragma GCC unroll 4
    for (int k = 0; k < kGroup; ++k) {
      __m256 w[4];
      q0.weights(p + 16 * k, w[0], w[1]);
      q1.weights(p + 16 * k + 8, w[2], w[3]);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(xg[r * K + k]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_ps(xb, w[i], acc[r][i]);
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {  // quarter j's accumulators hold columns 8j.. and 16 + 8j.. of the half
    _mm256_storeu_ps(out + r * N + h * kHalf, acc[r][0]);
    _mm256_storeu_ps(out + r * N + h * kHalf + 16, acc[r][1]);
    _mm256_storeu_ps(out + r * N + h * kHalf + 8, acc[r][2]);
    _mm256_storeu_ps(out + r * N + h * kHalf + 24, acc[r][3]);
  }
}

using NarrowHalf = void (*)(const uint8_t*, const at::Half*, const at::Half*, int64_t, const float*, int64_t, int64_t,
                            float*, int64_t);
constexpr NarrowHalf kNarrowHalf[kHalfRows + 1] = {nullptr, narrow_half<1>, narrow_half<2>};

// M rows (M <= kNarrowRows) x half h of a tile: up to kHalfRows rows both quarters at once, more quarter by quarter,
// kQuarterRows rows at a time.
void narrow_rows(int64_t M, const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t h,
                 const float* x, int64_t K, int64_t G, float* out, int64_t N) {
  if (M <= kHalfRows) return kNarrowHalf[M](packed, sc, mn, h, x, K, G, out, N);
  for (int64_t j = 0; j < 2; ++j)
    for (int64_t r = 0; r < M; r += kQuarterRows)
      kNarrowQuarter[std::min(kQuarterRows, M - r)](packed, sc, mn, h, j, x + r * K, K, G, out + r * N, N);
}

// Halves [h0, h1) of a tile's weights as fp32 [K][64 columns] in `w`, as the AVX-512 schedule lays them out.
void dequantize_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t G, int64_t h0,
                     int64_t h1, float* w) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t j = 0; j < 2; ++j) {
        const QuarterGroup qg(sc + g * kTile + h * kHalf, mn + g * kTile + h * kHalf, j);
        const uint8_t* p = packed + (g * 2 + h) * kHalfBytes + 8 * j;
        float* wg = w + g * kGroup * kTile + h * kHalf;
#pragma GCC unroll 4
        for (int k = 0; k < kGroup; ++k) {
          __m256 w0, w1;
          qg.weights(p + 16 * k, w0, w1);
          _mm256_store_ps(wg + k * kTile + 8 * j, w0);
          _mm256_store_ps(wg + k * kTile + 16 + 8 * j, w1);
        }
      }
}

// R rows (R <= kBlockRows) x 16 columns of a panel: out[r, 0:16] = x[r] @ w, accumulators in registers over all of K.
template <int R>
void wide_rows16(const float* w, const float* x, int64_t K, float* out, int64_t N) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(w + k * kTile), w1 = _mm256_load_ps(w + k * kTile + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r * K + k]);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * N, acc[r][0]);
    _mm256_storeu_ps(out + r * N + 8, acc[r][1]);
  }
}

using WideRows16 = void (*)(const float*, const float*, int64_t, float*, int64_t);
constexpr WideRows16 kWideRows16[kBlockRows + 1] = {nullptr, wide_rows16<1>, wide_rows16<2>, wide_rows16<3>,
                                                    wide_rows16<4>, wide_rows16<5>, wide_rows16<6>};

// All M rows of x against halves [h0, h1) of a tile (`out` at its first column), through its dequantized panel:
// 16 columns at a time (their K x 64 bytes stay in L1 for K up to ~600), every block of rows over them.
void wide_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, const float* x, int64_t K, int64_t G,
               int64_t h0, int64_t h1, int64_t M, float* out, int64_t N, float* w) {
  dequantize_tile(packed, sc, mn, G, h0, h1, w);
  for (int64_t c = h0 * kHalf; c < h1 * kHalf; c += 16)
    for (int64_t r = 0; r < M; r += kBlockRows)
      kWideRows16[std::min(kBlockRows, M - r)](w + c, x + r * K, K, out + r * N + c, N);
}
