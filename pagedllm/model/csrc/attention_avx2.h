// paged_attention.cpp's inner loops of the generic decode path in 8-float AVX2 vectors, for CPUs without
// AVX-512 (included there inside its anonymous namespace). GCC's 16-float vector extensions, without AVX-512,
// kept the running sums on the stack and moved them through general registers at every step: the decode read the
// cache at 1.6 GB/s, 9x slower than the same CPU's memory allows. The arithmetic is the generic one's: the same
// products, the same order of sums per lane, the same final reduction.
#pragma once

#define PAGEDLLM_ATTENTION_AVX2 1

// The sum of 16 lanes held as two 8-lane halves (lanes 0-7, 8-15), reduced as hsum reduces: lanes i and i + 8,
// then i + 4, i + 2, i + 1.
inline float hsum_halves(__m256 lo, __m256 hi) {
  const __m256 s = _mm256_add_ps(lo, hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// The largest of 16 lanes held as two halves.
inline float hmax_halves(__m256 lo, __m256 hi) {
  const __m256 s = _mm256_max_ps(lo, hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// 2^x in 8 lanes: vexp2's steps (x < -125 taken as -125).
inline __m256 vexp2_8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-125.0f), magic = _mm256_set1_ps(12582912.0f);
  x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
  const __m256 p = exp2_poly(_mm256_sub_ps(x, n));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// q . k over D values (D % 16 == 0): two 8-lane chains (the generic code's lanes 0-7 and 8-15), then hsum's
// reduction.
inline float dot_rows(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
  for (int64_t d = 16; d < D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  return hsum_halves(a0, a1);
}

// 8 fp32 values of a V row, from fp32 or (widened in registers) bf16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// O[rb][d0..d0+16) = O * alpha[rb] + sum_t P[t * ts + rb * rs] * V[t][d0..) for RB rows (row stride D): RB x 2
// accumulators, two V vectors and a broadcast fit 16 registers for RB <= 4.
template <int RB, typename row_t>
inline void pv_micro8(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                      const row_t* const* vrow, int64_t d0, int64_t cn) {
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 2; ++c)
      acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(O + r * D + 8 * c), _mm256_set1_ps(alpha[r]));
  for (int64_t t = 0; t < cn; ++t) {
    const __m256 v0 = load8(vrow[t] + d0), v1 = load8(vrow[t] + d0 + 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 pt = _mm256_set1_ps(P[t * ts + r * rs]);
      acc[r][0] = _mm256_fmadd_ps(pt, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pt, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(O + r * D + 8 * c, acc[r][c]);
}

// pv_micro8 over `rows` rows (any count), 4 at a time, and the whole head_dim, 16 values at a time.
template <typename row_t>
inline void pv_rows(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                    const row_t* const* vrow, int64_t cn, int64_t rows) {
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t rb = std::min<int64_t>(4, rows - r);
    float* o = O + r * D;
    const float* a = alpha + r;
    const float* p = P + r * rs;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      switch (rb) {
        case 4: pv_micro8<4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        case 3: pv_micro8<3>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        case 2: pv_micro8<2>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        default: pv_micro8<1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
      }
    }
  }
}

// softmax_chunk's two vector steps (rows_steps.h) over 16-lane halves: the generic versions' selects, maxima and
// sums ran element by element through the stack here (decode attention 26% slower, docs/performance.md). The same
// operations per lane, the same order of sums.
// One row of a chunk: its scores sr[0 .. kRowsChunk) to probabilities against the new running max (returned), the
// first `valid` of them seen (the rest exact zeros); *sum: their sum.
inline float row_softmax(float* sr, int64_t valid, float m_old, float* sum) {
  constexpr int64_t C = kRowsChunk;
  static_assert(C % 16 == 0, "a chunk is whole 16-lane vectors");
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), lim = _mm256_set1_epi32(static_cast<int32_t>(valid));
  auto seen = [&](int64_t t) {  // lanes t .. t + 7 that the row sees
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_add_epi32(iota, _mm256_set1_epi32(int32_t(t)))));
  };
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 mx_lo = _mm256_set1_ps(m_old), mx_hi = mx_lo;
  for (int64_t t = 0; t < C; t += 16) {
    __m256 a = _mm256_loadu_ps(sr + t), b = _mm256_loadu_ps(sr + t + 8);
    if (valid < C) a = _mm256_blendv_ps(ninf, a, seen(t)), b = _mm256_blendv_ps(ninf, b, seen(t + 8));
    mx_lo = _mm256_max_ps(mx_lo, a);
    mx_hi = _mm256_max_ps(mx_hi, b);
  }
  const float mxs = hmax_halves(mx_lo, mx_hi);
  const __m256 mx = _mm256_set1_ps(mxs);
  __m256 s_lo = _mm256_setzero_ps(), s_hi = s_lo;
  for (int64_t t = 0; t < C; t += 16) {
    __m256 a = vexp2_8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), mx));
    __m256 b = vexp2_8(_mm256_sub_ps(_mm256_loadu_ps(sr + t + 8), mx));
    if (valid < C) a = _mm256_and_ps(a, seen(t)), b = _mm256_and_ps(b, seen(t + 8));
    _mm256_storeu_ps(sr + t, a);
    _mm256_storeu_ps(sr + t + 8, b);
    s_lo = _mm256_add_ps(s_lo, a);
    s_hi = _mm256_add_ps(s_hi, b);
  }
  *sum = hsum_halves(s_lo, s_hi);
  return mxs;
}

// For up to 8 rows: alpha = 2^(old max - new max) (0 where the old max is -inf), l = l * alpha + sums.
constexpr int64_t kAlphaRows = 8;
inline void alpha_rows(float* alpha, const float* m, float* l, const float* sums) {
  const __m256 mo = _mm256_loadu_ps(alpha);
  const __m256 e = vexp2_8(_mm256_sub_ps(mo, _mm256_loadu_ps(m)));
  const __m256 a = _mm256_andnot_ps(_mm256_cmp_ps(mo, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ), e);
  _mm256_storeu_ps(alpha, a);
  _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), a, _mm256_loadu_ps(sums)));
}

// attend_rows_bf16's steps for fp32 queries over a bf16 cache (attend_rows.h; rows_bf16.h has the AVX-512 ones):
// before them the decode widened every key row into a buffer and reduced each dot product on its own, 1.4x the
// AVX-512 build's time. A bf16 is the top half of an fp32: a shift gives a row's even values, a mask its odd ones.
constexpr int64_t kF32QueryWidth = 1;  // floats per head_dim value of a laid-out query row
constexpr int64_t kPairBlock = 16;     // values per block of the value sums' order: the 8 even ones, then the 8 odd

// A query row (D % 16 == 0) times mul in scores_8's order: per 16 values, the 8 even ones, then the 8 odd ones.
inline void layout_f32_query(const float* src, float mul, int64_t D, float* dst) {
  for (int64_t j = 0; j < D; j += 16)
    for (int64_t i = 0; i < 8; ++i) dst[j + i] = src[j + 2 * i] * mul, dst[j + 8 + i] = src[j + 2 * i + 1] * mul;
}

// S[r * C + t] = q_r . k_t for RB query rows (laid out as above, row stride D) and 8 keys read in place: 8 running
// sums of 8 lanes, one per key, reduced together by sum_lanes_8.
template <int DW, int RB>
inline void scores_8(const float* q, const uint16_t* const* krow, int64_t D_, float* S, int64_t C) {
  const int64_t D = DW > 0 ? 32 * DW : D_;
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int r = 0; r < RB; ++r) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) {
      const __m256 qe = _mm256_loadu_ps(q + r * D + j), qo = _mm256_loadu_ps(q + r * D + j + 8);
      for (int t = 0; t < 8; ++t) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[t] + j));
        acc[t] = _mm256_fmadd_ps(qe, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc[t]);
        acc[t] = _mm256_fmadd_ps(qo, _mm256_castsi256_ps(_mm256_and_si256(x, odd)), acc[t]);
      }
    }
    _mm256_storeu_ps(S + r * C, sum_lanes_8(acc));
  }
}

// O[r][16 values from d0] (their 8 even, then 8 odd) = O * alpha[r] (no alpha: 1) + sum_t P[r * C + t] * V[t] for
// RB rows (row stride D), prefetching pf[t] for t < pfn along the way.
template <int RB>
inline void pv16_bf16(float* O, int64_t D, const float* alpha, const float* P, int64_t C,
                      const uint16_t* const* vrow, int64_t d0, int64_t cn, const uint16_t* const* pf, int64_t pfn,
                      int64_t pf_bytes) {
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2; ++i) {
      acc[r][i] = _mm256_loadu_ps(O + r * D + d0 + 8 * i);
      if (alpha) acc[r][i] = _mm256_mul_ps(acc[r][i], _mm256_set1_ps(alpha[r]));
    }
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t = 0; t < cn; ++t) {
    if (t < pfn) prefetch_l2(pf[t], pf_bytes);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t] + d0));
    const __m256 ve = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), vo = _mm256_castsi256_ps(_mm256_and_si256(x, odd));
    for (int r = 0; r < RB; ++r) {
      const __m256 p = _mm256_set1_ps(P[r * C + t]);
      acc[r][0] = _mm256_fmadd_ps(p, ve, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(p, vo, acc[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(O + r * D + d0 + 8 * i, acc[r][i]);
}

// pv_bf16 (rows_bf16.h) over the 32 * JW values from d0, 16 at a time (prefetching along the first 16).
template <int JW, int RB>
inline void pv_bf16(float* O, int64_t D, const float* alpha, const float* P, int64_t C, const uint16_t* const* vrow,
                    int64_t d0, int64_t cn, const uint16_t* const* pf, int64_t pfn, int64_t pf_bytes) {
  for (int64_t b = d0; b < d0 + 32 * JW; b += 16, pfn = 0)
    pv16_bf16<RB>(O, D, alpha, P, C, vrow, b, cn, pf, pfn, pf_bytes);
}
