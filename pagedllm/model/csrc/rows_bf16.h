// attend_rows_bf16's micro-kernels on AVX-512 (scores of 8 keys for a few query rows over bf16 keys read in place,
// the values' sums over bf16 rows widened in registers; attention_avx2.h has their AVX2 twins, which share
// sum_lanes_8 from here). Included by paged_attention.cpp inside its anonymous namespace, after attention_common.h.
#pragma once

#if defined(__AVX2__)
// Lane t of the result = the sum of the 8 lanes of v[t]: 14 shuffles and 7 adds for 8 sums.
__attribute__((always_inline)) inline __m256 sum_lanes_8(const __m256* v) {
  __m256 s[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: lanes 0+2 of v[2i], v[2i+1], then lanes 1+3 of both
    s[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit half: the half's sums of v[4i .. 4i+3]
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#endif

#if defined(__AVX512F__)
// attend_rows_bf16's fp32 queries: floats per head_dim value as laid out for scores_8 below, and the block of values
// whose even ones, then odd ones, its value sums hold (pv_bf16); attention_avx2.h has its own.
constexpr int64_t kF32QueryWidth = 2;
constexpr int64_t kPairBlock = 32;

// A query row (D % 16 == 0) times mul in scores_8's order: per 16 values, the 8 even ones twice, then the 8 odd ones
// twice.
inline void layout_f32_query(const float* src, float mul, int64_t D, float* dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + j), m);
    _mm512_storeu_ps(dst + 2 * j, _mm512_permutexvar_ps(even, x));
    _mm512_storeu_ps(dst + 2 * j + 16, _mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_set1_epi32(1)), x));
  }
}

#if defined(__AVX512BF16__)
// S[r * C + t] = mul * (q_r . k_t) for RB query rows (bf16, row stride D) and 8 keys, D = 32 * DW bf16 values
// (DW = 0: D given at run time). Each 16-value piece of a key is loaded once for the RB rows; vdpbf16ps on 256-bit
// vectors leaves 8 lanes per score to sum, half of what 512-bit ones would.
template <int DW, int RB>
__attribute__((always_inline)) inline void scores_8(const uint16_t* q, const uint16_t* const* krow, int64_t D_,
                                                    float mul, float* S, int64_t C) {
  const int64_t D = DW > 0 ? 32 * DW : D_;
  __m256 acc[RB][8];
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t)
    for (int r = 0; r < RB; ++r) acc[r][t] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < D; j += 16) {
    __m256bh qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * D + j));
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256bh kv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[t] + j));
      for (int r = 0; r < RB; ++r) acc[r][t] = _mm256_dpbf16_ps(acc[r][t], qv[r], kv);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(S + r * C, _mm256_mul_ps(sum_lanes_8(acc[r]), _mm256_set1_ps(mul)));
}
#endif

// The same for RB fp32 query rows, already scaled and laid out as 32 floats per 16 values of D: their 8 even values
// twice, then their 8 odd ones twice. Keys go in pairs, 16 values of each in one half of a vector, widened in
// registers (a bf16 is the top half of an fp32: a shift gives the even values, a mask the odd ones) and dotted with
// the rows by fp32 FMA; each pair's two sets of 8 partial sums then take 3 shuffle-and-add steps (plus one
// permutation per two rows) to become the scores, a third of what reducing each key's own 16 lanes costs.
template <int DW, int RB>
__attribute__((always_inline)) inline void scores_8(const float* q, const uint16_t* const* krow, int64_t D_,
                                                    float* S, int64_t C) {
  const int64_t D = DW > 0 ? 32 * DW : D_;
  const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < D; j += 16) {
    __m512 qe[RB], qo[RB];
    for (int r = 0; r < RB; ++r) {
      qe[r] = _mm512_loadu_ps(q + r * 2 * D + 2 * j);
      qo[r] = _mm512_loadu_ps(q + r * 2 * D + 2 * j + 16);
    }
    for (int p = 0; p < 4; ++p) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[2 * p] + j));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[2 * p + 1] + j));
      const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
      for (int r = 0; r < RB; ++r) acc[r][p] = _mm512_fmadd_ps(qo[r], ko, _mm512_fmadd_ps(qe[r], ke, acc[r][p]));
    }
  }
  __m512 h[RB];
  for (int r = 0; r < RB; ++r) {  // acc[r][p]: 8 partial sums of key 2p, then 8 of key 2p + 1
    // 128-bit lane i: 4 partial sums of key i (a) or 4 + i (b)
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0x88),
                                   _mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0xDD));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0x88),
                                   _mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0xDD));
    h[r] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));  // 2 of key i, 2 of 4 + i
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int r = 0; r < RB; r += 2) {
    const __m512 g = h[r], u = h[r + 1 < RB ? r + 1 : r];
    // lane 4i + c: key i of row r (c = 0), key 4 + i of row r (1), the same of row r + 1 (2, 3)
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(g, u, 0x88), _mm512_shuffle_ps(g, u, 0xDD));
    const __m512 o = _mm512_permutexvar_ps(order, sums);
    _mm256_storeu_ps(S + r * C, _mm512_castps512_ps256(o));
    if (r + 1 < RB) _mm256_storeu_ps(S + (r + 1) * C, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1)));
  }
}

// O[r] = O[r] * alpha[r] (no alpha: 1) + sum_t P[r * C + t] * V[t] for RB rows, over the 32 * JW values of V
// from d0, prefetching pf[t] (pf_bytes each) for t < pfn along the way. A V row's bf16 pairs become fp32 in
// registers by a shift (the even values) and a mask (the odd ones), so O holds each block of 32 values as its 16
// even ones, then its 16 odd ones (unpermuted when the item ends).
template <int JW, int RB>
__attribute__((always_inline)) inline void pv_bf16(float* O, int64_t D, const float* alpha, const float* P,
                                                   int64_t C, const uint16_t* const* vrow, int64_t d0, int64_t cn,
                                                   const uint16_t* const* pf, int64_t pfn, int64_t pf_bytes) {
  __m512 acc[RB][2 * JW];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * JW; ++i) {
      acc[r][i] = _mm512_loadu_ps(O + r * D + d0 + 16 * i);
      if (alpha) acc[r][i] = _mm512_mul_ps(acc[r][i], _mm512_set1_ps(alpha[r]));
    }
  const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t = 0; t < cn; ++t) {
    if (t < pfn) prefetch_l2(pf[t], pf_bytes);
    __m512 v[2 * JW];
    for (int j = 0; j < JW; ++j) {
      const __m512i x = _mm512_loadu_si512(vrow[t] + d0 + 32 * j);
      v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * C + t]);
      for (int i = 0; i < 2 * JW; ++i) acc[r][i] = _mm512_fmadd_ps(p, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * JW; ++i) _mm512_storeu_ps(O + r * D + d0 + 16 * i, acc[r][i]);
}

#endif
