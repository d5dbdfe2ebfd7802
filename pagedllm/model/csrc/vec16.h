// The 16-lane float helpers fused_ops.cpp, top_k.cpp and sampling.cpp share: GCC vector types (AVX-512 registers,
// or pairs of AVX2 ones), loads and stores, a lane sum, a row's max, e^x for x <= 0, a row's contiguity check.
// Included inside their anonymous namespace, after exp2_poly.h, the ATen headers and immintrin.h.
#pragma once

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

inline v16 vload16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum16(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// e^x for x <= 0 (relative error ~1e-7): 2^(x log2 e), integer part in the exponent, degree-7 polynomial.
inline float exp_nonpos(float x) {
  float t = x * 1.4426950408889634f;
  t = t < -125.0f ? -125.0f : t;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to an integer
  const float p = exp2_poly(t - n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// e^x for x <= 0, 16 lanes at a time, with exp_nonpos's results. With AVX-512 the clamp, the rounding to an
// integer and the scaling by 2^n are one instruction each (vmaxps, vrndscaleps, vscalefps: the same values,
// as t is in [-125, 0] and the product stays normal), 12 ops instead of 17.
inline v16 exp_nonpos16(v16 x) {
#if defined(__AVX512F__)
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-125.0f), (__m512)(x * 1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (v16)_mm512_scalef_ps((__m512)exp2_poly((v16)t - (v16)n), n);
#else
  // The clamp in bit operations: GCC lowers a comparison of 16 floats lane by lane where they span registers.
  // t < -125 exactly when t + 125 is negative (it cannot round to -0); a NaN stays as it is.
  const v16 lo = v16{} - 125.0f;
  v16 t = x * 1.4426950408889634f;
  const vi16 nan = (vi16)(((vu16)t & 0x7FFFFFFFu) + 0x7FFFFFu) >> 31;
  const vi16 below = ((vi16)(t - lo) >> 31) & ~nan;
  t = (v16)(((vi16)lo & below) | ((vi16)t & ~below));
  const v16 n = (t + 12582912.0f) - 12582912.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  return exp2_poly(t - n) * (v16)bits;
#endif
}

inline float hmax16(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// The largest of x[0..n), and sum(exp(x - m)) once it is known: 16 lanes at a time, the tail one by one.
inline float chunk_max(const float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  v16 mv = v16{} - INFINITY;
  for (; i + 16 <= n; i += 16) {
    const v16 v = vload16(x + i);
    mv = v > mv ? v : mv;
  }
  float m = hmax16(mv);
#else
  // GCC lowers a 16-float comparison lane by lane where the lanes span two AVX2 registers; vmaxps(v, m) is the
  // same v > m ? v : m (a NaN never wins).
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, m0);
  _mm256_store_ps(lanes + 8, m1);
  float m = hmax16(vload16(lanes));
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline float chunk_exp_sum(const float* x, int64_t n, float m) {
  v16 sv = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) sv += exp_nonpos16(vload16(x + i) - m);
  float s = hsum16(sv);
  for (; i < n; ++i) s += exp_nonpos(x[i] - m);
  return s;
}

// Whether any of x[0..16) is above t (a NaN is not).
inline bool any_above(const float* x, float t) {
#if defined(__AVX512F__)
  // one compare into a mask register (the vector extension's `>` then OR of 16 lanes was extracted lane by lane)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#else
  const __m256 tv = _mm256_set1_ps(t);
  const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(x), tv, _CMP_GT_OQ);
  const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(x + 8), tv, _CMP_GT_OQ);
  return _mm256_movemask_ps(_mm256_or_ps(a, b)) != 0;
#endif
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-d tensor");
}
