// paged_attention.cpp's shared pieces: GCC vector types and their helpers, the kernels' constants, the cache's
// row formats, one call's Problem and WorkItems, per-thread Scratch and the key-gathering helpers. Included by
// paged_attention.cpp inside its anonymous namespace, after the standard and ATen headers.
#pragma once

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

constexpr int64_t kKvGroup = 16;  // int8 cache: values per (scale, min) pair

constexpr int64_t kRowsChunk = 32;  // keys per softmax step in attend_rows
constexpr int64_t kPrefetchKeys = 64;  // attend_rows_bf16: how far ahead keys and values are prefetched
constexpr int64_t kValueKeys = 8;      // attend_rows_bf16: keys per pass over the values, kv heads inner (bf16 q)
// attend_rows_bf16: the next chunk's scores interleaved with this chunk's value sums. Measured on AVX2 (Zen 3) only:
// AVX-512 builds keep the loop that was measured on their CPUs until someone measures this one there.
#if defined(__AVX512F__)
constexpr bool kPipelinedChunks = false;
#else
constexpr bool kPipelinedChunks = true;
#endif
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
#if defined(__AVX512F__)
// On AVX-512 the range reduction is one rounding and one scaling instruction (vrndscaleps, vscalefps) instead of
// the magic-number pair and the exponent's bits: the same results (2^n times p is exact either way), 4 instructions
// fewer. `poly`: 2^f on [-0.5, 0.5].
template <typename Poly>
inline __m512 vexp2_512(__m512 x, Poly&& poly) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-125.0f), x);  // NaN stays NaN, as below
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(poly(xc - n), n);
}
inline v16 vexp2(v16 x) {
  return (v16)vexp2_512((__m512)x, [](__m512 f) { return exp2_poly(f); });
}
#else
inline v16 vexp2(v16 x) {
  const v16 lo = vset(-125.0f);
  x = x < lo ? lo : x;
  const v16 magic = vset(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const v16 n = (x + magic) - magic;
  const v16 p = exp2_poly(x - n);  // x - n in [-0.5, 0.5]
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * (v16)e;
}
#endif

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

// A call's chunks prepared once for all its tiles (tile_shared.h): full chunks (kTileChunk keys) of the sequences that
// several tiles read, chunk c of sequence s's kv head g in slot first[s] + g * count[s] + c, for c < count[s]; a tile
// prepares the others itself, the same bits. One form per call: the fp16 tile's, or the fp32 tile's rows.
struct SharedChunks {
  const uint16_t* keys = nullptr;    // [slot][kTileChunk][D]: pack_keys_f16
  const uint32_t* values = nullptr;  // [slot][kTileChunk / 2][D]: pack_value_pairs_f16
  const float* inv = nullptr;        // [slot][2]: the keys' and the values' 2^-e
  const float* rows = nullptr;       // [slot][2][kTileChunk][D]: the fp32 tile's keys, then values
  const int64_t* first = nullptr;    // [S]
  const int64_t* count = nullptr;    // [S]; nullptr: nothing shared
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
  bool tile_pairs = true;  // bf16 queries on vdpbf16ps (bf16_tile, attend_decode); false: fp32 forms (measured)
  bool tile_f16 = false;   // attend_tile may run fp32 queries with fp16 products (f16_tile; measured choice)
  SharedChunks shared = {};
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
