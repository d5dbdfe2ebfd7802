// attend_tile over a bf16 cache for bf16 queries (AVX512-BF16): vdpbf16ps adds two products at once, half the
// instructions of the fp32 FMA micro-kernels, for the scores (pairs of head_dim values, the keys read in place from
// the cache instead of widened into a buffer first) and for the values' sums (pairs of keys: the probabilities
// rounded to bf16, the values packed in pairs once per chunk). Included by paged_attention.cpp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// 16-bit words 0-15 and 16-31 of a vector interleaved (0, 16, 1, 17, ...): two vectors' 16-bit values as pairs (also
// tile_f16.h's).
inline constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

#if defined(__AVX512BW__)
// Pairs of consecutive rows' 16-bit values: VP[i * D + d] = (row 2i's value d, row 2i + 1's), from load16(t, d), 16 of
// row t's values from d (D % 16 == 0), for cn rows; a missing last row of a pair counts as zero. The bf16 values'
// pairs below and tile_f16.h's fp16 ones.
template <typename Load16>
inline void pack_row_pairs(int64_t cn, int64_t D, uint32_t* VP, Load16&& load16) {
  const __m512i order = _mm512_loadu_si512(kPairOrder);
  for (int64_t t = 0; t < cn; t += 2)
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i b = t + 1 < cn ? load16(t + 1, d) : _mm256_setzero_si256();
      const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(load16(t, d)), b, 1);
      _mm512_storeu_si512(VP + t / 2 * D + d, _mm512_permutexvar_epi16(order, x));
    }
}
#endif

#if defined(__AVX512BF16__)
// ST[t][rows] = mul * sum_d K[t][d] * Q[rows][d] for KT keys and RW vectors of 16 rows. Q2 holds the query rows as
// pairs of bf16 values: Q2[i * Mp + row] = values 2i and 2i + 1 of the row; krow[t]: key t's D bf16 values.
template <int KT, int RW>
inline void qk_micro_bf16(const uint16_t* const* krow, const uint32_t* Q2, int64_t Mp, int64_t D, float mul,
                          float* ST) {
  __m512 acc[KT][RW];
  for (int t = 0; t < KT; ++t)
    for (int r = 0; r < RW; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh qv[RW];
    for (int r = 0; r < RW; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(Q2 + i * Mp + 16 * r);
    for (int t = 0; t < KT; ++t) {
      uint32_t pair;
      std::memcpy(&pair, krow[t] + 2 * i, sizeof(pair));
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
      for (int r = 0; r < RW; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], qv[r], kv);
    }
  }
  const __m512 m = _mm512_set1_ps(mul);
  for (int t = 0; t < KT; ++t)
    for (int r = 0; r < RW; ++r) _mm512_storeu_ps(ST + t * Mp + 16 * r, _mm512_mul_ps(acc[t][r], m));
}

// Query rows of one tile as Q2 pairs (see above): row r = ii * G + j is query tok0 + ii's head head0 + j; rows
// from M to Mp are zero. q: bf16 values, token stride qs0 and head stride qs1 in elements.
inline void pack_query_pairs(const uint16_t* q, int64_t qs0, int64_t qs1, int64_t tok0, int64_t head0, int64_t R,
                             int64_t G, int64_t D, int64_t Mp, uint32_t* Q2) {
  std::memset(Q2, 0, D / 2 * Mp * sizeof(uint32_t));
  for (int64_t ii = 0; ii < R; ++ii)
    for (int64_t j = 0; j < G; ++j) {
      const uint16_t* src = q + (tok0 + ii) * qs0 + (head0 + j) * qs1;
      for (int64_t i = 0; i < D / 2; ++i) std::memcpy(Q2 + i * Mp + ii * G + j, src + 2 * i, sizeof(uint32_t));
    }
}

// Value pairs of a chunk for pv_micro_bf16: VP[i * D + d] = (V[2i][d], V[2i + 1][d]) as bf16 pairs, from the V rows
// vrow[t] (bf16, D % 16 == 0) of the chunk's cn keys; a missing last key of a pair counts as zero.
inline void pack_value_pairs(const uint16_t* const* vrow, int64_t cn, int64_t D, uint32_t* VP) {
  pack_row_pairs(cn, D, VP, [&](int64_t t, int64_t d) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t] + d));
  });
}

// O[r][d0 .. d0 + 16 DV) = O * alpha[r] + sum_t P[r][t] V[t][..] for RB rows r (row stride D), over np key pairs:
// PP[i * Mp + r] the rows' probability pairs (attend_tile.h's tile_softmax_pairs), VP[i * D + d] the value pairs
// (see above).
template <int RB, int DV>
inline void pv_micro_bf16(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp,
                          const uint32_t* VP, int64_t d0, int64_t np) {
  __m512 acc[RB][DV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < DV; ++j)
      acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d0 + 16 * j), _mm512_set1_ps(alpha[r]));
  for (int64_t i = 0; i < np; ++i) {
    __m512bh v[DV];
    for (int j = 0; j < DV; ++j) v[j] = (__m512bh)_mm512_loadu_si512(VP + i * D + d0 + 16 * j);
    for (int r = 0; r < RB; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(PP[i * Mp + r]));
      for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], p, v[j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(O + r * D + d0 + 16 * j, acc[r][j]);
}

// pv_micro_bf16 over `rows` rows from row 0 of O, alpha and PP, and the whole head_dim (D % 16 == 0).
template <int RB>
inline void pv_rows_bf16_rb(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp,
                            const uint32_t* VP, int64_t np) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_micro_bf16<RB, 4>(O, D, alpha, PP, Mp, VP, d0, np);
  for (; d0 < D; d0 += 16) pv_micro_bf16<RB, 1>(O, D, alpha, PP, Mp, VP, d0, np);
}

inline void pv_rows_bf16(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp,
                         const uint32_t* VP, int64_t np, int64_t rows) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows_bf16_rb<4>(O + r * D, D, alpha + r, PP + r, Mp, VP, np);
  switch (rows - r) {
    case 3: pv_rows_bf16_rb<3>(O + r * D, D, alpha + r, PP + r, Mp, VP, np); break;
    case 2: pv_rows_bf16_rb<2>(O + r * D, D, alpha + r, PP + r, Mp, VP, np); break;
    case 1: pv_rows_bf16_rb<1>(O + r * D, D, alpha + r, PP + r, Mp, VP, np); break;
    default: break;
  }
}
#endif
