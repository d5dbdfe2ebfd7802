// int4_linear_q8.cpp's kernel for CPUs with AVX2 and no AVX512-VNNI (AMD EPYC before Zen 4, Intel's client cores):
// the same unpacked bytes, the same int8 activations, the same sums. vpmaddubsw multiplies the unsigned 4-bit weights
// (0-15) by the int8 activations (within +-127) and adds pairs into int16 exactly: a pair is at most 3,810, a group's
// 8 quads at most 30,480 < 2^15. vpmaddwd then folds a group's int16 sums into the int32 sums vpdpbusd gives, and the
// fp32 fold takes the same operations in the same order: the output bits are the AVX-512 build's. vpmaddubsw gives
// 32 products an instruction, an 8-lane FMA 8. Included inside int4_linear_q8.cpp's anonymous namespace, after Kept,
// Rows and the scalar helpers.
#pragma once

#define PAGEDLLM_INT4_Q8_ONE_ROW 1  // one_row below

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(at::BFloat16* p, __m256 v) {
  // round to nearest even as c10::BFloat16 does (NaN -> 0x7FC0), as lanes16.h's store
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                                                                    _mm256_set1_epi32(1)));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);  // 8 words, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline __m256 abs8(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Halves [h0, h1) of a tile's nibbles as bytes, in the AVX-512 build's layout ([G][kQuads][2 (h1 - h0)][64]: 16
// columns x 4 inputs a 64-byte vector, two of 8 columns here), and their d and m in fp32 as [G][2][2 (h1 - h0)][16].
// The layout's 4 inputs x 16 bytes (input major) become byte major by a 4 x 16 byte transpose.
void unpack_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t G, int64_t h0, int64_t h1,
                 uint8_t* w, float* dm) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t halves = h1 - h0, V = 2 * halves;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < 2 * V; ++c) {
      const int64_t col = g * kTile + h0 * kHalf + 8 * c;
      _mm256_storeu_ps(dm + g * 2 * V * 16 + 8 * c, _mm256_cvtph_ps(_mm_loadu_si128(
                                                        reinterpret_cast<const __m128i*>(sc + col))));
      _mm256_storeu_ps(dm + (g * 2 * V + V) * 16 + 8 * c, _mm256_cvtph_ps(_mm_loadu_si128(
                                                              reinterpret_cast<const __m128i*>(mn + col))));
    }
    for (int64_t h = h0; h < h1; ++h) {
      const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
      uint8_t* wg = w + g * kQuads * halves * kQuadBytes + (h - h0) * kQuadBytes;
#pragma GCC unroll 8
      for (int64_t j = 0; j < kQuads; ++j) {
        const __m128i* in = reinterpret_cast<const __m128i*>(p + 64 * j);
        const __m128i r0 = _mm_loadu_si128(in), r1 = _mm_loadu_si128(in + 1), r2 = _mm_loadu_si128(in + 2),
                      r3 = _mm_loadu_si128(in + 3);
        const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
        const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
        const __m256i a = _mm256_set_m128i(_mm_unpackhi_epi16(lo01, lo23), _mm_unpacklo_epi16(lo01, lo23));
        const __m256i b = _mm256_set_m128i(_mm_unpackhi_epi16(hi01, hi23), _mm_unpacklo_epi16(hi01, hi23));
        __m256i* out = reinterpret_cast<__m256i*>(wg + j * halves * kQuadBytes);
        _mm256_storeu_si256(out, _mm256_and_si256(a, low));
        _mm256_storeu_si256(out + 1, _mm256_and_si256(b, low));
        _mm256_storeu_si256(out + 2, _mm256_and_si256(_mm256_srli_epi16(a, 4), low));
        _mm256_storeu_si256(out + 3, _mm256_and_si256(_mm256_srli_epi16(b, 4), low));
      }
    }
  }
}

// keep_largest of the AVX-512 build over 8 lanes' maxima: the kOutliers-th largest of them bounds the kept inputs
// from below just the same, so the candidates, and the inputs kept, are the same.
void keep_largest(float* work, int64_t K, __m256 lanes, int32_t* cand, Kept& kept) {
  alignas(32) float lane[8];
  _mm256_store_ps(lane, lanes);
  std::nth_element(lane, lane + kOutliers - 1, lane + 8, std::greater<float>());
  const float least = lane[kOutliers - 1];
  const __m256 t = _mm256_set1_ps(least > 0 ? least : std::numeric_limits<float>::denorm_min());
  int64_t n = 0;
  for (int64_t k = 0; k < K; k += 8) {
    for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs8(_mm256_loadu_ps(work + k)), t, _CMP_GE_OQ)); hit;
         hit &= hit - 1)
      cand[n++] = static_cast<int32_t>(k + __builtin_ctz(hit));
  }
  take_largest(work, cand, n, kept);
}

// The AVX-512 build's quantize_row (the same xq, scales, sums, kept inputs and down), 8 lanes at a time.
template <typename T>
void quantize_row(const T* x, int64_t K, float* work, int8_t* xq, float* scale, float* qsum, Kept& kept,
                  float& down) {
  __m256 bad = _mm256_setzero_ps(), lanes = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = load8(x + k);
    bad = _mm256_or_ps(bad, _mm256_sub_ps(v, v));  // 0 for finite values, NaN otherwise
    lanes = _mm256_max_ps(lanes, abs8(v));
  }
  const float up = tiny_row_up(max8(lanes));
  for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(work + k, _mm256_mul_ps(load8(x + k), _mm256_set1_ps(up)));
  lanes = _mm256_mul_ps(lanes, _mm256_set1_ps(up));
  const int64_t G = K / kGroup;
  down = 1.0f;
  if (_mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q))) return quantize_bad_row(K, xq, scale, qsum, kept);
  keep_largest(work, K, lanes, reinterpret_cast<int32_t*>(work + K), kept);
  for (float& v : kept.value) v /= up;
  down = 1.0f / up;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < G; ++g) {
    __m256 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(work + g * kGroup + 8 * i);
    const float amax = max8(_mm256_max_ps(_mm256_max_ps(abs8(a[0]), abs8(a[1])), _mm256_max_ps(abs8(a[2]),
                                                                                                abs8(a[3]))));
    // a group below 2^-120 (127 / amax would overflow) is at most 2^-20 of the row's largest: left out as zeros
    const __m256 inv = _mm256_set1_ps(amax >= 0x1p-120f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
    // saturating packs within 128-bit lanes leave dwords of 4 bytes in the order q0 q1 q2 q3 (low 4) | (high 4)
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
    scale[g] = amax >= 0x1p-120f ? amax / 127.0f : 0.0f;
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    qsum[g] = scale[g] * static_cast<float>(sum8(total));
  }
}

// R rows x 16 columns (two vectors of 8) starting at 8-column vector c0 of the unpacked halves (V: their vectors of
// 16 columns): per group, int16 sums over its 8 quads, folded to int32 and into fp32 sums as the AVX-512 build folds
// its int32 sums; then each row's kept inputs with the exact weights. Out: fp32 or bf16, at its 16 columns. The quad
// loop unrolled 2 (by 8, GCC computed a group's products ahead of their adds and spilled them to the stack).
template <int R, typename Out>
void block_rows(const uint8_t* w, const float* dm, const Rows& x, int64_t r0, int64_t K, int64_t V, int64_t c0,
                Out* out, int64_t N) {
  constexpr int C = 2;
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i sum[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * kQuads * V * 64 + c0 * 32;
    const int8_t* xg = x.xq + r0 * K + g * kGroup;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kQuads; ++j) {
      __m256i wj[C];
      for (int c = 0; c < C; ++c)
        wj[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * V * 64 + 32 * c));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xg + r * K + 4 * j, sizeof(quad));
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int c = 0; c < C; ++c) sum[r][c] = _mm256_add_epi16(sum[r][c], _mm256_maddubs_epi16(wj[c], xb));
      }
    }
    const float* dg = dm + g * 2 * V * 16 + 8 * c0;
    for (int c = 0; c < C; ++c) {
      const __m256 d = _mm256_loadu_ps(dg + 8 * c), m = _mm256_loadu_ps(dg + V * 16 + 8 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * G + g;
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[at]));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][c], ones));
        acc[r][c] = _mm256_fmadd_ps(s, ds, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.qsum[at]), acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const Kept& kept = x.kept[r0 + r];
    if (x.down[r0 + r] != 1.0f) {
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_mul_ps(acc[r][c], _mm256_set1_ps(x.down[r0 + r]));
    }
    for (int e = 0; e < kOutliers; ++e) {
      if (kept.value[e] == 0.0f) continue;
      const int64_t g = kept.index[e] / kGroup, k = kept.index[e] % kGroup;
      const __m256 v = _mm256_set1_ps(kept.value[e]);
      const uint8_t* wq = w + (g * kQuads + k / 4) * V * 64 + c0 * 32;  // input k's byte in each lane: k % 4
      const float* dg = dm + g * 2 * V * 16 + 8 * c0;
      for (int c = 0; c < C; ++c) {
        const __m256i b = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * c)),
                                            static_cast<int>(8 * (k % 4)));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xFF)));
        const __m256 wt = _mm256_fmadd_ps(q, _mm256_loadu_ps(dg + 8 * c), _mm256_loadu_ps(dg + V * 16 + 8 * c));
        acc[r][c] = _mm256_fmadd_ps(wt, v, acc[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) store8(out + (r0 + r) * N + 8 * (c0 + c), acc[r][c]);
  }
}

template <typename Out>
using BlockRows = void (*)(const uint8_t*, const float*, const Rows&, int64_t, int64_t, int64_t, int64_t, Out*,
                           int64_t);
template <typename Out>
constexpr BlockRows<Out> kBlock[kBlockRows + 1] = {nullptr, block_rows<1, Out>, block_rows<2, Out>,
                                                   block_rows<3, Out>};

// Rows [c0, c1) against the unpacked halves (halves: 1 or 2 of a tile): a strip of 16 columns at a time, all the rows
// through it kBlockRows at a time (blocks of 4 rows ran level with 3 on AMD EPYC Zen 3).
template <typename Out>
void run_rows(const uint8_t* w, const float* dm, const Rows& x, int64_t c0, int64_t c1, int64_t halves, int64_t K,
              Out* out, int64_t N) {
  for (int64_t v = 0; v < 4 * halves; v += 2)
    for (int64_t r = c0; r < c1; r += kBlockRows)
      kBlock<Out>[std::min(kBlockRows, c1 - r)](w, dm, x, r, K, 2 * halves, v, out, N);
}

// block_rows' tail for one_row: the sums times the row's down, then its kept inputs with their exact weights, each
// input's 16 bytes of the half widened in registers (columns 8c .. 8c + 7: bytes 0-7 or 8-15, low or high nibbles).
inline void one_row_kept(const uint8_t* tile, const at::Half* sc, const at::Half* mn, const Rows& x, int64_t h,
                         __m256* acc) {
  if (x.down[0] != 1.0f) {
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_mul_ps(acc[c], _mm256_set1_ps(x.down[0]));
  }
  const Kept& kept = x.kept[0];
  for (int e = 0; e < kOutliers; ++e) {
    if (kept.value[e] == 0.0f) continue;
    const int64_t g = kept.index[e] / kGroup, k = kept.index[e] % kGroup, col = g * kTile + h * kHalf;
    const __m128i row = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        tile + (g * 2 + h) * kHalfBytes + 64 * (k / 4) + 16 * (k % 4)));
    const __m256 v = _mm256_set1_ps(kept.value[e]);
    for (int c = 0; c < 4; ++c) {
      const __m256i b = _mm256_cvtepu8_epi32(c % 2 ? _mm_srli_si128(row, 8) : row);
      const __m256i n = c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + col + 8 * c)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + col + 8 * c)));
      acc[c] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(n), d, m), v, acc[c]);
    }
  }
}

// One row (a call of one row) against half h of a tile's nibbles read in place: each unpacked byte would be read
// once, so unpack_tile's transposes, stores and loads are work to skip (a decode step's 120 layer matmuls at one row
// in 0.73x the time on AMD EPYC Zen 3; at 2 and 3 rows this form, a row loop inside, took 1.2x the unpacking's).
// A quad's two 32-byte loads (inputs 4j, 4j + 1, then 4j + 2, 4j + 3, each 16 bytes: column b in byte b's low
// nibble, 16 + b in its high one) become by a qword permutation and a byte shuffle the two inputs' bytes of a column
// side by side, and vpmaddubsw sums each pair into that column's int16 lane. Four quads fill a lane to at most 4 x 2
// x 3,810 = 30,480 < 2^15; then the lanes widen into the group's int32 sums, which are exact, so the fp32 fold
// (block_rows', the same operations in the same order) gives block_rows' bits.
template <typename Out>
void one_row(const uint8_t* tile, const at::Half* sc, const at::Half* mn, const Rows& x, int64_t K, int64_t h,
             Out* out) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,  // per 128-bit lane
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  __m256 acc[4];  // columns 8c .. 8c + 7 of the half
  for (int c = 0; c < 4; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = tile + (g * 2 + h) * kHalfBytes;
    __m256i sum[4];  // int32 sums of columns 8c .. 8c + 7
    for (int c = 0; c < 4; ++c) sum[c] = _mm256_setzero_si256();
    for (int64_t j0 = 0; j0 < kQuads; j0 += 4) {
      __m256i s16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // columns 0-15, 16-31
#pragma GCC unroll 4
      for (int64_t j = j0; j < j0 + 4; ++j) {
        int16_t xp[2];
        std::memcpy(xp, x.xq + g * kGroup + 4 * j, sizeof(xp));
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {  // inputs 4j + 2i, 4j + 2i + 1
          __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * j + 32 * i));
          b = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(b, 0xD8), pairs);
          const __m256i xb = _mm256_set1_epi16(xp[i]);
          s16[0] = _mm256_add_epi16(s16[0], _mm256_maddubs_epi16(_mm256_and_si256(b, low), xb));
          s16[1] = _mm256_add_epi16(s16[1],
                                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), xb));
        }
      }
      for (int c = 0; c < 2; ++c) {
        sum[2 * c] = _mm256_add_epi32(sum[2 * c], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[c])));
        sum[2 * c + 1] = _mm256_add_epi32(sum[2 * c + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[c], 1)));
      }
    }
    const int64_t col = g * kTile + h * kHalf;
    const __m256 xs = _mm256_set1_ps(x.scale[g]), xq = _mm256_set1_ps(x.qsum[g]);
    for (int c = 0; c < 4; ++c) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + col + 8 * c)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + col + 8 * c)));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[c]), _mm256_mul_ps(d, xs), acc[c]);
      acc[c] = _mm256_fmadd_ps(m, xq, acc[c]);
    }
  }
  one_row_kept(tile, sc, mn, x, h, acc);
  for (int c = 0; c < 4; ++c) store8(out + 8 * c, acc[c]);
}
