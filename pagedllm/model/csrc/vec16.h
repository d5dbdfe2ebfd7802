// The 16-lane float helpers fused_ops.cpp and top_k.cpp share: GCC vector types (AVX-512 registers, or pairs of
// AVX2 ones), loads and stores, a lane sum, e^x for x <= 0, a row's contiguity check. Included by both inside their
// anonymous namespace, after exp2_poly.h and the ATen headers.
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

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-d tensor");
}
