// attend_tile over a bf16 cache for fp32 queries with fp16 products (AVX512-FP16): vfmadd231ph does 32 multiply-adds
// where vfmadd231ps does 16, at the same rate. Only where `--dtype auto` chose fp32 and the measured dispatch found it
// faster (model/attention_dispatch.py); an explicit float32 keeps the fp32 tile. The scores pair head_dim values and
// the values' sums pair keys (32-bit pair broadcasts, as tile_bf16.h); each lane sums at most 32 (scores) or 48
// (values) products in fp16, then fp32 takes them; the softmax stays in fp32. Query rows and each chunk's keys and
// values are scaled by powers of two (divided out exactly in fp32) so that no fp16 sum can overflow, whatever the fp32
// inputs (fp16's 11-bit precision holds down to 2^-19 of a chunk's largest value: one scale per chunk loses nothing a
// scale per row would keep). A call's full chunks are packed once for all its tiles (tile_shared.h). Included by
// paged_attention.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512FP16__)
constexpr int64_t kF16Pairs = 32;  // head_dim pairs a lane sums in fp16 before fp32 takes them
constexpr int64_t kF16ValuePairs = 48;  // key pairs a lane sums in fp16 (attend_tile's chunk of 96 keys)
// Query rows and a chunk's keys are scaled so their largest |value| lies in [2^4, 2^5): a product below 2^10, a lane's
// sum of kF16Pairs below 2^15. A chunk's values to [2^9, 2^10): probabilities are at most 1, a sum of kF16ValuePairs
// below 48 x 2^10 (fp16's largest is 65504).
constexpr int kF16RowTop = 4;
constexpr int kF16ValueTop = 9;
static_assert(kF16Pairs << (2 * kF16RowTop + 2) <= 65504 && kF16ValuePairs << (kF16ValueTop + 1) <= 65504);

// e with max_abs * 2^e in [2^top, 2^(top + 1)); 0 where max_abs is 0 or not finite (zeros stay zero, inf and NaN go
// through as in fp32); within +-126, so that 2^e and 2^-e are normal floats (subnormal maxima take 126).
inline int f16_exponent(float max_abs, int top) {
  uint32_t bits;
  std::memcpy(&bits, &max_abs, sizeof(bits));
  const int biased = static_cast<int>(bits >> 23 & 0xFF);  // max_abs >= 0: no sign bit
  if (max_abs == 0.0f || biased == 0xFF) return 0;
  return biased == 0 ? 126 : std::clamp(top - (biased - 127), -126, 126);
}

// 2^e for |e| <= 126, from its bits.
inline float pow2(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline __m512 widen_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i to_f16(__m512 x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// The 16 fp32 sums of a vector's fp16 pairs (lanes 2i and 2i + 1).
inline __m512 pair_sums(__m512h x) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i w = _mm512_castph_si512(x);
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
  return _mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
}

// The largest |value| of n (% 16 == 0) values read 16 at a time by load(i), in two chains.
template <typename Load>
inline float max_abs(Load&& load, int64_t n) {
  __m512 a = _mm512_setzero_ps(), b = a;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = _mm512_max_ps(a, _mm512_abs_ps(load(i)));
    b = _mm512_max_ps(b, _mm512_abs_ps(load(i + 16)));
  }
  if (i < n) a = _mm512_max_ps(a, _mm512_abs_ps(load(i)));
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

// The largest |value| of the bf16 rows row[t], t < n, of D values each, as a float. |x| of bf16 values orders as
// their bits without the sign (NaN above inf), so 32 at a time as 16-bit integers, in two chains (as widened floats in
// one chain, packing a chunk's keys and values took 16% of the fp16 tile's time at 1,900 tokens; 12% now).
inline float rows_max_abs(const uint16_t* const* row, int64_t n, int64_t D) {
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  __m512i a = _mm512_setzero_si512(), b = a;
  for (int64_t t = 0; t < n; ++t) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
      a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_loadu_si512(row[t] + d), magnitude));
      b = _mm512_max_epu16(b, _mm512_and_si512(_mm512_loadu_si512(row[t] + d + 32), magnitude));
    }
    for (; d < D; d += 16) {
      const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[t] + d)));
      a = _mm512_max_epu16(a, _mm512_maskz_and_epi32(0xFF, x, magnitude));
    }
  }
  alignas(64) uint16_t lanes[32];
  _mm512_store_si512(lanes, _mm512_max_epu16(a, b));
  const uint32_t top = static_cast<uint32_t>(*std::max_element(lanes, lanes + 32)) << 16;
  float x;
  std::memcpy(&x, &top, sizeof(x));
  return x;
}

// Query rows of one tile as fp16 pairs: Q2[i * Mp + row] = values 2i and 2i + 1 of the row times mul (the softmax scale
// in log2 units) times 2^e(row), qinv[row] = 2^-e(row); row r = ii * G + j is query tok0 + ii's head head0 + j; rows
// from M to Mp are zero (qinv 1). q: fp32, token stride qs0 and head stride qs1 in elements.
inline void pack_query_pairs_f16(const float* q, int64_t qs0, int64_t qs1, int64_t tok0, int64_t head0, int64_t R,
                                 int64_t G, int64_t D, int64_t Mp, float mul, uint32_t* Q2, float* qinv) {
  std::memset(Q2, 0, D / 2 * Mp * sizeof(uint32_t));
  std::fill(qinv, qinv + Mp, 1.0f);
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t ii = 0; ii < R; ++ii)
    for (int64_t j = 0; j < G; ++j) {
      const float* src = q + (tok0 + ii) * qs0 + (head0 + j) * qs1;
      const int64_t r = ii * G + j;
      const int e = f16_exponent(max_abs([&](int64_t i) { return _mm512_loadu_ps(src + i) * m; }, D), kF16RowTop);
      const __m512 s = _mm512_set1_ps(mul * pow2(e));
      qinv[r] = pow2(-e);
      for (int64_t d = 0; d < D; d += 16) {
        uint32_t h[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), to_f16(_mm512_loadu_ps(src + d) * s));
        for (int64_t i = 0; i < 8; ++i) Q2[(d / 2 + i) * Mp + r] = h[i];
      }
    }
}

// The chunk's keys as fp16 rows Kh[t * D + d] = K[t][d] * 2^e (one e for the chunk), from the bf16 rows krow[t] of
// its cn keys; keys cn .. cn_padded are zero rows. Returns 2^-e.
inline float pack_keys_f16(const uint16_t* const* krow, int64_t cn, int64_t cn_padded, int64_t D, uint16_t* Kh) {
  const int e = f16_exponent(rows_max_abs(krow, cn, D), kF16RowTop);
  const __m512 s = _mm512_set1_ps(pow2(e));
  for (int64_t t = 0; t < cn; ++t)
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Kh + t * D + d), to_f16(widen_bf16(krow[t] + d) * s));
  std::memset(Kh + cn * D, 0, (cn_padded - cn) * D * sizeof(uint16_t));
  return pow2(-e);
}

// The chunk's values as fp16 pairs VP[i * D + d] = (V[2i][d], V[2i + 1][d]) * 2^e (one e for the chunk), from the
// bf16 rows vrow[t] of its cn keys (a missing last key of a pair counts as zero); returns 2^-e.
inline float pack_value_pairs_f16(const uint16_t* const* vrow, int64_t cn, int64_t D, uint32_t* VP) {
  const int e = f16_exponent(rows_max_abs(vrow, cn, D), kF16ValueTop);
  const __m512 s = _mm512_set1_ps(pow2(e));
  pack_row_pairs(cn, D, VP, [&](int64_t t, int64_t d) { return to_f16(widen_bf16(vrow[t] + d) * s); });
  return pow2(-e);
}

// ST[t][rows] (+)= kinv * qinv[rows] * sum over the head_dim pairs [i0, i0 + np) (np <= kF16Pairs) of
// Kh[t] . Q2[rows], for KT keys and RW vectors of 16 rows; `add`: onto what ST holds (the pairs before i0).
template <int KT, int RW>
inline void qk_micro_f16(const uint16_t* Kh, int64_t D, const uint32_t* Q2, int64_t Mp, int64_t i0, int64_t np,
                         float kinv, const float* qinv, bool add, float* ST) {
  __m512h acc[KT][RW];
  for (int t = 0; t < KT; ++t)
    for (int r = 0; r < RW; ++r) acc[t][r] = _mm512_setzero_ph();
  for (int64_t i = i0; i < i0 + np; ++i) {
    __m512h qv[RW];
    for (int r = 0; r < RW; ++r) qv[r] = _mm512_castsi512_ph(_mm512_loadu_si512(Q2 + i * Mp + 16 * r));
    for (int t = 0; t < KT; ++t) {
      uint32_t pair;
      std::memcpy(&pair, Kh + t * D + 2 * i, sizeof(pair));
      const __m512h kv = _mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int32_t>(pair)));
      for (int r = 0; r < RW; ++r) acc[t][r] = _mm512_fmadd_ph(qv[r], kv, acc[t][r]);
    }
  }
  __m512 scale[RW];
  for (int r = 0; r < RW; ++r) scale[r] = _mm512_mul_ps(_mm512_set1_ps(kinv), _mm512_loadu_ps(qinv + 16 * r));
  for (int t = 0; t < KT; ++t) {
    for (int r = 0; r < RW; ++r) {
      float* dst = ST + t * Mp + 16 * r;
      __m512 s = _mm512_mul_ps(pair_sums(acc[t][r]), scale[r]);
      if (add) s = _mm512_add_ps(s, _mm512_loadu_ps(dst));
      _mm512_storeu_ps(dst, s);
    }
  }
}

// qk_micro_f16 for KT keys over `rvs` vectors of 16 rows (any count, 4 at a time).
template <int KT>
inline void qk_rows_f16(const uint16_t* Kh, int64_t D, const uint32_t* Q2, int64_t Mp, int64_t i0, int64_t np,
                        float kinv, const float* qinv, int64_t rvs, float* ST) {
  const bool add = i0 > 0;
  int64_t rv = 0;
  for (; rv + 4 <= rvs; rv += 4)
    qk_micro_f16<KT, 4>(Kh, D, Q2 + rv * 16, Mp, i0, np, kinv, qinv + rv * 16, add, ST + rv * 16);
  switch (rvs - rv) {
    case 3: qk_micro_f16<KT, 3>(Kh, D, Q2 + rv * 16, Mp, i0, np, kinv, qinv + rv * 16, add, ST + rv * 16); break;
    case 2: qk_micro_f16<KT, 2>(Kh, D, Q2 + rv * 16, Mp, i0, np, kinv, qinv + rv * 16, add, ST + rv * 16); break;
    case 1: qk_micro_f16<KT, 1>(Kh, D, Q2 + rv * 16, Mp, i0, np, kinv, qinv + rv * 16, add, ST + rv * 16); break;
    default: break;
  }
}

// O[r][d0 .. d0 + 16 DV) = O * alpha[r] (`first`; else O) + vinv * sum over the key pairs [i0, i0 + np) (np <=
// kF16ValuePairs) of PP[i][r] . VP[i][..], for RB rows r (row stride D).
template <int RB, int DV>
inline void pv_micro_f16(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp, const uint32_t* VP,
                         int64_t d0, int64_t i0, int64_t np, float vinv, bool first) {
  __m512h acc[RB][DV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_setzero_ph();
  for (int64_t i = i0; i < i0 + np; ++i) {
    __m512h v[DV];
    for (int j = 0; j < DV; ++j) v[j] = _mm512_castsi512_ph(_mm512_loadu_si512(VP + i * D + d0 + 16 * j));
    for (int r = 0; r < RB; ++r) {
      const __m512h p = _mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int32_t>(PP[i * Mp + r])));
      for (int j = 0; j < DV; ++j) acc[r][j] = _mm512_fmadd_ph(p, v[j], acc[r][j]);
    }
  }
  const __m512 vi = _mm512_set1_ps(vinv);
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(first ? alpha[r] : 1.0f);
    for (int j = 0; j < DV; ++j) {
      float* o = O + r * D + d0 + 16 * j;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), a, _mm512_mul_ps(pair_sums(acc[r][j]), vi)));
    }
  }
}

// pv_micro_f16 over RB rows from row 0 of O, alpha and PP, the whole head_dim (D % 16 == 0) and np key pairs, in
// blocks of kF16ValuePairs.
template <int RB>
inline void pv_rows_f16_rb(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp, const uint32_t* VP,
                           int64_t np, float vinv) {
  for (int64_t i0 = 0; i0 < np; i0 += kF16ValuePairs) {
    const int64_t n = std::min(kF16ValuePairs, np - i0);
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) pv_micro_f16<RB, 4>(O, D, alpha, PP, Mp, VP, d0, i0, n, vinv, i0 == 0);
    for (; d0 < D; d0 += 16) pv_micro_f16<RB, 1>(O, D, alpha, PP, Mp, VP, d0, i0, n, vinv, i0 == 0);
  }
}

inline void pv_rows_f16(float* O, int64_t D, const float* alpha, const uint32_t* PP, int64_t Mp, const uint32_t* VP,
                        int64_t np, int64_t rows, float vinv) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows_f16_rb<4>(O + r * D, D, alpha + r, PP + r, Mp, VP, np, vinv);
  switch (rows - r) {
    case 3: pv_rows_f16_rb<3>(O + r * D, D, alpha + r, PP + r, Mp, VP, np, vinv); break;
    case 2: pv_rows_f16_rb<2>(O + r * D, D, alpha + r, PP + r, Mp, VP, np, vinv); break;
    case 1: pv_rows_f16_rb<1>(O + r * D, D, alpha + r, PP + r, Mp, VP, np, vinv); break;
    default: break;
  }
}
#endif
