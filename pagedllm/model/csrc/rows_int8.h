// attend_rows over an int8 cache on AVX-512: each record's groups of 16 values are widened and scaled in registers
// as they are used, once for all query rows of their kv head, instead of being copied to fp32 rows first and dotted
// one row at a time. Included by paged_attention.cpp after sum_lanes_8.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
constexpr int64_t kMaxInt8Dim = 256;  // head_dims these kernels take (attend_rows converts bigger records first)

// The fp32 (scale, min) of each of a record's D / 16 groups (fp16 pairs after its D values): sm[2g], sm[2g + 1].
__attribute__((always_inline)) inline void record_params(const uint8_t* rec, int64_t D, float* sm) {
  const uint8_t* h = rec + D;
  int64_t i = 0;  // halves converted
  for (; i + 8 <= D / 8; i += 8)
    _mm256_storeu_ps(sm + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * i))));
  for (; i < D / 8; i += 2) {
    uint16_t pair[2];
    std::memcpy(pair, h + 2 * i, sizeof(pair));
    sm[i] = _cvtsh_ss(pair[0]), sm[i + 1] = _cvtsh_ss(pair[1]);
  }
}

// Values 16g .. 16g + 15 of a record: u * scale + min, with smg = its group's (scale, min).
__attribute__((always_inline)) inline __m512 group_values(const uint8_t* rec, int64_t g, const float* smg) {
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * g)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(smg[0]), _mm512_set1_ps(smg[1]));
}

// S[r * C + t] = q_r . k_t for RB fp32 query rows (row stride D) and the 8 records krec[t].
template <int RB>
__attribute__((always_inline)) inline void scores_8_int8(const float* q, const uint8_t* const* krec, int64_t D,
                                                         float* S, int64_t C) {
  float sm[8][kMaxInt8Dim / 8];
  for (int t = 0; t < 8; ++t) record_params(krec[t], D, sm[t]);
  __m512 acc[RB][8];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < 8; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < D / 16; ++g) {
    __m512 qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = _mm512_loadu_ps(q + r * D + 16 * g);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512 k = group_values(krec[t], g, sm[t] + 2 * g);
      for (int r = 0; r < RB; ++r) acc[r][t] = _mm512_fmadd_ps(qv[r], k, acc[r][t]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    __m256 h[8];
    for (int t = 0; t < 8; ++t)
      h[t] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1)));
    _mm256_storeu_ps(S + r * C, sum_lanes_8(h));
  }
}

// scores_8_int8 for `rows` rows (any count) from q and S.
inline void scores_8_int8_rows(const float* q, const uint8_t* const* krec, int64_t D, float* S, int64_t C,
                               int64_t rows) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) scores_8_int8<3>(q + r * D, krec, D, S + r * C, C);
  if (rows - r == 2) scores_8_int8<2>(q + r * D, krec, D, S + r * C, C);
  if (rows - r == 1) scores_8_int8<1>(q + r * D, krec, D, S + r * C, C);
}

// O[r][16 g0 .. 16 (g0 + NG)) = O * alpha[r] + sum_t P[r * C + t] V_t for RB rows (row stride D) over the cn
// records vrec[t], each group widened once for the RB rows.
template <int RB, int NG>
inline void pv_int8(float* O, int64_t D, const float* alpha, const float* P, int64_t C, const uint8_t* const* vrec,
                    int64_t cn, int64_t g0) {
  __m512 acc[RB][NG];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NG; ++j)
      acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + 16 * (g0 + j)), _mm512_set1_ps(alpha[r]));
  for (int64_t t = 0; t < cn; ++t) {
    float sm[kMaxInt8Dim / 8];
    record_params(vrec[t], D, sm);
    __m512 v[NG];
    for (int j = 0; j < NG; ++j) v[j] = group_values(vrec[t], g0 + j, sm + 2 * (g0 + j));
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * C + t]);
      for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_fmadd_ps(p, v[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NG; ++j) _mm512_storeu_ps(O + r * D + 16 * (g0 + j), acc[r][j]);
}

template <int RB>
inline void pv_int8_head(float* O, int64_t D, const float* alpha, const float* P, int64_t C,
                         const uint8_t* const* vrec, int64_t cn) {
  int64_t g = 0;
  for (; g + 4 <= D / 16; g += 4) pv_int8<RB, 4>(O, D, alpha, P, C, vrec, cn, g);
  for (; g < D / 16; ++g) pv_int8<RB, 1>(O, D, alpha, P, C, vrec, cn, g);
}

// pv_int8 over `rows` rows (any count) and the whole head_dim (D % 16 == 0).
inline void pv_int8_rows(float* O, int64_t D, const float* alpha, const float* P, int64_t C,
                         const uint8_t* const* vrec, int64_t cn, int64_t rows) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_int8_head<4>(O + r * D, D, alpha + r, P + r * C, C, vrec, cn);
  switch (rows - r) {
    case 3: pv_int8_head<3>(O + r * D, D, alpha + r, P + r * C, C, vrec, cn); break;
    case 2: pv_int8_head<2>(O + r * D, D, alpha + r, P + r * C, C, vrec, cn); break;
    case 1: pv_int8_head<1>(O + r * D, D, alpha + r, P + r * C, C, vrec, cn); break;
    default: break;
  }
}
#endif
