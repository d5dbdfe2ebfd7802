// int8_gemm.cpp's panel kernel on CPUs with AVX2 and FMA but no VNNI (AMD EPYC before Zen 4, most desktop CPUs),
// included there inside its anonymous namespace. vpmaddubsw, the u8 x s8 product AVX2 has, multiplies 32 byte pairs
// and adds adjacent products into a saturating int16: with the packed weight's bytes (w + 128, up to 255, the same
// layout as the VNNI kernel's) against full int8 activations a pair reaches 255 * 127 * 2 and saturates (oneDNN's
// int8 matmul is wrong here for that reason). Activations within +-64 (kInputMax: int8_gemm refuses others; the
// quantiser makes them so on such CPUs) keep every pair within 255 * 64 * 2 = 32,640: exact. vpmaddwd against ones
// then adds each column's two pairs into an int32 lane, so the sums are vpdpbusd's, and the same bits come out of
// the same inputs. On one Zen 3 core that pair sums 65 G products a second, vpmaddwd over activations widened to
// int16 (this kernel until 2026-11-30: the lm_head at 64 rows no faster than oneDNN's fp32 matmul) 32 G, 8-float
// FMAs 44 G (docs/performance.md).
//
// A 64-byte group of a tile holds 16 columns x 4 inputs (byte 4j + b: column j, input b); its two 32-byte halves are
// 8 columns each, and against x's 4 inputs broadcast, vpmaddubsw + vpmaddwd leave column j's sum of 4 products in
// int32 lane j: column order, no shuffles. Register blocking: kRows (6) rows x one tile, 12 accumulators beside the
// 2 weight vectors, a row's broadcast and the ones (4 rows: the lm_head 6-38% slower at 64-256 rows on Zen 3,
// docs/results/side_by_side/2026-11-30/lm_head_maddubs/rows_per_block.txt).
#pragma once

constexpr int64_t kSlice = 8;  // output columns per int32 vector
constexpr int kInputMax = 64;  // the largest |x| whose products cannot saturate vpmaddubsw against 255

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

// The sums of R rows for 8 columns from c on (valid of them) to the output: the VNNI kernel's epilogue, operation for
// operation, so the same bits.
template <int R, typename T, typename W>
inline void slice_out(__m256i (&acc)[R], int64_t row0, int64_t c, int valid, const Epilogue<T, W>& e) {
  __m256i sums[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sums[r] = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(e.xsum128[row0 + r]));
  if constexpr (std::is_same_v<T, int32_t>) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store8(e.out + (row0 + r) * e.ldo + c, sums[r], valid);
  } else {
    const __m256 cs = load8(e.col_scale + c, valid);
    __m256 v[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(e.row_scale[row0 + r]));
      v[r] = e.bias == nullptr ? _mm256_mul_ps(a, cs) : _mm256_fmadd_ps(a, cs, load8(e.bias + c, valid));
    }
    for (int64_t j = 0; j < e.E; ++j) {
      const __m256 w = load8(e.extra_w + e.extra_off[j] + c, valid);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) v[r] = _mm256_fmadd_ps(_mm256_set1_ps(e.extra_x[(row0 + r) * e.E + j]), w, v[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store8(e.out + (row0 + r) * e.ldo + c, v[r], valid);
  }
}

constexpr int64_t kPrefetchGroups = 4;  // panel_rows' prefetch distance (Zen 3: 2 level, 8 and 16 slower from 6 rows)

// R rows of x (int8 within +-kInputMax, row stride ldx) against one panel (G groups of 4 inputs), TP tiles at a time:
// sums over all of K in registers, then the epilogue for those tiles' columns of those rows. A tile's 64 bytes of a
// group lie 256 apart, and a pass over one tile read the panel slower than memory allows: at 1 and 2 rows a pass
// takes all four tiles (8 and 16 accumulators), so the panel's bytes stream in order; from 3 rows (2 x R
// accumulators a tile) the first tile's pass prefetches each group kPrefetchGroups ahead, all four tiles' lines
// (the lm_head, 49,152 x 576, from memory, AMD EPYC Zen 3: 0.64x the time at 1 row, 0.57x at 2, 0.63-0.73x at 3-6,
// 0.86x at 16, 0.96x at 64; docs/results/side_by_side/2026-12-03/zen3/one_row/lm_head_variants.txt).
template <int R, typename T, typename W>
inline void panel_rows(const uint8_t* panel, const int8_t* x, int64_t ldx, int64_t G, int64_t row0, int64_t col0,
                       const Epilogue<T, W>& e) {
  constexpr int TP = R <= 2 ? kTiles : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t0 = 0; t0 < kTiles && col0 + t0 * kTile < e.n; t0 += TP) {
    __m256i acc[TP][2][R];
#pragma GCC unroll 8
    for (int t = 0; t < TP; ++t)
      for (int r = 0; r < R; ++r) acc[t][0][r] = acc[t][1][r] = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = panel + (g * kTiles + t0) * 64;
      if (TP < kTiles && t0 == 0 && g + kPrefetchGroups < G)
        for (int l = 0; l < kTiles; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(panel + ((g + kPrefetchGroups) * kTiles + l) * 64), _MM_HINT_T0);
      __m256i xb[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t group;
        std::memcpy(&group, x + r * ldx + 4 * g, sizeof(group));
        xb[r] = _mm256_set1_epi32(group);
      }
#pragma GCC unroll 4
      for (int t = 0; t < TP; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * t + 32 * h));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            acc[t][h][r] = _mm256_add_epi32(acc[t][h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb[r]), ones));
        }
    }
    for (int t = 0; t < TP; ++t)
      for (int h = 0; h < 2; ++h) {
        const int64_t c = col0 + (t0 + t) * kTile + h * kSlice;
        if (c < e.n) slice_out<R>(acc[t][h], row0, c, static_cast<int>(std::min<int64_t>(kSlice, e.n - c)), e);
      }
  }
}
