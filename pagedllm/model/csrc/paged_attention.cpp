// Paged attention on the CPU: a flat batch of queries (decodes and prompt chunks mixed) attends over a
// paged KV cache laid out [num_blocks, block_size, num_kv_heads, head_dim].
//
// Two kernels, both with online softmax and fp32 accumulation, both reading keys in chunks of consecutive
// positions that may span blocks (so any block size, down to 1, costs the same):
//  - attend_rows: decodes and very short chunks. Memory bound: each K/V row is read once for all query heads
//    of its kv group, scores are dot products. Over a bf16 cache its own version, attend_rows_bf16, scores 8 keys x
//    3 query heads per pass over the stored rows (bf16 queries: vdpbf16ps, on AVX512-BF16; fp32 queries: fp32 FMA
//    over K rows widened in registers, on AVX-512) and converts V rows in registers: no row is copied to fp32
//    first. Few long decodes are split into context partitions (flash-decoding), merged exactly.
//  - attend_tile: prompt chunks. Compute bound: a tile of queries x (one kv head's query heads) is held
//    transposed, so scores for a chunk of keys come out as S^T[key][row] with rows in vector lanes; the
//    softmax then needs no horizontal reductions and no [T, T] matrix is ever formed. Over a bf16 cache with
//    bf16 queries (AVX512-BF16) both products run on vdpbf16ps (tile_bf16.h).
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
#include <memory>
#include <type_traits>
#include <vector>

#include "exp2_poly.h"
#include "tile_bf16.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

constexpr int64_t kKvGroup = 16;  // int8 cache: values per (scale, min) pair

constexpr int64_t kRowsChunk = 32;  // keys per softmax step in attend_rows
constexpr int64_t kPrefetchKeys = 64;  // attend_rows_bf16: how far ahead keys and values are prefetched
constexpr int64_t kValueKeys = 8;      // attend_rows_bf16: keys per pass over the values, kv heads inner (bf16 q)
constexpr int64_t kSplitPerThread = 4;  // few decodes: context partitions per thread
constexpr int64_t kMinPartKeys = 128;   // ... of at least this many keys
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

// A decode whose context is split into partitions (flash-decoding): each partition's item leaves its rows'
// unnormalised output, running max and sum in its slot of `partial`; the last of them to finish merges them all.
struct SplitGroup {
  int32_t first_slot, parts;
  std::atomic<int32_t> left;  // partitions not finished yet
};

struct Splits {
  float* partial = nullptr;  // per slot: acc [rows][D], then m [rows], then l [rows]
  int64_t slot_floats = 0;
  SplitGroup* groups = nullptr;
};

// One call's inputs, shared read-only by all tasks (but for the split partitions' slots and counters).
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
  Splits split;
  bool tile_pairs = true;  // attend_tile may run on vdpbf16ps (bf16_tile); false: its fp32 kernel (measured choice)
  int64_t RL = row_len<kv_t>(D);  // cache elements per kv head and token
};

// Queries [q_begin, q_end) of one sequence against kv heads [kv_begin, kv_end) and key positions
// [k_begin, k_end) (the whole context unless the item is partition `part` of split group `group`).
struct WorkItem {
  int32_t seq, q_begin, q_end, kv_begin, kv_end;
  bool tiled;
  double cost;
  int32_t k_begin = 0, k_end = std::numeric_limits<int32_t>::max(), part = -1, group = -1;
};

// A thread's claim on the item it runs next, taken while the current one ends so that its first keys and values
// can be prefetched meanwhile (taken earlier, a thread could hold both items of a two-item call).
struct Claim {
  std::atomic<size_t>* next;
  const std::vector<WorkItem>* items;
  size_t index = 0;
  bool taken = false;
  const WorkItem* take() {
    index = next->fetch_add(1);
    taken = true;
    return index < items->size() ? &(*items)[index] : nullptr;
  }
};

// Per-thread buffers, sized once per call for the largest work item and reused across items.
struct Scratch {
  std::vector<float> buf;
  std::vector<int32_t> pos;  // attend_tile: position of each query row
  std::vector<const float*> krow, vrow;
  std::vector<int32_t> slots;  // attend_rows_bf16: cache slots of the item's keys
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

// Cache slots (block * block_size + offset) of key positions c0 .. c0+cn-1 of sequence s.
template <typename kv_t>
inline void slot_range(const Problem<kv_t>& P, int64_t s, int64_t c0, int64_t cn, int32_t* slot) {
  const int32_t* bt = P.block_tables + s * P.MB;
  const int32_t BS = static_cast<int32_t>(P.BS);
  int64_t b = c0 / BS;
  int32_t o = static_cast<int32_t>(c0 % BS);
  for (int64_t t = 0; t < cn; ++t) {
    slot[t] = bt[b] * BS + o;
    if (++o == BS) o = 0, ++b;
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

#if defined(__AVX512F__)
// Lane t of the result = the sum of the 8 lanes of v[t]: 14 shuffles and 7 adds for 8 sums.
__attribute__((always_inline)) inline __m256 sum_lanes_8(const __m256* v) {
  __m256 s[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: lanes 0+2 of v[2i], v[2i+1], then lanes 1+3 of both
    s[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit half: the half's sums of v[4i .. 4i+3]
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

#if defined(__AVX512BF16__)
// S[r * C + t] = mul * (q_r . k_t) for RB query rows (bf16, row stride D) and 8 keys, D = 32 * DW bf16 values
// (DW = 0: D given at run time). Each 16-value piece of a key is loaded once for the RB rows; vdpbf16ps on 256-bit
// vectors leaves 8 lanes per score to sum, half of what 512-bit ones would.
template <int DW, int RB>
__attribute__((always_inline)) inline void scores_8(const uint16_t* q, const uint16_t* const* krow, int64_t D_,
                                                    float mul, float* S, int64_t C) {
  const int64_t D = DW > 0 ? 32 * DW : D_;
  __m256 acc[RB][8];
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t)
    for (int r = 0; r < RB; ++r) acc[r][t] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < D; j += 16) {
    __m256bh qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * D + j));
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256bh kv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[t] + j));
      for (int r = 0; r < RB; ++r) acc[r][t] = _mm256_dpbf16_ps(acc[r][t], qv[r], kv);
    }
  }
  for (int r = 0; r < RB; ++r) _mm256_storeu_ps(S + r * C, _mm256_mul_ps(sum_lanes_8(acc[r]), _mm256_set1_ps(mul)));
}
#endif

// The same for RB fp32 query rows, already scaled and laid out as 32 floats per 16 values of D: their 8 even values
// twice, then their 8 odd ones twice. Keys go in pairs, 16 values of each in one half of a vector, widened in
// registers (a bf16 is the top half of an fp32: a shift gives the even values, a mask the odd ones) and dotted with
// the rows by fp32 FMA; each pair's two sets of 8 partial sums then take 3 shuffle-and-add steps (plus one
// permutation per two rows) to become the scores, a third of what reducing each key's own 16 lanes costs.
template <int DW, int RB>
__attribute__((always_inline)) inline void scores_8(const float* q, const uint16_t* const* krow, int64_t D_,
                                                    float* S, int64_t C) {
  const int64_t D = DW > 0 ? 32 * DW : D_;
  const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < 4; ++p) acc[r][p] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < D; j += 16) {
    __m512 qe[RB], qo[RB];
    for (int r = 0; r < RB; ++r) {
      qe[r] = _mm512_loadu_ps(q + r * 2 * D + 2 * j);
      qo[r] = _mm512_loadu_ps(q + r * 2 * D + 2 * j + 16);
    }
    for (int p = 0; p < 4; ++p) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[2 * p] + j));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[2 * p + 1] + j));
      const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
      for (int r = 0; r < RB; ++r) acc[r][p] = _mm512_fmadd_ps(qo[r], ko, _mm512_fmadd_ps(qe[r], ke, acc[r][p]));
    }
  }
  __m512 h[RB];
  for (int r = 0; r < RB; ++r) {  // acc[r][p]: 8 partial sums of key 2p, then 8 of key 2p + 1
    // 128-bit lane i: 4 partial sums of key i (a) or 4 + i (b)
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0x88),
                                   _mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0xDD));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0x88),
                                   _mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0xDD));
    h[r] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));  // 2 of key i, 2 of 4 + i
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int r = 0; r < RB; r += 2) {
    const __m512 g = h[r], u = h[r + 1 < RB ? r + 1 : r];
    // lane 4i + c: key i of row r (c = 0), key 4 + i of row r (1), the same of row r + 1 (2, 3)
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(g, u, 0x88), _mm512_shuffle_ps(g, u, 0xDD));
    const __m512 o = _mm512_permutexvar_ps(order, sums);
    _mm256_storeu_ps(S + r * C, _mm512_castps512_ps256(o));
    if (r + 1 < RB) _mm256_storeu_ps(S + (r + 1) * C, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o), 1)));
  }
}

// O[r] = O[r] * alpha[r] (no alpha: 1) + sum_t P[r * C + t] * V[t] for RB rows, over the 32 * JW values of V
// from d0, prefetching pf[t] (pf_bytes each) for t < pfn along the way. A V row's bf16 pairs become fp32 in
// registers by a shift (the even values) and a mask (the odd ones), so O holds each block of 32 values as its 16
// even ones, then its 16 odd ones (unpermuted when the item ends).
template <int JW, int RB>
__attribute__((always_inline)) inline void pv_bf16(float* O, int64_t D, const float* alpha, const float* P,
                                                   int64_t C, const uint16_t* const* vrow, int64_t d0, int64_t cn,
                                                   const uint16_t* const* pf, int64_t pfn, int64_t pf_bytes) {
  __m512 acc[RB][2 * JW];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * JW; ++i) {
      acc[r][i] = _mm512_loadu_ps(O + r * D + d0 + 16 * i);
      if (alpha) acc[r][i] = _mm512_mul_ps(acc[r][i], _mm512_set1_ps(alpha[r]));
    }
  const __m512i odd = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t t = 0; t < cn; ++t) {
    if (t < pfn) prefetch_l2(pf[t], pf_bytes);
    __m512 v[2 * JW];
    for (int j = 0; j < JW; ++j) {
      const __m512i x = _mm512_loadu_si512(vrow[t] + d0 + 32 * j);
      v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * C + t]);
      for (int i = 0; i < 2 * JW; ++i) acc[r][i] = _mm512_fmadd_ps(p, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < 2 * JW; ++i) _mm512_storeu_ps(O + r * D + d0 + 16 * i, acc[r][i]);
}

#endif

#include "rows_int8.h"  // scores_8_int8 and pv_int8_rows, on AVX-512

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"  // dot_rows and pv_rows in 8-float vectors
#else
// q . k over D values (D % 16 == 0).
inline float dot_rows(const float* q, const float* k, int64_t D) {
  v16 a = vload(q) * vload(k);
  for (int64_t d = 16; d < D; d += 16) a += vload(q + d) * vload(k + d);
  return hsum(a);
}

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
#endif

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
          S[row * kRowsChunk + t] = visible ? dot_rows(q + row * D, kr, D) : kNegInf;
        }
      }
    }
  }
}

// Online softmax over one chunk's scores S[row][0 .. kRowsChunk) of the rows row = (gi * R + ii) * G + j: query ii
// (position first_pos + ii) sees the keys c0 .. first_pos + ii of the chunk's cn; the others, and padding, become
// exact zeros. alpha[row]: the factor that brings the row's earlier sums to the new running max m[row], computed
// for all rows at once after the loop (a scalar exp2 per row and chunk cost as much as the rest). `sums`: NR floats.
inline void softmax_chunk(float* S, float* m, float* l, float* alpha, float* sums, int64_t NR, int64_t R, int64_t G,
                          int64_t cn, int64_t c0, int64_t first_pos) {
  constexpr int64_t C = kRowsChunk;
  const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t row = 0; row < NR; ++row) {
    const int64_t ii = (row / G) % R;
    const int64_t valid = std::min(cn, first_pos + ii + 1 - c0);
    float* sr = S + row * C;
    alpha[row] = m[row];  // the old max, for the pass below
    sums[row] = 0.0f;
    if (valid <= 0) {
      std::fill(sr, sr + C, 0.0f);
      continue;
    }
    v16 mxv = vset(m[row]);
    v16 sum = {};
    if (valid == C) {  // every key visible: no masking
      for (int64_t t = 0; t < C; t += 16) mxv = vmax(mxv, vload(sr + t));
      const v16 mx = vset(hmax(mxv));
      for (int64_t t = 0; t < C; t += 16) {
        const v16 e = vexp2(vload(sr + t) - mx);
        vstore(sr + t, e);
        sum += e;
      }
      m[row] = mx[0];
    } else {
      const vi16 lim = viset(static_cast<int32_t>(valid));
      for (int64_t t = 0; t < C; t += 16)
        mxv = vmax(mxv, (iota + static_cast<int32_t>(t)) < lim ? vload(sr + t) : vset(kNegInf));
      const v16 mx = vset(hmax(mxv));
      for (int64_t t = 0; t < C; t += 16) {
        const v16 e = (iota + static_cast<int32_t>(t)) < lim ? vexp2(vload(sr + t) - mx) : v16{};
        vstore(sr + t, e);
        sum += e;
      }
      m[row] = mx[0];
    }
    sums[row] = hsum(sum);
  }
  // alpha = 2^(old max - new max): 0 for a row that saw no key before (old max -inf), 1 for one with none now.
  for (int64_t r0 = 0; r0 < NR; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, NR - r0);
    v16 mo = vset(0.0f), mn = vset(0.0f), lo = vset(0.0f), su = vset(0.0f);
    std::memcpy(&mo, alpha + r0, nr * sizeof(float));
    std::memcpy(&mn, m + r0, nr * sizeof(float));
    std::memcpy(&lo, l + r0, nr * sizeof(float));
    std::memcpy(&su, sums + r0, nr * sizeof(float));
    const v16 a = mo == vset(kNegInf) ? v16{} : vexp2(mo - mn);
    const v16 ln = lo * a + su;
    std::memcpy(alpha + r0, &a, nr * sizeof(float));
    std::memcpy(l + r0, &ln, nr * sizeof(float));
  }
}

// An item's rows (row = (gi * R + ii) * G + j, unnormalised sums acc, running max m in log2 units, sum l) to the
// output. A partition of a split decode leaves them in its slot instead, and the last partition of its group to
// finish merges them all: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p with M = max_p m_p, the same
// result as one pass up to fp32 rounding. `tmp`: D floats.
template <typename kv_t>
void finish_rows(const Problem<kv_t>& P, const WorkItem& w, const float* acc, const float* m, const float* l,
                 float* tmp) {
  const int64_t D = P.D, G = P.G, R = w.q_end - w.q_begin, NR = R * G * (w.kv_end - w.kv_begin);
  const int64_t tok0 = P.query_start_loc[w.seq] + w.q_begin;
  const auto tok = [&](int64_t row) { return tok0 + (row / G) % R; };
  const auto head = [&](int64_t row) { return (w.kv_begin + row / (R * G)) * G + row % G; };
  if (w.part < 0) {
    for (int64_t row = 0; row < NR; ++row) store_out(P, tok(row), head(row), acc + row * D, 1.0f / l[row]);
    return;
  }
  float* slot = P.split.partial + w.part * P.split.slot_floats;
  std::memcpy(slot, acc, NR * D * sizeof(float));
  std::memcpy(slot + NR * D, m, NR * sizeof(float));
  std::memcpy(slot + NR * D + NR, l, NR * sizeof(float));
  SplitGroup& g = P.split.groups[w.group];
  if (g.left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // other partitions still running
  const float* first = P.split.partial + g.first_slot * P.split.slot_floats;
  for (int64_t row = 0; row < NR; ++row) {
    float M = kNegInf;
    for (int32_t p = 0; p < g.parts; ++p) M = std::max(M, first[p * P.split.slot_floats + NR * D + row]);
    float sum = 0.0f;
    std::fill(tmp, tmp + D, 0.0f);
    for (int32_t p = 0; p < g.parts; ++p) {
      const float* sp = first + p * P.split.slot_floats;
      if (sp[NR * D + row] == kNegInf) continue;  // no key of this partition is visible to the row
      const float a = std::exp2(sp[NR * D + row] - M);
      sum += a * sp[NR * D + NR + row];
      for (int64_t d = 0; d < D; ++d) tmp[d] += a * sp[row * D + d];
    }
    store_out(P, tok(row), head(row), tmp, 1.0f / sum);
  }
}

#if defined(__AVX512F__)
// Scores S[row][t] of one chunk over an int8 cache, 8 keys at a time, each record's groups widened in registers once
// for the RG query rows of its kv head (rows gi * RG ..). Keys past cn score against zero_rec; softmax_chunk reads
// only the keys each row sees.
template <typename kv_t, typename F>
void chunk_scores_int8(const Problem<kv_t>& P, const float* q, const int64_t* base, int64_t cn, int64_t head_off,
                       int64_t ng, int64_t RG, const uint8_t* zero_rec, float* S, F&& prefetch) {
  const int64_t D = P.D;
  for (int64_t t0 = 0; t0 < cn; t0 += 8) {
    for (int64_t t = t0; t < std::min<int64_t>(t0 + 8, cn); ++t) prefetch(t);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const uint8_t* krec[8];
      for (int64_t t = 0; t < 8; ++t)
        krec[t] = t0 + t < cn ? reinterpret_cast<const uint8_t*>(P.k + base[t0 + t] + head_off + gi * P.RL) : zero_rec;
      scores_8_int8_rows(q + gi * RG * D, krec, D, S + gi * RG * kRowsChunk + t0, kRowsChunk, RG);
    }
  }
}
#endif

// Decodes and short chunks: rows = (query, head) pairs, scores as dot products over head_dim. Keys and
// values are read token-major (a token's rows for all kv heads of the item are adjacent in the cache);
// the next chunk's keys and this chunk's values are prefetched while the scores are computed.
template <typename kv_t>
void attend_rows(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc) {
  const int64_t D = P.D, G = P.G, s = w.seq;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin, NR = R * G * ng, RG = R * G;
  const int64_t first_pos = L - n + w.q_begin, k_end = std::min<int64_t>(w.k_end, L - n + w.q_end);
  const int64_t span = ng * D;  // fp32 elements of one token's rows for this item's kv heads
  const int64_t span_bytes = ng * P.RL * static_cast<int64_t>(sizeof(kv_t));  // the same rows in the cache
  constexpr int64_t C = kRowsChunk;

  size_t off = 0;
  float* q = sc.take(NR * D, off);  // fp32 rows scaled to log2 units
  float* acc = sc.take(NR * D, off);
  float* m = sc.take(NR, off);
  float* l = sc.take(NR, off);
  float* alpha = sc.take(NR, off);
  float* sums = sc.take(NR, off);
  float* S = sc.take(NR * C, off);  // S[row][t]: scores, then probabilities
  float* kbuf = sc.take(span, off);
  float* vbuf = sc.take(C * span, off);
  int64_t base_buf[2][C];
  const float** vrow = sc.vrow.data();

  // row = (gi * R + ii) * G + j  <->  query tok0 + ii, head (kv_begin + gi) * G + j
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j, head = (w.kv_begin + gi) * G + j;
        for (int64_t d = 0; d < D; ++d) q[row * D + d] = q_at(P, tok0 + ii, head, d) * P.scale_log2;
      }
  std::fill(acc, acc + NR * D, 0.0f);
  std::fill(m, m + NR, kNegInf);
  std::fill(l, l + NR, 0.0f);
  const int64_t head_off = w.kv_begin * P.RL;
#if defined(__AVX512F__)
  const bool int8_in_registers = std::is_same_v<kv_t, uint8_t> && D <= kMaxInt8Dim;
#else
  const bool int8_in_registers = false;
#endif
  const uint8_t* zero_rec = reinterpret_cast<const uint8_t*>(vbuf);  // a record of zeros: keys past a chunk's end
  if (int8_in_registers) std::memset(vbuf, 0, P.RL);

  chunk_offsets(P, s, w.k_begin, std::min<int64_t>(C, k_end - w.k_begin), base_buf[0]);
  for (int64_t c0 = w.k_begin, ci = 0; c0 < k_end; c0 += C, ci ^= 1) {
    const int64_t cn = std::min(C, k_end - c0);
    const int64_t* base = base_buf[ci];
    const int64_t next_cn = std::max<int64_t>(0, std::min(C, k_end - c0 - C));
    if (next_cn > 0) chunk_offsets(P, s, c0 + C, next_cn, base_buf[ci ^ 1]);
    // This chunk's values and the next chunk's keys, fetched while the scores are computed.
    const auto prefetch = [&](int64_t t) __attribute__((always_inline)) {
      prefetch_l2(P.v + base[t] + head_off, span_bytes);
      if (t < next_cn) prefetch_l2(P.k + base_buf[ci ^ 1][t] + head_off, span_bytes);
    };
    if (int8_in_registers) {
#if defined(__AVX512F__)
      chunk_scores_int8(P, q, base, cn, head_off, ng, RG, zero_rec, S, prefetch);
#endif
    } else {
      chunk_scores_f32(P, w, q, base, cn, c0, first_pos, kbuf, S, prefetch);
    }
    softmax_chunk(S, m, l, alpha, sums, NR, R, G, cn, c0, first_pos);

    // Values: acc = acc * alpha + P V, one kv head at a time, accumulators in registers; fp32 and bf16 rows are
    // read in place, int8 records widened in registers (on AVX-512; elsewhere converted first).
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t r0 = gi * RG, off_g = head_off + gi * P.RL;
      if (int8_in_registers) {
#if defined(__AVX512F__)
        const uint8_t* recs[C];
        for (int64_t t = 0; t < cn; ++t) recs[t] = reinterpret_cast<const uint8_t*>(P.v + base[t] + off_g);
        pv_int8_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, C, recs, cn, RG);
#endif
      } else if constexpr (std::is_same_v<kv_t, uint8_t>) {
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
  finish_rows(P, w, acc, m, l, kbuf);
}

#if defined(__AVX512F__)
// attend_rows over a bf16 cache (D = 32 * DW, or any multiple of 32 for DW = 0), reading the cache rows in place:
// the scores by scores_8 (each key row loaded once for the R x G query rows of its kv head; q_t = uint16_t: bf16
// queries by vdpbf16ps, q_t = float: fp32 queries by FMA over the keys widened in registers), the values by
// pv_bf16. Memory, not arithmetic, bounds it on two threads over a cache bigger than the last-level cache: with the
// arithmetic taken out (the same reads and prefetches) it takes ~85% of its time. So the order of
// the reads matters: keys and values are read 8 keys at a time with the kv heads inner (windows of adjacent memory
// rather than one pass per head over a chunk: ~8% faster), and the rows kPrefetchKeys keys ahead are prefetched one
// row at a time along the way (in bursts, or 8-16 keys ahead: slower), on into the first keys of the thread's next
// item, which it claims as the current one ends.
template <int DW, typename q_t>
void attend_rows_bf16(const Problem<at::BFloat16>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
  constexpr bool f32q = std::is_same_v<q_t, float>;
  const int64_t D = DW > 0 ? 32 * DW : P.D, G = P.G, s = w.seq;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin, RG = R * G, NR = RG * ng;
  const int64_t first_pos = L - n + w.q_begin, k_end = std::min<int64_t>(w.k_end, L - n + w.q_end);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t C = kRowsChunk;

  size_t off = 0;
  // The query rows: raw bf16, or fp32 scaled to log2 units, 2D floats in the order of the widened keys (scores_8).
  const int64_t QD = f32q ? 2 * D : D;
  q_t* qh = reinterpret_cast<q_t*>(sc.take(NR * QD * sizeof(q_t) / sizeof(float), off));
  float* acc = sc.take(NR * D, off);  // per row and 32 values: 16 even ones, then 16 odd ones (see pv_bf16)
  float* m = sc.take(NR, off);
  float* l = sc.take(NR, off);
  float* alpha = sc.take(NR, off);
  float* sums = sc.take(NR, off);
  float* S = sc.take(NR * C, off);  // S[row][t]: scores, then probabilities
  float* tmp = sc.take(D, off);  // zeros: the key row read past a chunk's end
  const uint16_t* zero = reinterpret_cast<const uint16_t*>(tmp);
  const uint16_t* K = reinterpret_cast<const uint16_t*>(P.k);
  const uint16_t* V = reinterpret_cast<const uint16_t*>(P.v);

  // row = (gi * R + ii) * G + j  <->  query tok0 + ii, head (kv_begin + gi) * G + j
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j, head = (w.kv_begin + gi) * G + j;
        const auto* src = static_cast<const q_t*>(P.q) + (tok0 + ii) * P.q_stride0 + head * P.q_stride1;
        if constexpr (f32q) {
          const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
          const __m512 mul = _mm512_set1_ps(P.scale_log2);
          for (int64_t j = 0; j < D; j += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + j), mul);
            _mm512_storeu_ps(qh + row * QD + 2 * j, _mm512_permutexvar_ps(even, x));
            _mm512_storeu_ps(qh + row * QD + 2 * j + 16,
                             _mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_set1_epi32(1)), x));
          }
        } else {
          std::memcpy(qh + row * D, src, row_bytes);
        }
      }
  std::fill(tmp, tmp + D, 0.0f);
  std::fill(acc, acc + NR * D, 0.0f);
  std::fill(m, m + NR, kNegInf);
  std::fill(l, l + NR, 0.0f);

  constexpr int64_t PT = kPrefetchKeys;
  // Cache slots (block * block_size + offset) of the item's keys, then of the first PT keys of the item this
  // thread runs next (when it reads the same kv heads), so that prefetching runs on across the items.
  const int64_t nk = k_end - w.k_begin;
  sc.slots.resize(nk + PT);
  int32_t* slot = sc.slots.data();
  slot_range(P, s, w.k_begin, nk, slot);
  int64_t nk_pf = nk;
  const int64_t slot_len = P.KVH * P.RL;  // cache elements per slot

  // fp32 queries: a whole chunk per pass over the values (~3% faster on the Xeon without AVX512-BF16 than 8 keys).
  constexpr int64_t PS = f32q ? kRowsChunk : kValueKeys;
  for (int64_t c0 = 0; c0 < nk; c0 += C) {  // c0: key index within the item
    const int64_t cn = std::min(C, nk - c0);
    const int32_t* cs = slot + c0;
    if (!claim.taken && c0 + C + PT >= nk) {  // prefetching reaches the end: claim the next item, run on into it
      const WorkItem* after = claim.take();
      if (after && !after->tiled && after->kv_begin == w.kv_begin && after->kv_end == w.kv_end) {
        const int64_t as = after->seq, an = P.query_start_loc[as + 1] - P.query_start_loc[as];
        const int64_t a_end = std::min<int64_t>(after->k_end, P.context_lens[as] - an + after->q_end);
        const int64_t extra = std::min<int64_t>(PT, a_end - after->k_begin);
        slot_range(P, as, after->k_begin, extra, slot + nk);
        nk_pf += extra;
      }
    }
    // Scores, 8 keys at a time, the kv heads inner.
    for (int64_t t0 = 0; t0 < cn; t0 += 8) {
      for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t off_g = (w.kv_begin + gi) * P.RL;
        const uint16_t* krow[8];
        for (int64_t t = 0; t < 8; ++t) krow[t] = t0 + t < cn ? K + cs[t0 + t] * slot_len + off_g : zero;
        for (int64_t u = c0 + t0 + PT; u < std::min(c0 + t0 + 8 + PT, nk_pf); ++u)
          prefetch_l2(K + slot[u] * slot_len + off_g, row_bytes);
        const q_t* qg = qh + gi * RG * QD;
        float* Sg = S + gi * RG * C + t0;
        int64_t r = 0;
        if constexpr (f32q) {
          for (; r + 3 <= RG; r += 3) scores_8<DW, 3>(qg + r * QD, krow, D, Sg + r * C, C);
          if (RG - r == 2) scores_8<DW, 2>(qg + r * QD, krow, D, Sg + r * C, C);
          if (RG - r == 1) scores_8<DW, 1>(qg + r * QD, krow, D, Sg + r * C, C);
        } else {
          for (; r + 3 <= RG; r += 3) scores_8<DW, 3>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
          if (RG - r == 2) scores_8<DW, 2>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
          if (RG - r == 1) scores_8<DW, 1>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
        }
      }
    }
    softmax_chunk(S, m, l, alpha, sums, NR, R, G, cn, w.k_begin + c0, first_pos);

    // Values, PS keys at a time, the kv heads inner: the accumulators go through memory at every step (~2% more
    // work in cache), the reads move through the cache in windows of adjacent rows.
    for (int64_t s0 = 0; s0 < cn; s0 += PS) {
      const int64_t sn = std::min(PS, cn - s0);
      for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t off_g = (w.kv_begin + gi) * P.RL;
        const uint16_t* vrow[PS];
        const uint16_t* vpf[PS];
        for (int64_t t = 0; t < sn; ++t) vrow[t] = V + cs[s0 + t] * slot_len + off_g;
        int64_t pfn = std::max<int64_t>(0, std::min(sn, nk_pf - (c0 + s0 + PT)));
        for (int64_t t = 0; t < pfn; ++t) vpf[t] = V + slot[c0 + s0 + t + PT] * slot_len + off_g;
        for (int64_t r = gi * RG; r < (gi + 1) * RG; r += 3) {
          const int64_t rb = std::min<int64_t>(3, (gi + 1) * RG - r);
          float* o = acc + r * D;
          const float* a = s0 == 0 ? alpha + r : nullptr;
          const float* p = S + r * C + s0;
          for (int64_t d0 = 0; d0 < D; pfn = 0) {
            if (D - d0 >= 64) {
              if (rb == 3) pv_bf16<2, 3>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              if (rb == 2) pv_bf16<2, 2>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              if (rb == 1) pv_bf16<2, 1>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              d0 += 64;
            } else {
              if (rb == 3) pv_bf16<1, 3>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              if (rb == 2) pv_bf16<1, 2>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              if (rb == 1) pv_bf16<1, 1>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
              d0 += 32;
            }
          }
        }
      }
    }
  }
  // Back to the natural order of the values: per block of 32, even values first, then odd ones.
  for (int64_t row = 0; row < NR; ++row) {
    float* a = acc + row * D;
    for (int64_t j = 0; j < D; j += 32)
      for (int64_t i = 0; i < 16; ++i) tmp[j + 2 * i] = a[j + i], tmp[j + 2 * i + 1] = a[j + 16 + i];
    std::memcpy(a, tmp, D * sizeof(float));
  }
  finish_rows(P, w, acc, m, l, tmp);
}
#endif

#if defined(__AVX512F__)
// attend_rows_bf16 compiled for the common head_dims.
template <typename q_t>
void attend_rows_bf16_any(const Problem<at::BFloat16>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
  switch (P.D) {
    case 32: return attend_rows_bf16<1, q_t>(P, w, sc, claim);
    case 64: return attend_rows_bf16<2, q_t>(P, w, sc, claim);
    case 128: return attend_rows_bf16<4, q_t>(P, w, sc, claim);
    default: return attend_rows_bf16<0, q_t>(P, w, sc, claim);
  }
}
#endif

// The decode kernel for this problem: over a bf16 cache with head_dim a multiple of 32, attend_rows_bf16 (fp32
// queries: on AVX-512; bf16 queries: on AVX512-BF16), else attend_rows.
template <typename kv_t>
void attend_decode(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    if (P.D % 32 == 0 && !P.half_q) return attend_rows_bf16_any<float>(P, w, sc, claim);
#if defined(__AVX512BF16__)
    if (P.D % 32 == 0 && P.half_q) return attend_rows_bf16_any<uint16_t>(P, w, sc, claim);
#endif
  }
#endif
  (void)claim;
  attend_rows(P, w, sc);
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

// Whether attend_tile runs on vdpbf16ps (tile_bf16.h): bf16 queries over a bf16 cache, head_dim a multiple of 16,
// on AVX512-BF16. Its scores are exact sums of the bf16 products; the probabilities are rounded to bf16 for the
// values' sums, as flash attention does on GPUs (fp32 queries keep the fp32 kernel, and fp32's exact output).
template <typename kv_t>
inline bool bf16_tile(const Problem<kv_t>& P) {
#if defined(__AVX512BF16__)
  return std::is_same_v<kv_t, at::BFloat16> && P.half_q && P.D % 16 == 0 && P.tile_pairs;
#else
  (void)P;
  return false;
#endif
}

// VP: the value pairs (pack_value_pairs) of kv head g's V rows of the chunk's keys (bf16_tile(P) only).
template <typename kv_t>
inline void tile_value_pairs(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t g, uint32_t* VP) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint16_t* vrow[kTileChunk];
    for (int64_t t = 0; t < cn; ++t) vrow[t] = reinterpret_cast<const uint16_t*>(P.v + base[t] + g * P.RL);
    pack_value_pairs(vrow, cn, P.D, VP);
    return;
  }
#endif
  (void)P, (void)base, (void)cn, (void)g, (void)VP;
}

// O[r] = O[r] * alpha[r] + sum_t P[r][t] V[t] for the rows from r0 (of Mp) over the chunk's cn keys, with the
// probabilities ST[t][r] rounded to bf16 pairs in PP and the value pairs VP (bf16_tile(P) only).
inline void tile_values_bf16(float* O, int64_t D, const float* alpha, const float* ST, int64_t Mp, int64_t r0,
                             int64_t cn, uint32_t* PP, const uint32_t* VP) {
#if defined(__AVX512BF16__)
  pack_prob_pairs(ST, Mp, r0, cn, PP);
  pv_rows_bf16(O, D, alpha, PP + r0, Mp, VP, (cn + 1) / 2, Mp - r0);
#else
  (void)O, (void)D, (void)alpha, (void)ST, (void)Mp, (void)r0, (void)cn, (void)PP, (void)VP;
#endif
}

// ST[t][r] for the chunk's keys t < cn_padded (those from cn on score against `zero`) and row vectors rv0 .. RV,
// by qk_micro_bf16 over the bf16 keys in place (bf16_tile(P) only).
template <typename kv_t>
inline void tile_scores_bf16(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t cn_padded, int64_t g,
                             int64_t rv0, int64_t RV, int64_t Mp, const uint32_t* Q2, const float* zero, float* ST) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint16_t* krow[kTileChunk];
    for (int64_t t = 0; t < cn_padded; ++t)
      krow[t] = t < cn ? reinterpret_cast<const uint16_t*>(P.k + base[t] + g * P.RL)
                       : reinterpret_cast<const uint16_t*>(zero);
    const int64_t D = P.D;
    const float mul = P.scale_log2;
    for (int64_t t0 = 0; t0 < cn_padded; t0 += kTB) {
      int64_t rv = rv0;
      for (; rv + 4 <= RV; rv += 4) qk_micro_bf16<kTB, 4>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16);
      switch (RV - rv) {
        case 3: qk_micro_bf16<kTB, 3>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        case 2: qk_micro_bf16<kTB, 2>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        case 1: qk_micro_bf16<kTB, 1>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        default: break;
      }
    }
    return;
  }
#endif
  (void)P, (void)base, (void)cn, (void)cn_padded, (void)g, (void)rv0, (void)RV, (void)Mp, (void)Q2, (void)zero;
  (void)ST;
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
  uint32_t* PP = reinterpret_cast<uint32_t*>(sc.take(kTileChunk / 2 * Mp, off));  // bf16 path: probability pairs
  uint32_t* VP = reinterpret_cast<uint32_t*>(kbuf);  // bf16 path: value pairs
  int64_t base[kTileChunk];
  const float** krow = sc.krow.data();
  const float** vrow = sc.vrow.data();

  // row r = ii * G + j  <->  query tok0 + ii, head g * G + j. Padding rows: zero queries, never masked.
  const bool pairs = bf16_tile(P);
  if (pairs) {
#if defined(__AVX512BF16__)
    pack_query_pairs(static_cast<const uint16_t*>(P.q), P.q_stride0, P.q_stride1, tok0, g * G, R, G, D, Mp,
                     reinterpret_cast<uint32_t*>(Qt));
#endif
  } else {
    std::fill(Qt, Qt + D * Mp, 0.0f);
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j)
        for (int64_t d = 0; d < D; ++d) Qt[d * Mp + ii * G + j] = q_at(P, tok0 + ii, g * G + j, d) * P.scale_log2;
  }
  for (int64_t r = 0; r < Mp; ++r)
    pos[r] = r < M ? static_cast<int32_t>(first_pos + r / G) : std::numeric_limits<int32_t>::max();
  std::fill(O, O + Mp * D, 0.0f);
  std::fill(m, m + Mp, kNegInf);
  std::fill(l, l + Mp, 0.0f);
  std::fill(zero, zero + D, 0.0f);

  for (int64_t c0 = 0; c0 <= last_pos; c0 += kTileChunk) {
    const int64_t cn = std::min(kTileChunk, last_pos + 1 - c0);
    chunk_offsets(P, s, c0, cn, base);
    const int64_t cn_padded = (cn + kTB - 1) / kTB * kTB;
    // Row vectors whose rows all sit before this chunk take no part in it.
    const int64_t rv0 = std::max<int64_t>(0, (c0 - first_pos) * G) / 16;
    const bool masked = c0 + cn - 1 > first_pos;
    if (pairs) {
      tile_scores_bf16(P, base, cn, cn_padded, g, rv0, RV, Mp, reinterpret_cast<const uint32_t*>(Qt), zero, ST);
      tile_value_pairs(P, base, cn, g, VP);
    } else {
      gather_rows(P, base, cn, g, kbuf, vbuf, krow, vrow);
      for (int64_t t = cn; t < cn_padded; ++t) krow[t] = zero;
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
    if (pairs)
      tile_values_bf16(O + r0 * D, D, alpha + r0, ST, Mp, r0, cn, PP, VP);
    else
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
    for (size_t i = next.fetch_add(1); i < items.size();) {
      Claim claim{&next, &items};
      if (items[i].tiled)
        attend_tile(P, items[i], sc);
      else
        attend_decode(P, items[i], sc, claim);
      i = claim.taken ? claim.index : next.fetch_add(1);
    }
  });
}

}  // namespace

bool tile_pairs_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// See pagedllm/attention.py:paged_attention for the contract. tile_min_rows: sequences with at least this many
// query rows (queries x query heads per kv head) use the tiled (prefill) kernel, the others the row kernel; in a
// step of fewer than 4 sequences per thread (where the row kernel splits contexts over threads) few_tile_min_rows.
// tile_pairs: bf16 queries over a bf16 cache may take the tiled kernel's vdpbf16ps form (bf16_tile).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                              int64_t tile_min_rows, int64_t few_tile_min_rows, bool tile_pairs) {
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
  TORCH_CHECK(NB * BS <= std::numeric_limits<int32_t>::max(), "too many cache slots for int32 slot numbers");
  if (int8_cache) {
    TORCH_CHECK(D % kKvGroup == 0, "int8 cache: head_dim must be a multiple of ", kKvGroup);
    TORCH_CHECK(k_cache.size(3) == row_len<uint8_t>(D), "int8 cache: rows must be head_dim + 4 * head_dim / ",
                kKvGroup, " bytes");
  } else {
    TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and cache differ");
  }
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(context_lens.numel() == S && query_start_loc.numel() == S + 1, "batch sizes disagree");
  TORCH_CHECK(tile_min_rows >= 1 && few_tile_min_rows >= 1, "tile_min_rows must be >= 1");

  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t G = H / KVH;
  TORCH_CHECK(S == 0 || (qsl[0] >= 0 && qsl[S] <= T), "query_start_loc out of range");
  std::vector<WorkItem> items;
  std::vector<int32_t> row_items;  // indices of decode-like items, split over kv heads when work is scarce
  size_t rows_max_R = 0, tile_max_M = 0;
  const int64_t nthreads = at::get_num_threads();
  int64_t active = 0;
  for (int64_t s = 0; s < S; ++s) active += qsl[s + 1] > qsl[s];
  const int64_t min_tile_rows = active < 4 * nthreads ? few_tile_min_rows : tile_min_rows;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], L = ctx[s];
    TORCH_CHECK(n >= 0 && n <= max_query_len, "sequence ", s, ": bad query count ", n);
    if (n == 0) continue;
    TORCH_CHECK(L >= n, "sequence ", s, ": context_len ", L, " < its query count ", n);
    const int64_t nblocks = (L + BS - 1) / BS;
    TORCH_CHECK(nblocks <= MB, "sequence ", s, ": block table too short for context ", L);
    for (int64_t b = 0; b < nblocks; ++b)
      TORCH_CHECK(bt[s * MB + b] >= 0 && bt[s * MB + b] < NB, "sequence ", s, ": block id out of range");
    if (n * G >= min_tile_rows) {
      const int64_t most = std::max<int64_t>(1, kTileRows / G), tiles = (n + most - 1) / most;
      const int64_t qt = (n + tiles - 1) / tiles;  // tiles of equal size: no last tile of a few padded rows
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
  // Too few tasks to keep every thread busy (the tail of a run: a few long decodes): split the contexts of the
  // decodes into partitions (flash-decoding) of about equal cost, kSplitPerThread per thread over all items, each
  // at least kMinPartKeys keys and starting on a chunk boundary; merged by the last partition to finish.
  std::vector<WorkItem> parts;
  std::vector<std::pair<int32_t, int32_t>> groups;  // per split decode: first slot, partitions
  if (nthreads > 1 && !row_items.empty() && int64_t(items.size()) < 4 * nthreads) {
    double total = 0.0;
    for (const WorkItem& x : items) total += x.cost;
    const double target = total / double(kSplitPerThread * nthreads);
    for (int32_t idx : row_items) {
      WorkItem& x = items[idx];
      const int64_t keys = ctx[x.seq], chunks = (keys + kRowsChunk - 1) / kRowsChunk;
      const int64_t np = std::min<int64_t>({std::llround(x.cost / target), keys / kMinPartKeys, chunks});
      if (np < 2) continue;
      x.cost = -1.0;  // replaced by its partitions
      groups.push_back({int32_t(parts.size()), int32_t(np)});
      for (int64_t p = 0; p < np; ++p) {
        WorkItem y = items[idx];
        y.k_begin = int32_t(p * chunks / np * kRowsChunk);
        y.k_end = int32_t(std::min(keys, (p + 1) * chunks / np * kRowsChunk));
        y.cost = double(y.q_end - y.q_begin) * double(H) * double(y.k_end - y.k_begin);
        y.part = int32_t(parts.size());
        y.group = int32_t(groups.size() - 1);
        parts.push_back(y);
      }
    }
    if (!parts.empty()) {
      std::vector<int32_t> kept;
      std::vector<WorkItem> rest;
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].cost < 0.0) continue;
        if (!items[i].tiled) kept.push_back(int32_t(rest.size()));
        rest.push_back(items[i]);
      }
      rest.insert(rest.end(), parts.begin(), parts.end());
      items.swap(rest);
      row_items.swap(kept);
    }
  }
  // Still too few: give each kv head of an unsplit decode its own task.
  if (KVH > 1 && !row_items.empty() && int64_t(items.size()) < 4 * nthreads) {
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
  // attend_rows: q (2 * NR * D in attend_rows_bf16 over fp32 queries) and acc, ...
  const size_t rows_floats = 3 * (NR * D + pad) + 4 * (NR + pad) + (NR * kRowsChunk + pad) + (span + D + pad) +
                             (kRowsChunk * span + pad);
  const size_t Mp = (tile_max_M + 15) / 16 * 16;
  const size_t tile_floats = 2 * (Mp * D + pad) + 3 * (Mp + pad) + (kTileChunk * Mp + pad) +
                             2 * (kTileChunk * D + pad) + (D + pad) + (kTileChunk / 2 * Mp + pad);
  const size_t scratch_floats = std::max(rows_floats, tile_floats);

  auto out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (S == 0) return out.zero_();
  if (qsl[0] > 0) out.narrow(0, 0, qsl[0]).zero_();
  if (qsl[S] < T) out.narrow(0, qsl[S], T - qsl[S]).zero_();
  if (items.empty()) return out;

  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const bool half_q = q.scalar_type() == at::kBFloat16;
  Splits split;
  std::vector<float> partial;
  std::unique_ptr<SplitGroup[]> split_groups;
  if (!parts.empty()) {
    split.slot_floats = int64_t(NR * D + 2 * NR);
    partial.resize(parts.size() * split.slot_floats);
    split.partial = partial.data();
    split_groups.reset(new SplitGroup[groups.size()]);
    for (size_t i = 0; i < groups.size(); ++i) {
      split_groups[i].first_slot = groups[i].first;
      split_groups[i].parts = groups[i].second;
      split_groups[i].left.store(groups[i].second, std::memory_order_relaxed);
    }
    split.groups = split_groups.get();
  }
  if (k_cache.scalar_type() == at::kFloat) {
    const Problem<float> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, ctx, qsl,
                           H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs};
    run(P, items, scratch_floats, Mp);
  } else if (int8_cache) {
    const Problem<uint8_t> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                             k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), bt, ctx, qsl,
                             H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs};
    run(P, items, scratch_floats, Mp);
  } else {
    const Problem<at::BFloat16> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                                  k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), bt, ctx,
                                  qsl, H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs};
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

// n fp32 values to bf16, rounded to nearest even exactly as torch's .to(torch.bfloat16) does (its vectorised
// conversion: NaN becomes 0xFFFF; c10's scalar one, used for a tail: 0x7FC0).
inline void row_to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0xFFFF);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    const __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), nan, r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(b));
  }
#endif
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// The rows of x [T, KVH, D] (last dim contiguous) to their slots of the cache: copied (same dtype), rounded (fp32
// into bf16), or quantised into int8 records (uint8 cache).
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
        else if constexpr (!std::is_same_v<C, T>)
          row_to_bf16(src + t * s0 + h * s1, rec, D);
        else
          std::memcpy(rec, src + t * s0 + h * s1, D * sizeof(T));
      }
  });
}

}  // namespace

// Stores the step's keys and values [T, num_kv_heads, head_dim] (last dim contiguous) at their cache slots
// (block_id * block_size + offset), in place: copied into a float32 / bfloat16 cache of their own dtype, rounded
// into a bfloat16 one (float32 keys and values), quantised into an int8 (uint8 records) one.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, num_kv_heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k and v must be float32 or bfloat16");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  const bool to_bf16 = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (int8_cache || to_bf16 || k_cache.scalar_type() == k.scalar_type()),
              "the cache must be k's dtype, bfloat16 (for float32 k), or uint8 (int8 records)");
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
    } else if (to_bf16) {
      store_rows<float, at::BFloat16>(k, k_cache, slots);
      store_rows<float, at::BFloat16>(v, v_cache, slots);
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
