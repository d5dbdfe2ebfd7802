// paged_attention.cpp's two inner loops of the generic decode path in 8-float AVX2 vectors, for CPUs without
// AVX-512 (included there inside its anonymous namespace). GCC's 16-float vector extensions, without AVX-512,
// kept the running sums on the stack and moved them through general registers at every step: the decode read the
// cache at 1.6 GB/s, 9x slower than the same CPU's memory allows. The arithmetic is the generic one's: the same
// products, the same order of sums per lane, the same final reduction.
#pragma once

// q . k over D values (D % 16 == 0): two 8-lane chains (the generic code's lanes 0-7 and 8-15), then the sums of
// lanes i and i + 8, i + 4, i + 2, i + 1, as hsum reduces.
inline float dot_rows(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
  for (int64_t d = 16; d < D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  const __m256 s = _mm256_add_ps(a0, a1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
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
