// 16 lanes of a float32 or bfloat16 row as fp32, and back (masked to a tile's valid columns): the kernels that take
// either dtype's rows (int8_gemm.cpp's epilogue, int4_linear_f16.cpp) load and store through these. Integer ops
// only, so no AVX512-BF16 is needed. Included inside a kernel's anonymous namespace, under AVX-512F.
#pragma once

inline void store(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }

inline void store(at::BFloat16* out, __m512 v, __mmask16 mask) {
  // round to nearest even as c10::BFloat16 does (NaN -> 0x7FC0)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                                                    _mm512_set1_epi32(1)));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(h));
}

inline __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load(const at::BFloat16* p, __mmask16 mask) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
