// int8_gemm.cpp's panel kernel on CPUs with AVX2 and FMA but no VNNI (AMD EPYC before Zen 4, most desktop CPUs),
// included there inside its anonymous namespace. vpmaddubsw, the u8 x s8 product AVX2 has, pairs two products into
// a saturating int16 (255 * 127 * 2 does not fit: oneDNN's int8 matmul is wrong here for that reason); vpmaddwd
// multiplies int16 pairs into an exact int32. So the packed weight's bytes (w + 128, the same layout as the VNNI
// kernel's) are widened to int16 as they are loaded, the activations once per call (int8_gemm's `widened`), and each
// vpmaddwd adds two products into an int32 lane: the same exact sums as vpdpbusd, so the same bits out.
//
// A 64-byte group of a tile holds 16 columns x 4 inputs (byte 4j + b: column j, input b). Its half for 8 columns,
// widened 16 bytes at a time, gives 4 columns x 4 inputs of int16; against x's 4 inputs broadcast as int16 pairs,
// vpmaddwd leaves each column's two partial sums in adjacent int32 lanes, which the epilogue adds (vphaddd) and puts
// back in column order. Register blocking: 4 rows x 8 columns (8 accumulators, 2 weight vectors and the rows'
// broadcasts: with 6 rows GCC spilled 9 of the 12 accumulators, and was no faster).
#pragma once

constexpr int64_t kSlice = 8;  // output columns per pass over a panel: 8 slices of a 64-column panel

inline __m256i valid_lanes(int valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 load8(const float* p, int valid) {
  return valid == kSlice ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, valid_lanes(valid));
}

inline __m256 load8(const at::BFloat16* p, int valid) {
  alignas(16) uint16_t bits[kSlice] = {};
  std::memcpy(bits, p, sizeof(uint16_t) * valid);
  const __m256i h = _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bits)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

inline void store8(float* out, __m256 v, int valid) {
  if (valid == kSlice) _mm256_storeu_ps(out, v);
  else _mm256_maskstore_ps(out, valid_lanes(valid), v);
}

inline void store8(at::BFloat16* out, __m256 v, int valid) {
  alignas(32) float f[kSlice];
  _mm256_store_ps(f, v);
  for (int i = 0; i < valid; ++i) out[i] = at::BFloat16(f[i]);  // nearest even, NaN -> 0x7FC0, as the VNNI store
}

inline void store8(int32_t* out, __m256i v, int valid) {
  if (valid == kSlice) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
  else _mm256_maskstore_epi32(out, valid_lanes(valid), v);
}

// R rows of x, widened to int16 (row stride ldx), against one panel (G groups of 4 inputs), slice by slice: sums
// over all of K in registers, then the epilogue for the slice's columns of those rows.
template <int R, typename T, typename W>
inline void panel_rows(const uint8_t* panel, const int16_t* x, int64_t ldx, int64_t G, int64_t row0, int64_t col0,
                       const Epilogue<T, W>& e) {
  for (int64_t s = 0; s < kPanel / kSlice && col0 + s * kSlice < e.n; ++s) {
    const uint8_t* wp = panel + s * 2 * 16;
    __m256i acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wp + g * kTiles * 64;
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int64_t group;
        std::memcpy(&group, x + r * ldx + 4 * g, sizeof(group));
        const __m256i xb = _mm256_set1_epi64x(group);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xb));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xb));
      }
    }
    const int64_t c = col0 + s * kSlice;
    const int valid = static_cast<int>(std::min<int64_t>(kSlice, e.n - c));
    __m256i sums[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)  // [c0 c1 c4 c5 | c2 c3 c6 c7] -> c0..c7, less 128 * sum(x) for the weights' offset
      sums[r] = _mm256_sub_epi32(_mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8),
                                 _mm256_set1_epi32(e.xsum128[row0 + r]));
    if constexpr (std::is_same_v<T, int32_t>) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) store8(e.out + (row0 + r) * e.ldo + c, sums[r], valid);
    } else {
      // the VNNI kernel's epilogue, operation for operation: the same bits
      const __m256 cs = load8(e.col_scale + c, valid);
      __m256 v[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(e.row_scale[row0 + r]));
        v[r] = e.bias == nullptr ? _mm256_mul_ps(a, cs) : _mm256_fmadd_ps(a, cs, load8(e.bias + c, valid));
      }
      for (int64_t j = 0; j < e.E; ++j) {
        const __m256 w = load8(e.extra_w + j * e.ldw + c, valid);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) v[r] = _mm256_fmadd_ps(_mm256_set1_ps(e.extra_x[(row0 + r) * e.E + j]), w, v[r]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) store8(e.out + (row0 + r) * e.ldo + c, v[r], valid);
    }
  }
}
