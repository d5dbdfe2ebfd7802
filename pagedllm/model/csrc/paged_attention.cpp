// Paged attention on the CPU: a flat batch of queries (decodes and prompt chunks mixed) attends over a
// paged KV cache laid out [num_blocks, block_size, num_kv_heads, head_dim].
//
// Two kernels, both with online softmax and fp32 accumulation, both reading keys in chunks of consecutive
// positions that may span blocks (so any block size, down to 1, costs the same):
//  - attend_rows: decodes and very short chunks. Memory bound: each K/V row is read once for all query heads
//    of its kv group, scores are dot products. Over a bf16 cache with bf16 queries (AVX512-BF16) the scores of
//    16 keys come from vdpbf16ps on the stored rows and one transposing reduction, and V rows are converted
//    in registers: no row is copied to fp32 first.
//  - attend_tile: prompt chunks. Compute bound: a tile of queries x (one kv head's query heads) is held
//    transposed, so scores for a chunk of keys come out as S^T[key][row] with rows in vector lanes; the
//    softmax then needs no horizontal reductions and no [T, T] matrix is ever formed.
// The cache holds float32, bfloat16, or int8 rows (uint8 records: head_dim values, then an fp16 scale and min per
// group of kKvGroup, value = q * scale + min; quantised by write_kv below), converted to fp32 as they are read.
// Vectors are GCC vector extensions (16 floats); with -march=native they compile to AVX-512 where present
// and to narrower registers elsewhere. Work items go to threads dynamically, largest first.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "exp2_poly.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

constexpr int64_t kKvGroup = 16;  // int8 cache: values per (scale, min) pair

constexpr int64_t kRowsChunk = 32;  // keys per softmax step in attend_rows
constexpr int64_t kTileChunk = 96;  // keys per softmax step in attend_tile (a multiple of kTB)
constexpr int64_t kTileRows = 64;   // target query rows (queries x heads of a group) per tile
constexpr int kTB = 6;              // keys per QK micro-kernel step (6 x 4 accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

inline v16 vload(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 vset(float x) { return v16{} + x; }
inline vi16 viset(int32_t x) { return vi16{} + x; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

inline float hsum(v16 v) {
  v += __builtin_shuffle(v, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

inline float hmax(v16 v) {
  v = vmax(v, __builtin_shuffle(v, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmax(v, __builtin_shuffle(v, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmax(v, __builtin_shuffle(v, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

// 2^x for x <= 0 (scores minus their running max, in log2 units), relative error ~1e-7.
// Round-to-nearest range reduction and a degree-7 polynomial; inputs below -125 give ~2^-125.
inline v16 vexp2(v16 x) {
  const v16 lo = vset(-125.0f);
  x = x < lo ? lo : x;
  const v16 magic = vset(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v16 n = (x + magic) - magic;
  const v16 p = exp2_poly(x - n);  // x - n in [-0.5, 0.5]
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * (v16)e;
}

// Rows of head_dim floats (head_dim % 16 == 0), from the cache's element type.
inline void row_to_f32(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_to_f32(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; i += 16) {
    vh16 h;
    std::memcpy(&h, u + i, sizeof(h));
    const vi16 w = __builtin_convertvector(h, vi16) << 16;
    vstore(dst + i, (v16)w);
  }
}

// One int8 record (head_dim values, then (scale, min) in fp16 per group) to fp32.
inline void row_to_f32(const uint8_t* src, float* dst, int64_t n) {
  const uint8_t* params = src + n;
  for (int64_t g = 0; g < n; g += kKvGroup) {
    uint16_t sm[2];
    std::memcpy(sm, params + g / kKvGroup * sizeof(sm), sizeof(sm));
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(_cvtsh_ss(sm[0])), mn = _mm512_set1_ps(_cvtsh_ss(sm[1]));
    for (int64_t i = g; i < g + kKvGroup; i += 16) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), scale, mn));
    }
#else
    const v16 scale = vset(static_cast<float>(c10::Half(sm[0], c10::Half::from_bits())));
    const v16 mn = vset(static_cast<float>(c10::Half(sm[1], c10::Half::from_bits())));
    for (int64_t i = g; i < g + kKvGroup; i += 16) {
      vb16 b;
      std::memcpy(&b, src + i, sizeof(b));
      vstore(dst + i, __builtin_convertvector(b, v16) * scale + mn);
    }
#endif
  }
}

// Cache elements of one kv head's row of one token: head_dim, and the int8 records' parameters.
template <typename kv_t>
constexpr int64_t row_len(int64_t D) {
  return std::is_same_v<kv_t, uint8_t> ? D + D / kKvGroup * 2 * static_cast<int64_t>(sizeof(at::Half)) : D;
}

// `heads` consecutive kv-head rows of one token to fp32 rows of D.
template <typename kv_t>
inline void rows_to_f32(const kv_t* src, float* dst, int64_t D, int64_t heads) {
  if constexpr (std::is_same_v<kv_t, uint8_t>) {
    for (int64_t h = 0; h < heads; ++h) row_to_f32(src + h * row_len<kv_t>(D), dst + h * D, D);
  } else {
    row_to_f32(src, dst, heads * D);
  }
}

// One call's inputs, shared read-only by all tasks.
template <typename kv_t>
struct Problem {
  const void* q;
  bool half_q;  // q and out are bfloat16 (else float32)
  int64_t q_stride0, q_stride1;
  void* out;
  const kv_t* k;
  const kv_t* v;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start_loc;
  int64_t H, KVH, G, D, BS, MB;
  float scale_log2;  // softmax scale times log2(e): scores live in log2 units so exp becomes exp2
  int64_t RL = row_len<kv_t>(D);  // cache elements per kv head and token
};

// Queries [q_begin, q_end) of one sequence against kv heads [kv_begin, kv_end).
struct WorkItem {
  int32_t seq, q_begin, q_end, kv_begin, kv_end;
  bool tiled;
  double cost;
};

// Per-thread buffers, sized once per call for the largest work item and reused across items.
struct Scratch {
  std::vector<float> buf;
  std::vector<int32_t> pos;  // attend_tile: position of each query row
  std::vector<const float*> krow, vrow;
  float* take(size_t n, size_t& off) {
    float* p = buf.data() + off;
    off += (n + 15) / 16 * 16;
    return p;
  }
};

template <typename kv_t>
inline float q_at(const Problem<kv_t>& P, int64_t tok, int64_t head, int64_t d) {
  const int64_t i = tok * P.q_stride0 + head * P.q_stride1 + d;
  return P.half_q ? static_cast<float>(static_cast<const at::BFloat16*>(P.q)[i])
                  : static_cast<const float*>(P.q)[i];
}

template <typename kv_t>
inline void store_out(const Problem<kv_t>& P, int64_t tok, int64_t head, const float* src, float mul) {
  const int64_t base = (tok * P.H + head) * P.D;
  if (P.half_q) {
    at::BFloat16* o = static_cast<at::BFloat16*>(P.out) + base;
    for (int64_t d = 0; d < P.D; ++d) o[d] = at::BFloat16(src[d] * mul);
  } else {
    float* o = static_cast<float*>(P.out) + base;
    for (int64_t d = 0; d < P.D; ++d) o[d] = src[d] * mul;
  }
}

// Element offsets of the K/V rows (kv head 0) of key positions c0 .. c0+cn-1 of sequence s.
template <typename kv_t>
inline void chunk_offsets(const Problem<kv_t>& P, int64_t s, int64_t c0, int64_t cn, int64_t* base) {
  const int32_t* bt = P.block_tables + s * P.MB;
  const int64_t row = P.KVH * P.RL;
  int64_t b = c0 / P.BS, o = c0 % P.BS;
  for (int64_t t = 0; t < cn; ++t) {
    base[t] = (static_cast<int64_t>(bt[b]) * P.BS + o) * row;
    if (++o == P.BS) o = 0, ++b;
  }
}

// Points krow/vrow[t] at the fp32 K/V rows of kv head g for the chunk's keys, converting into kbuf/vbuf
// when the cache is not fp32.
template <typename kv_t>
inline void gather_rows(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t g, float* kbuf,
                        float* vbuf, const float** krow, const float** vrow) {
  for (int64_t t = 0; t < cn; ++t) {
    const int64_t off = base[t] + g * P.RL;
    if constexpr (std::is_same_v<kv_t, float>) {
      krow[t] = P.k + off;
      vrow[t] = P.v + off;
    } else {
      rows_to_f32(P.k + off, kbuf + t * P.D, P.D, 1);
      rows_to_f32(P.v + off, vbuf + t * P.D, P.D, 1);
      krow[t] = kbuf + t * P.D;
      vrow[t] = vbuf + t * P.D;
    }
  }
}

// Prefetches `bytes` starting at p into L2 (the rows of a token that the next pass will read). Always inlined:
// called through a lambda that GCC did not inline, the call was judged free of side effects and the prefetches
// were dropped (the decode kernel then ran 1.9x slower from memory).
__attribute__((always_inline)) inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

#if defined(__AVX512BF16__)
// Lane t of the result = the sum of the 16 lanes of v[t]: four rounds, each adding two halves of a pair of
// vectors into one (15 adds, 30 shuffles and one permute for 16 sums, against 16 horizontal sums of 8 steps).
inline __m512 sum_lanes_16(__m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // r[i]: lanes 0-7 fold v[2i], lanes 8-15 fold v[2i+1]
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // s[i]: 128-bit block b folds token 4i + b
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // u[i]: block b holds two partials of tokens 8i + b and 8i + 4 + b
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  // block b, lane i: token b + 4i
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i to_token = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(to_token, w);
}

// out[t] = mul * (q . k[t]) for 16 keys of D bf16 values (D % 32 == 0): products of bf16 pairs, exact in fp32,
// summed into fp32 lanes by vdpbf16ps, so the keys are never converted.
inline void scores_bf16_16(const uint16_t* q, const uint16_t* const* krow, int64_t D, float mul, float* out) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_loadu_si512(krow[t] + d));
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(mul)));
}
#endif

// 16 fp32 values of a V row, from fp32 or (converted in registers) bf16.
inline v16 load16(const float* p) { return vload(p); }
inline v16 load16(const at::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v16)(__builtin_convertvector(h, vi16) << 16);
}

// O[rb][d0..d0+16W) = O * alpha[rb] + sum_t P[t * ts + rb * rs] * V[t][d0..) for RB rows rb (row stride D).
template <int RB, int W, typename row_t>
inline void pv_micro(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                     const row_t* const* vrow, int64_t d0, int64_t cn) {
  v16 acc[RB][W];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = vload(O + r * D + 16 * w) * alpha[r];
  for (int64_t t = 0; t < cn; ++t) {
    v16 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = load16(vrow[t] + d0 + 16 * w);
    for (int r = 0; r < RB; ++r) {
      const float pt = P[t * ts + r * rs];
      for (int w = 0; w < W; ++w) acc[r][w] += pt * vv[w];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < W; ++w) vstore(O + r * D + 16 * w, acc[r][w]);
}

// pv_micro over `rows` rows (any count) and the whole head_dim.
template <typename row_t>
inline void pv_rows(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                    const row_t* const* vrow, int64_t cn, int64_t rows) {
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t rb = std::min<int64_t>(4, rows - r);
    float* o = O + r * D;
    const float* a = alpha + r;
    const float* p = P + r * rs;
    for (int64_t d0 = 0; d0 < D;) {
      if (D - d0 >= 64) {
        switch (rb) {
          case 4: pv_micro<4, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 3: pv_micro<3, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 2: pv_micro<2, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          default: pv_micro<1, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        }
        d0 += 64;
      } else {
        switch (rb) {
          case 4: pv_micro<4, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 3: pv_micro<3, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 2: pv_micro<2, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          default: pv_micro<1, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        }
        d0 += 16;
      }
    }
  }
}

// Whether attend_rows computes scores straight from bf16 queries and keys (vdpbf16ps), with no conversion.
template <typename kv_t>
inline bool bf16_scores(const Problem<kv_t>& P) {
#if defined(__AVX512BF16__)
  return std::is_same_v<kv_t, at::BFloat16> && P.half_q && P.D % 32 == 0;
#else
  return false;
#endif
}

// Scores S[row][t] of one chunk, token-major over fp32 rows: each token's K rows (all kv heads of the item) are
// converted once and dotted with every query row of their group. Rows whose query precedes key t get -inf.
template <typename kv_t, typename F>
void chunk_scores_f32(const Problem<kv_t>& P, const WorkItem& w, const float* q, const int64_t* base, int64_t cn,
                      int64_t c0, int64_t first_pos, float* kbuf, float* S, F&& prefetch) {
  const int64_t D = P.D, G = P.G, R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin;
  const int64_t head_off = w.kv_begin * P.RL;
  for (int64_t t = 0; t < cn; ++t) {
    prefetch(t);
    const float* kt;
    if constexpr (std::is_same_v<kv_t, float>) {
      kt = P.k + base[t] + head_off;
    } else {
      rows_to_f32(P.k + base[t] + head_off, kbuf, D, ng);
      kt = kbuf;
    }
    for (int64_t gi = 0; gi < ng; ++gi) {
      const float* kr = kt + gi * D;
      for (int64_t ii = 0; ii < R; ++ii) {
        const bool visible = c0 + t <= first_pos + ii;
        for (int64_t j = 0; j < G; ++j) {
          const int64_t row = (gi * R + ii) * G + j;
          const float* qr = q + row * D;
          v16 a = vload(qr) * vload(kr);
          for (int64_t d = 16; d < D; d += 16) a += vload(qr + d) * vload(kr + d);
          S[row * kRowsChunk + t] = visible ? hsum(a) : kNegInf;
        }
      }
    }
  }
}

// The same scores from bf16 queries (qh, unscaled) and keys, 16 keys at a time per row (see scores_bf16_16).
// Keys past the chunk read `zero`; entries a query must not see are left to the softmax's `valid` bound.
// `prefetch(t)` is called for t = 0 .. cn-1, spread between the score computations.
template <typename kv_t, typename F>
void chunk_scores_bf16(const Problem<kv_t>& P, const WorkItem& w, const uint16_t* qh, const int64_t* base,
                       int64_t cn, const uint16_t* zero, float* S, F&& prefetch) {
#if defined(__AVX512BF16__)
  const int64_t D = P.D, G = P.G, R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin;
  const int64_t calls = (cn + 15) / 16 * ng * R * G, per_call = (cn + calls - 1) / calls;
  const uint16_t* k = reinterpret_cast<const uint16_t*>(P.k);
  int64_t pt = 0;
  for (int64_t t0 = 0; t0 < cn; t0 += 16) {
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t head_off = (w.kv_begin + gi) * P.RL;
      const uint16_t* krow[16];
      for (int64_t t = 0; t < 16; ++t) krow[t] = t0 + t < cn ? k + base[t0 + t] + head_off : zero;
      for (int64_t r = gi * R * G; r < (gi + 1) * R * G; ++r) {
        for (const int64_t end = std::min(cn, pt + per_call); pt < end; ++pt) prefetch(pt);
        scores_bf16_16(qh + r * D, krow, D, P.scale_log2, S + r * kRowsChunk + t0);
      }
    }
  }
#else
  (void)P, (void)w, (void)qh, (void)base, (void)cn, (void)zero, (void)S, (void)prefetch;
#endif
}

// Decodes and short chunks: rows = (query, head) pairs, scores as dot products over head_dim. Keys and
// values are read token-major (a token's rows for all kv heads of the item are adjacent in the cache);
// the next chunk's keys and this chunk's values are prefetched while the scores are computed.
template <typename kv_t>
void attend_rows(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc) {
  const int64_t D = P.D, G = P.G, s = w.seq;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin, NR = R * G * ng, RG = R * G;
  const int64_t first_pos = L - n + w.q_begin, last_pos = L - n + w.q_end - 1;
  const int64_t span = ng * D;  // fp32 elements of one token's rows for this item's kv heads
  const int64_t span_bytes = ng * P.RL * static_cast<int64_t>(sizeof(kv_t));  // the same rows in the cache
  constexpr int64_t C = kRowsChunk;
  const bool bf16 = bf16_scores(P);

  size_t off = 0;
  float* q = sc.take(NR * D, off);  // fp32 rows scaled to log2 units, or (bf16) the raw bf16 rows
  float* acc = sc.take(NR * D, off);
  float* m = sc.take(NR, off);
  float* l = sc.take(NR, off);
  float* alpha = sc.take(NR, off);
  float* S = sc.take(NR * C, off);  // S[row][t]: scores, then probabilities
  float* kbuf = sc.take(span, off);  // (bf16: a zero row for the keys past a chunk's end)
  float* vbuf = sc.take(C * span, off);
  int64_t base_buf[2][C];
  const float** vrow = sc.vrow.data();
  uint16_t* qh = reinterpret_cast<uint16_t*>(q);
  const uint16_t* zero = reinterpret_cast<const uint16_t*>(kbuf);

  // row = (gi * R + ii) * G + j  <->  query tok0 + ii, head (kv_begin + gi) * G + j
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j, head = (w.kv_begin + gi) * G + j;
        if (bf16) {
          const auto* src = static_cast<const uint16_t*>(P.q) + (tok0 + ii) * P.q_stride0 + head * P.q_stride1;
          std::memcpy(qh + row * D, src, D * sizeof(uint16_t));
        } else {
          for (int64_t d = 0; d < D; ++d) q[row * D + d] = q_at(P, tok0 + ii, head, d) * P.scale_log2;
        }
      }
  if (bf16) std::fill(kbuf, kbuf + D, 0.0f);
  std::fill(acc, acc + NR * D, 0.0f);
  std::fill(m, m + NR, kNegInf);
  std::fill(l, l + NR, 0.0f);
  const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t head_off = w.kv_begin * P.RL;

  chunk_offsets(P, s, 0, std::min(C, last_pos + 1), base_buf[0]);
  for (int64_t c0 = 0, ci = 0; c0 <= last_pos; c0 += C, ci ^= 1) {
    const int64_t cn = std::min(C, last_pos + 1 - c0);
    const int64_t* base = base_buf[ci];
    const int64_t next_cn = std::max<int64_t>(0, std::min(C, last_pos + 1 - c0 - C));
    if (next_cn > 0) chunk_offsets(P, s, c0 + C, next_cn, base_buf[ci ^ 1]);
    // This chunk's values and the next chunk's keys, fetched while the scores are computed.
    const auto prefetch = [&](int64_t t) __attribute__((always_inline)) {
      prefetch_l2(P.v + base[t] + head_off, span_bytes);
      if (t < next_cn) prefetch_l2(P.k + base_buf[ci ^ 1][t] + head_off, span_bytes);
    };
    if (bf16)
      chunk_scores_bf16(P, w, qh, base, cn, zero, S, prefetch);
    else
      chunk_scores_f32(P, w, q, base, cn, c0, first_pos, kbuf, S, prefetch);

    // Online softmax per row over this chunk; masked and padding entries become exact zeros.
    for (int64_t row = 0; row < NR; ++row) {
      const int64_t ii = (row / G) % R;
      const int64_t valid = std::min(cn, first_pos + ii + 1 - c0);
      float* sr = S + row * C;
      if (valid <= 0) {
        alpha[row] = 1.0f;
        std::fill(sr, sr + C, 0.0f);
        continue;
      }
      v16 mxv = vset(m[row]);
      for (int64_t t = 0; t < C; t += 16) {
        const v16 x = vload(sr + t);
        mxv = vmax(mxv, (iota + static_cast<int32_t>(t)) < viset(static_cast<int32_t>(valid)) ? x : vset(kNegInf));
      }
      const float mx = hmax(mxv);
      v16 sum = {};
      for (int64_t t = 0; t < C; t += 16) {
        const v16 e = vexp2(vload(sr + t) - mx);
        const v16 pv = (iota + static_cast<int32_t>(t)) < viset(static_cast<int32_t>(valid)) ? e : v16{};
        vstore(sr + t, pv);
        sum += pv;
      }
      alpha[row] = std::exp2(m[row] - mx);
      l[row] = l[row] * alpha[row] + hsum(sum);
      m[row] = mx;
    }

    // Values: acc = acc * alpha + P V, one kv head at a time, accumulators in registers; fp32 and bf16 rows are
    // read in place, int8 records converted first.
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t r0 = gi * RG, off_g = head_off + gi * P.RL;
      if constexpr (std::is_same_v<kv_t, uint8_t>) {
        if (gi == 0)
          for (int64_t t = 0; t < cn; ++t) rows_to_f32(P.v + base[t] + head_off, vbuf + t * span, D, ng);
        for (int64_t t = 0; t < cn; ++t) vrow[t] = vbuf + t * span + gi * D;
        pv_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, 1, C, vrow, cn, RG);
      } else {
        const kv_t* rows[C];
        for (int64_t t = 0; t < cn; ++t) rows[t] = P.v + base[t] + off_g;
        pv_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, 1, C, rows, cn, RG);
      }
    }
  }
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j;
        store_out(P, tok0 + ii, (w.kv_begin + gi) * G + j, acc + row * D, 1.0f / l[row]);
      }
}

// ST[t][rows] = sum_d K[t][d] * Qt[d][rows] for kTB keys and RW vectors of 16 rows.
template <int RW>
inline void qk_micro(const float* const* krow, const float* Qt, int64_t Mp, int64_t D, float* ST) {
  v16 acc[kTB][RW] = {};
  for (int64_t d = 0; d < D; ++d) {
    v16 qv[RW];
    for (int r = 0; r < RW; ++r) qv[r] = vload(Qt + d * Mp + 16 * r);
    for (int t = 0; t < kTB; ++t) {
      const float kv = krow[t][d];
      for (int r = 0; r < RW; ++r) acc[t][r] += kv * qv[r];
    }
  }
  for (int t = 0; t < kTB; ++t)
    for (int r = 0; r < RW; ++r) vstore(ST + t * Mp + 16 * r, acc[t][r]);
}

// Prompt chunks: a tile of queries [q_begin, q_end) x the G query heads of one kv head.
template <typename kv_t>
void attend_tile(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc) {
  const int64_t D = P.D, G = P.G, s = w.seq, g = w.kv_begin;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, M = R * G, Mp = (M + 15) / 16 * 16, RV = Mp / 16;
  const int64_t first_pos = L - n + w.q_begin, last_pos = L - n + w.q_end - 1;

  size_t off = 0;
  float* Qt = sc.take(D * Mp, off);
  float* O = sc.take(Mp * D, off);
  float* m = sc.take(Mp, off);
  float* l = sc.take(Mp, off);
  float* alpha = sc.take(Mp, off);
  int32_t* pos = sc.pos.data();
  float* ST = sc.take(kTileChunk * Mp, off);
  float* kbuf = sc.take(kTileChunk * D, off);
  float* vbuf = sc.take(kTileChunk * D, off);
  float* zero = sc.take(D, off);
  int64_t base[kTileChunk];
  const float** krow = sc.krow.data();
  const float** vrow = sc.vrow.data();

  // row r = ii * G + j  <->  query tok0 + ii, head g * G + j. Padding rows: zero queries, never masked.
  std::fill(Qt, Qt + D * Mp, 0.0f);
  for (int64_t ii = 0; ii < R; ++ii)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t d = 0; d < D; ++d) Qt[d * Mp + ii * G + j] = q_at(P, tok0 + ii, g * G + j, d) * P.scale_log2;
  for (int64_t r = 0; r < Mp; ++r)
    pos[r] = r < M ? static_cast<int32_t>(first_pos + r / G) : std::numeric_limits<int32_t>::max();
  std::fill(O, O + Mp * D, 0.0f);
  std::fill(m, m + Mp, kNegInf);
  std::fill(l, l + Mp, 0.0f);
  std::fill(zero, zero + D, 0.0f);

  for (int64_t c0 = 0; c0 <= last_pos; c0 += kTileChunk) {
    const int64_t cn = std::min(kTileChunk, last_pos + 1 - c0);
    chunk_offsets(P, s, c0, cn, base);
    gather_rows(P, base, cn, g, kbuf, vbuf, krow, vrow);
    const int64_t cn_padded = (cn + kTB - 1) / kTB * kTB;
    for (int64_t t = cn; t < cn_padded; ++t) krow[t] = zero;
    // Row vectors whose rows all sit before this chunk take no part in it.
    const int64_t rv0 = std::max<int64_t>(0, (c0 - first_pos) * G) / 16;
    const bool masked = c0 + cn - 1 > first_pos;

    for (int64_t t0 = 0; t0 < cn_padded; t0 += kTB) {
      int64_t rv = rv0;
      for (; rv + 4 <= RV; rv += 4) qk_micro<4>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16);
      switch (RV - rv) {
        case 3: qk_micro<3>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
        case 2: qk_micro<2>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
        case 1: qk_micro<1>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
        default: break;
      }
    }

    for (int64_t rv = rv0; rv < RV; ++rv) {
      const int64_t r0 = rv * 16;
      const vi16 pv = [&] { vi16 x; std::memcpy(&x, pos + r0, sizeof(x)); return x; }();
      const v16 m_old = vload(m + r0);
      v16 mx = m_old;
      if (masked) {
        for (int64_t t = 0; t < cn; ++t) {
          const v16 sv = viset(static_cast<int32_t>(c0 + t)) <= pv ? vload(ST + t * Mp + r0) : vset(kNegInf);
          vstore(ST + t * Mp + r0, sv);
          mx = vmax(mx, sv);
        }
      } else {
        for (int64_t t = 0; t < cn; ++t) mx = vmax(mx, vload(ST + t * Mp + r0));
      }
      v16 sum = {};
      for (int64_t t = 0; t < cn; ++t) {
        v16 e = vexp2(vload(ST + t * Mp + r0) - mx);
        if (masked) e = viset(static_cast<int32_t>(c0 + t)) <= pv ? e : v16{};
        vstore(ST + t * Mp + r0, e);
        sum += e;
      }
      const v16 a = vexp2(m_old - mx);
      vstore(alpha + r0, a);
      vstore(l + r0, vload(l + r0) * a + sum);
      vstore(m + r0, mx);
    }

    const int64_t r0 = rv0 * 16;
    pv_rows(O + r0 * D, D, alpha + r0, ST + r0, Mp, 1, vrow, cn, Mp - r0);
  }
  for (int64_t ii = 0; ii < R; ++ii)
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = ii * G + j;
      store_out(P, tok0 + ii, g * G + j, O + r * D, 1.0f / l[r]);
    }
}

template <typename kv_t>
void run(const Problem<kv_t>& P, const std::vector<WorkItem>& items, size_t scratch_floats, size_t tile_rows) {
  std::atomic<size_t> next{0};
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    Scratch sc;
    sc.buf.resize(scratch_floats);
    sc.pos.resize(tile_rows);
    sc.krow.resize(std::max(kRowsChunk, kTileChunk));
    sc.vrow.resize(std::max(kRowsChunk, kTileChunk));
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
      if (items[i].tiled)
        attend_tile(P, items[i], sc);
      else
        attend_rows(P, items[i], sc);
    }
  });
}

}  // namespace

// See pagedllm/attention.py:paged_attention for the contract. tile_min_rows: sequences with at least this many
// query rows (queries x query heads per kv head) use the tiled (prefill) kernel, the others the row kernel.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                              int64_t tile_min_rows) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be 3-d, caches 4-d");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 || int8_cache,
              "caches must be float32, bfloat16 or uint8 (int8 records)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, context_lens, query_start_loc must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "block_tables [S, max_blocks], context_lens [S], query_start_loc [S+1] must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t S = block_tables.size(0), MB = block_tables.size(1);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  if (int8_cache) {
    TORCH_CHECK(D % kKvGroup == 0, "int8 cache: head_dim must be a multiple of ", kKvGroup);
    TORCH_CHECK(k_cache.size(3) == row_len<uint8_t>(D), "int8 cache: rows must be head_dim + 4 * head_dim / ",
                kKvGroup, " bytes");
  } else {
    TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and cache differ");
  }
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(context_lens.numel() == S && query_start_loc.numel() == S + 1, "batch sizes disagree");
  TORCH_CHECK(tile_min_rows >= 1, "tile_min_rows must be >= 1");

  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t G = H / KVH;
  TORCH_CHECK(S == 0 || (qsl[0] >= 0 && qsl[S] <= T), "query_start_loc out of range");
  std::vector<WorkItem> items;
  std::vector<int32_t> row_items;  // indices of decode-like items, split over kv heads when work is scarce
  size_t rows_max_R = 0, tile_max_M = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], L = ctx[s];
    TORCH_CHECK(n >= 0 && n <= max_query_len, "sequence ", s, ": bad query count ", n);
    if (n == 0) continue;
    TORCH_CHECK(L >= n, "sequence ", s, ": context_len ", L, " < its query count ", n);
    const int64_t nblocks = (L + BS - 1) / BS;
    TORCH_CHECK(nblocks <= MB, "sequence ", s, ": block table too short for context ", L);
    for (int64_t b = 0; b < nblocks; ++b)
      TORCH_CHECK(bt[s * MB + b] >= 0 && bt[s * MB + b] < NB, "sequence ", s, ": block id out of range");
    if (n * G >= tile_min_rows) {
      const int64_t qt = std::max<int64_t>(1, kTileRows / G);
      for (int64_t i0 = 0; i0 < n; i0 += qt) {
        const int64_t i1 = std::min(n, i0 + qt);
        tile_max_M = std::max<size_t>(tile_max_M, (i1 - i0) * G);
        for (int64_t g = 0; g < KVH; ++g) {
          const double cost = double((i1 - i0) * G) * double(L - n + i1);
          items.push_back({int32_t(s), int32_t(i0), int32_t(i1), int32_t(g), int32_t(g + 1), true, cost});
        }
      }
    } else {
      rows_max_R = std::max<size_t>(rows_max_R, n);
      row_items.push_back(int32_t(items.size()));
      items.push_back({int32_t(s), 0, int32_t(n), 0, int32_t(KVH), false, double(n * H) * double(L)});
    }
  }
  // Too few tasks to keep every thread busy: give each kv head of a decode its own task.
  if (KVH > 1 && !row_items.empty() && int64_t(items.size()) < 4 * at::get_num_threads()) {
    for (int32_t idx : row_items) {
      items[idx].kv_end = 1;
      items[idx].cost /= KVH;
      const WorkItem head0 = items[idx];  // a copy: push_back below may reallocate
      for (int64_t g = 1; g < KVH; ++g) {
        WorkItem x = head0;
        x.kv_begin = int32_t(g);
        x.kv_end = int32_t(g + 1);
        items.push_back(x);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const size_t pad = 16;
  const size_t NR = rows_max_R * H;
  const size_t span = KVH * D;
  const size_t rows_floats = 2 * (NR * D + pad) + 3 * (NR + pad) + (NR * kRowsChunk + pad) + (span + pad) +
                             (kRowsChunk * span + pad);
  const size_t Mp = (tile_max_M + 15) / 16 * 16;
  const size_t tile_floats = 2 * (Mp * D + pad) + 3 * (Mp + pad) + (kTileChunk * Mp + pad) +
                             2 * (kTileChunk * D + pad) + (D + pad);
  const size_t scratch_floats = std::max(rows_floats, tile_floats);

  auto out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (S == 0) return out.zero_();
  if (qsl[0] > 0) out.narrow(0, 0, qsl[0]).zero_();
  if (qsl[S] < T) out.narrow(0, qsl[S], T - qsl[S]).zero_();
  if (items.empty()) return out;

  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const bool half_q = q.scalar_type() == at::kBFloat16;
  if (k_cache.scalar_type() == at::kFloat) {
    const Problem<float> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, ctx, qsl,
                           H, KVH, G, D, BS, MB, scale_log2};
    run(P, items, scratch_floats, Mp);
  } else if (int8_cache) {
    const Problem<uint8_t> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                             k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), bt, ctx, qsl,
                             H, KVH, G, D, BS, MB, scale_log2};
    run(P, items, scratch_floats, Mp);
  } else {
    const Problem<at::BFloat16> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                                  k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), bt, ctx,
                                  qsl, H, KVH, G, D, BS, MB, scale_log2};
    run(P, items, scratch_floats, Mp);
  }
  return out;
}

namespace {

// One kv-head row of D values to an int8 record: per group, min and (max - min) / 255 rounded to fp16 first, so
// that the values are quantised against exactly the parameters stored.
template <typename T>
void quantize_row(const T* x, uint8_t* rec, int64_t D) {
  uint8_t* params = rec + D;
  for (int64_t g = 0; g < D; g += kKvGroup) {
    float lo = static_cast<float>(x[g]), hi = lo;
    for (int64_t i = g + 1; i < g + kKvGroup; ++i) {
      const float v = static_cast<float>(x[i]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const at::Half sm[2] = {at::Half((hi - lo) / 255.0f), at::Half(lo)};
    std::memcpy(params + g / kKvGroup * sizeof(sm), sm, sizeof(sm));
    const float scale = static_cast<float>(sm[0]), mn = static_cast<float>(sm[1]);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = g; i < g + kKvGroup; ++i) {
      const float qv = std::nearbyint((static_cast<float>(x[i]) - mn) * inv);
      rec[i] = static_cast<uint8_t>(std::clamp(qv, 0.0f, 255.0f));
    }
  }
}

// The rows of x [T, KVH, D] (last dim contiguous) to their slots of the cache: copied (same dtype), or quantised
// into int8 records (uint8 cache).
template <typename T, typename C>
void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = x.size(0), KVH = x.size(1), D = x.size(2), RL = cache.size(3);
  const T* src = x.data_ptr<T>();
  C* dst = cache.data_ptr<C>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        C* rec = dst + (slots[t] * KVH + h) * RL;
        if constexpr (std::is_same_v<C, uint8_t>)
          quantize_row(src + t * s0 + h * s1, rec, D);
        else
          std::memcpy(rec, src + t * s0 + h * s1, D * sizeof(T));
      }
  });
}

}  // namespace

// Stores the step's keys and values [T, num_kv_heads, head_dim] (last dim contiguous) at their cache slots
// (block_id * block_size + offset), in place: copied into a float32 / bfloat16 cache of their own dtype, quantised
// into an int8 (uint8 records) one.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, num_kv_heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k and v must be float32 or bfloat16");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (int8_cache || k_cache.scalar_type() == k.scalar_type()),
              "the cache must be k's dtype, or uint8 (int8 records)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, row]");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(2) == KVH && (int8_cache ? D % kKvGroup == 0 && k_cache.size(3) == row_len<uint8_t>(D)
                                                    : k_cache.size(3) == D),
              "cache rows do not match k's heads and head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping must be T contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  if (k.scalar_type() == at::kFloat) {
    if (int8_cache) {
      store_rows<float, uint8_t>(k, k_cache, slots);
      store_rows<float, uint8_t>(v, v_cache, slots);
    } else {
      store_rows<float, float>(k, k_cache, slots);
      store_rows<float, float>(v, v_cache, slots);
    }
  } else if (int8_cache) {
    store_rows<at::BFloat16, uint8_t>(k, k_cache, slots);
    store_rows<at::BFloat16, uint8_t>(v, v_cache, slots);
  } else {
    store_rows<at::BFloat16, at::BFloat16>(k, k_cache, slots);
    store_rows<at::BFloat16, at::BFloat16>(v, v_cache, slots);
  }
}
