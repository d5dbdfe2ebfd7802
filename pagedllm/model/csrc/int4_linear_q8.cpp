// x @ W.T for GGUF's 4-bit weights against int8 activations (Q4 x Q8, as llama.cpp's dot products): vpdpbusd does 64
// multiply-adds where vfmadd231ps does 16, and VNNI is on CPUs without AVX512-FP16 (AMD EPYC Zen 4 and 5, Intel
// Xeons from Ice Lake). Builds without AVX512-VNNI take int4_q8_avx2.h's kernel (vpmaddubsw), whose sums and
// outputs are this one's. x and the output in fp32 or bf16.
//
// Numerics, not fp32's (int4_linear_f32.cpp stays the exact form): each row keeps its kOutliers inputs of largest
// magnitude exact (a few channels of the hidden state run 10-25x the median); the rest are quantised per group of 32
// inputs to int8, xq = rint(x * (127 / amax)), s = amax / 127. Per group, sum_k x w = d * s * sum_k xq q + m * s *
// sum_k xq: the int8 sums are exact, so this is the product of the weights with the activations rounded to the int8
// grid, as a fake-quantised fp32 matmul gives it. The kept inputs add x * fma(q, d, m), the fp32 kernel's exact
// weight. A row's sums depend on that row alone (batch-invariant). A row with inf or NaN gives NaN outputs.
// Accuracy (docs/performance-log.md, 2026-12-01): in fp32 arithmetic 0.71-0.85x plain bf16's top-5 logprob error on
// the default model; in a bf16 model, whose own rounding it adds to, 1.11-1.39x (the gate's edge): the engine runs it
// in fp32 models only (model_runner.int8_activations).
//
// Schedule (int4_linear_f16.cpp's): the threads share half tiles of 32 output columns; each half's nibbles are
// unpacked once per call into bytes in vpdpbusd's order (a per-thread buffer the L1/L2 holds), then blocks of
// kBlockRows rows run kBlockRows x V int32 sums over one group of 32 inputs at a time, folded into fp32 sums, all in
// registers; rows pass in chunks whose int8 activations the L2 holds. On AVX2 a call of one row reads the nibbles in
// place instead (int4_q8_avx2.h's one_row).
// Layout: int4_linear_f32.cpp's (Int4Weight.pack_f32).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "int4_args.h"

namespace {

constexpr int64_t kTile = 64, kHalf = 32, kGroup = int4_args::kGroup, kBlockRows = 3, kOutliers = 4;
constexpr int64_t kHalfBytes = kGroup * 16;   // one half tile's nibbles for one group
constexpr int64_t kQuads = kGroup / 4;        // vpdpbusd's groups of 4 inputs in a group
constexpr int64_t kQuadBytes = 2 * 64;        // one half tile's bytes for 4 inputs: 2 vectors of 16 columns
constexpr int64_t kChunkBytes = 128 << 10;    // int8 activations a pass over a thread's half tiles takes at a time

// One row's kept inputs: their indices and exact values (value 0: none).
struct Kept {
  int32_t index[kOutliers];
  float value[kOutliers];
};

// The activations of the whole call, quantised once.
struct Rows {
  const int8_t* xq;   // [M, K]
  const float* scale;  // [M, G]
  const float* qsum;   // [M, G]
  const Kept* kept;    // [M]
  const float* down;   // [M]: what the sums are multiplied by (1 but for rows of tiny values)
};

// Of the n candidates (indices into work), the kOutliers of largest |work| (the first index on ties) into `kept`, and
// 0 in their place in `work`. The candidates hold every input at least as large as the kOutliers-th largest.
void take_largest(float* work, int32_t* cand, int64_t n, Kept& kept) {
  const int64_t found = std::min<int64_t>(n, kOutliers);
  std::partial_sort(cand, cand + found, cand + n, [work](int32_t a, int32_t b) {
    const float fa = std::fabs(work[a]), fb = std::fabs(work[b]);
    return fa > fb || (fa == fb && a < b);
  });
  for (int64_t e = 0; e < kOutliers; ++e) {
    kept.index[e] = e < found ? cand[e] : 0;
    kept.value[e] = e < found ? work[cand[e]] : 0.0f;
    if (e < found) work[cand[e]] = 0.0f;
  }
}

// What a row is multiplied by: a power of two where its largest magnitude is below 2^-100 (127 / amax would
// overflow), else 1. Exact both ways: the scaled values are normal, and the kept ones divide back to themselves.
inline float tiny_row_up(float largest) {
  int exponent = 0;
  std::frexp(largest, &exponent);
  return largest > 0 && largest < 0x1p-100f ? std::ldexp(1.0f, std::min(-exponent, 126)) : 1.0f;
}

// A row with inf or NaN: NaN scales (its outputs NaN), xq 0, nothing kept.
inline void quantize_bad_row(int64_t K, int8_t* xq, float* scale, float* qsum, Kept& kept) {
  const int64_t G = K / kGroup;
  std::memset(xq, 0, K);
  std::fill(scale, scale + G, std::nanf(""));
  std::fill(qsum, qsum + G, 0.0f);
  for (int e = 0; e < kOutliers; ++e) kept.index[e] = 0, kept.value[e] = 0.0f;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__F16C__)
#define PAGEDLLM_INT4_Q8 1
constexpr bool kSupported = true;

#include "lanes16.h"

inline __m512 half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc += w (unsigned bytes) . x4 (4 signed bytes in every lane); inline assembly, as int8_gemm.cpp says why.
inline void dpbusd(__m512i& acc, __m512i w, __m512i x4) { asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x4)); }

// Halves [h0, h1) of a tile's nibbles as bytes [G][kQuads][2 (h1 - h0)][64]: vector 2h' + n holds columns
// 32 (h0 + h') + 16 n + j in 32-bit lane j, its 4 inputs in the lane's bytes. The layout's 4 inputs x 16 bytes (input
// major) are one 64-byte load; vpermb makes them byte major. Their d and m in fp32 as [G][2][2 (h1 - h0)][16] in dm.
void unpack_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t G, int64_t h0, int64_t h1,
                 uint8_t* w, float* dm) {
  alignas(64) uint8_t order[64];
  for (int b = 0; b < 16; ++b)
    for (int k = 0; k < 4; ++k) order[4 * b + k] = static_cast<uint8_t>(16 * k + b);
  const __m512i idx = _mm512_load_si512(order), low = _mm512_set1_epi8(0x0F);
  const int64_t halves = h1 - h0, V = 2 * halves;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < V; ++c) {
      _mm512_store_ps(dm + (g * 2 * V + c) * 16, half16(sc + g * kTile + h0 * kHalf + 16 * c));
      _mm512_store_ps(dm + (g * 2 * V + V + c) * 16, half16(mn + g * kTile + h0 * kHalf + 16 * c));
    }
    for (int64_t h = h0; h < h1; ++h) {
      const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
      uint8_t* wg = w + g * kQuads * halves * kQuadBytes + (h - h0) * kQuadBytes;
#pragma GCC unroll 8
      for (int64_t j = 0; j < kQuads; ++j) {
        const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(p + 64 * j));
        uint8_t* wj = wg + j * halves * kQuadBytes;
        _mm512_store_si512(wj, _mm512_and_si512(v, low));
        _mm512_store_si512(wj + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    }
  }
}

// The row's kOutliers inputs of largest |x| (the first index on ties) into `kept`, and 0 in their place in `work`.
// Each of them is at least the kOutliers-th largest of the 16 lanes' maxima (`lanes`), so one pass gathers the few
// candidates (cand: room for K + 16 indices) and a sort of those picks them.
void keep_largest(float* work, int64_t K, __m512 lanes, int32_t* cand, Kept& kept) {
  alignas(64) float lane[16];
  _mm512_store_ps(lane, lanes);
  std::nth_element(lane, lane + kOutliers - 1, lane + 16, std::greater<float>());
  const float least = lane[kOutliers - 1];
  const __m512 t = _mm512_set1_ps(least > 0 ? least : std::numeric_limits<float>::denorm_min());
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t n = 0;
  for (int64_t k = 0; k < K; k += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(work + k)), t, _CMP_GE_OQ);
    // compressed in a register, then stored whole (a compressing store to memory is microcoded on AMD Zen 4)
    _mm512_storeu_si512(cand + n, _mm512_maskz_compress_epi32(hit, at));
    n += __builtin_popcount(hit);
  }
  take_largest(work, cand, n, kept);
}

// Row x (K inputs) into int8 per group (xq), each group's scale s and s * sum(xq) (scale, qsum), its kOutliers
// inputs of largest magnitude kept out (kept). A row with inf or NaN gets NaN scales (its outputs NaN) and xq 0; a
// row of tiny values (below 2^-100, where 127 / amax would overflow) is quantised times a power of two, whose inverse
// (down) the sums are multiplied by at the end: its scales in the scaled units keep their bits. work: room for 2K + 16
// floats.
template <typename T>
void quantize_row(const T* x, int64_t K, float* work, int8_t* xq, float* scale, float* qsum, Kept& kept,
                  float& down) {
  __m512 bad = _mm512_setzero_ps(), lanes = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load(x + k, 0xFFFF);
    bad = _mm512_or_ps(bad, _mm512_sub_ps(v, v));  // 0 for finite values, NaN otherwise
    lanes = _mm512_max_ps(lanes, _mm512_abs_ps(v));
  }
  const float up = tiny_row_up(_mm512_reduce_max_ps(lanes));
  for (int64_t k = 0; k < K; k += 16)
    _mm512_storeu_ps(work + k, _mm512_mul_ps(load(x + k, 0xFFFF), _mm512_set1_ps(up)));
  lanes = _mm512_mul_ps(lanes, _mm512_set1_ps(up));
  const int64_t G = K / kGroup;
  down = 1.0f;
  if (_mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q)) return quantize_bad_row(K, xq, scale, qsum, kept);
  keep_largest(work, K, lanes, reinterpret_cast<int32_t*>(work + K), kept);
  for (float& v : kept.value) v /= up;
  down = 1.0f / up;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 a = _mm512_loadu_ps(work + g * kGroup), b = _mm512_loadu_ps(work + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    // a group below 2^-120 (127 / amax would overflow) is at most 2^-20 of the row's largest: left out as zeros
    const __m512 inv = _mm512_set1_ps(amax >= 0x1p-120f ? 127.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    scale[g] = amax >= 0x1p-120f ? amax / 127.0f : 0.0f;
    qsum[g] = scale[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// R rows x V vectors of 16 columns (4: a tile, 2: a half) from the unpacked half tiles `w` and their d and m `dm`:
// per group, R x V int32 sums over its 32 inputs, then folded into fp32 sums, all in registers (6 rows, 24 int32
// sums and fp32 sums in L1, ran 0.88x as fast on AMD EPYC Zen 4); then each row's kept inputs with the exact weights
// (w's bytes). Out: fp32 or bf16.
template <int R, int V, typename Out>
void block_rows(const uint8_t* w, const float* dm, const Rows& x, int64_t r0, int64_t K, Out* out, int64_t N) {
  const int64_t G = K / kGroup;
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i sum[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) sum[r][c] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * kQuads * V * 64;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kQuads; ++j) {
      __m512i wj[V];
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) wj[c] = _mm512_load_si512(wg + (j * V + c) * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, x.xq + (r0 + r) * K + g * kGroup + 4 * j, sizeof(quad));
        const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int c = 0; c < V; ++c) dpbusd(sum[r][c], wj[c], xb);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) {
      const __m512 d = _mm512_load_ps(dm + (g * 2 * V + c) * 16), m = _mm512_load_ps(dm + (g * 2 * V + V + c) * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * G + g;
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][c]), ds, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.qsum[at]), acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const Kept& kept = x.kept[r0 + r];
    if (x.down[r0 + r] != 1.0f) {
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(x.down[r0 + r]));
    }
    for (int e = 0; e < kOutliers; ++e) {
      if (kept.value[e] == 0.0f) continue;
      const int64_t g = kept.index[e] / kGroup, k = kept.index[e] % kGroup;
      const __m512 v = _mm512_set1_ps(kept.value[e]);
      const uint8_t* wq = w + (g * kQuads + k / 4) * V * 64;  // input k's byte in each lane: k % 4
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) {
        const __m512i b = _mm512_srli_epi32(_mm512_load_si512(wq + c * 64), static_cast<int>(8 * (k % 4)));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xFF)));
        const __m512 wt = _mm512_fmadd_ps(q, _mm512_load_ps(dm + (g * 2 * V + c) * 16),
                                          _mm512_load_ps(dm + (g * 2 * V + V + c) * 16));
        acc[r][c] = _mm512_fmadd_ps(wt, v, acc[r][c]);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) store(out + (r0 + r) * N + 16 * c, acc[r][c], 0xFFFF);
  }
}

template <typename Out>
using BlockRows = void (*)(const uint8_t*, const float*, const Rows&, int64_t, int64_t, Out*, int64_t);
template <typename Out>
constexpr BlockRows<Out> kBlock[2][kBlockRows + 1] = {  // [halves - 1][rows]
    {nullptr, block_rows<1, 2, Out>, block_rows<2, 2, Out>, block_rows<3, 2, Out>},
    {nullptr, block_rows<1, 4, Out>, block_rows<2, 4, Out>, block_rows<3, 4, Out>}};

// Rows [c0, c1) against the unpacked halves (halves: 1 or 2 of a tile), kBlockRows at a time.
template <typename Out>
void run_rows(const uint8_t* w, const float* dm, const Rows& x, int64_t c0, int64_t c1, int64_t halves, int64_t K,
              Out* out, int64_t N) {
  for (int64_t r = c0; r < c1; r += kBlockRows)
    kBlock<Out>[halves - 1][std::min(kBlockRows, c1 - r)](w, dm, x, r, K, out, N);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_INT4_Q8 1
constexpr bool kSupported = true;
#include "int4_q8_avx2.h"
#else
constexpr bool kSupported = false;
#endif

#ifdef PAGEDLLM_INT4_Q8
// out [M, N] = x [M, K] @ W.T, x and out of one dtype T; the weight as int4_linear_q8 checked it.
template <typename T>
void multiply(const T* xp, const uint8_t* pk, const at::Half* sc, const at::Half* mn, const int4_args::Dims& dims,
              T* op) {
  const int64_t tiles = dims.T, G = dims.G, M = dims.M, K = dims.K, N = dims.N;
  const int64_t tile_bytes = G * 2 * kHalfBytes;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> scale_buf, qsum_buf;
  thread_local std::vector<Kept> kept_buf;
  thread_local std::vector<float> down_buf;
  xq_buf.resize(M * K);
  scale_buf.resize(M * G);
  qsum_buf.resize(M * G);
  kept_buf.resize(M);
  down_buf.resize(M);
  // this thread's buffers, named before the workers (whose own thread_local ones they are not) fill them
  int8_t* xq = xq_buf.data();
  float *scale = scale_buf.data(), *qsum = qsum_buf.data();
  Kept* kept = kept_buf.data();
  float* down = down_buf.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> work;
    work.resize(2 * K + 16);
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * K, K, work.data(), xq + r * K, scale + r * G, qsum + r * G, kept[r], down[r]);
  });
  const Rows rows{xq, scale, qsum, kept, down};
#ifdef PAGEDLLM_INT4_Q8_ONE_ROW
  if (M == 1) {  // the nibbles read in place
    at::parallel_for(0, 2 * tiles, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        one_row(pk + i / 2 * tile_bytes, sc + i / 2 * G * kTile, mn + i / 2 * G * kTile, rows, K, i % 2,
                op + i / 2 * kTile + i % 2 * kHalf);
    });
    return;
  }
#endif
  at::parallel_for(0, 2 * tiles, 1, [&](int64_t i0, int64_t i1) {
    // per thread, reused (a fresh buffer could fault its pages each call): the bytes, then d and m in fp32
    thread_local std::vector<uint8_t> panel;
    const size_t bytes = K * kTile + G * 2 * kTile * sizeof(float) + 64;
    if (panel.size() < bytes) panel.resize(bytes);
    uint8_t* w = panel.data() + (64 - reinterpret_cast<uintptr_t>(panel.data()) % 64) % 64;  // 64-byte aligned
    float* dm = reinterpret_cast<float*>(w + K * kTile);
    // rows in chunks whose int8 activations the L2 keeps while the thread's half tiles pass over them (unpacked
    // again per chunk, ~1% of a chunk's time): over all 1,024 rows at once the layers ran below oneDNN's speed
    const int64_t chunk = std::max<int64_t>(kBlockRows, kChunkBytes / K / kBlockRows * kBlockRows);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t i = i0; i < i1;) {
        const int64_t t = i / 2, h0 = i % 2, h1 = std::min<int64_t>(2, h0 + i1 - i);  // halves [h0, h1) of tile t
        unpack_tile(pk + t * tile_bytes, sc + t * G * kTile, mn + t * G * kTile, G, h0, h1, w, dm);
        run_rows(w, dm, rows, c0, c1, h1 - h0, K, op + t * kTile + h0 * kHalf, N);
        i += h1 - h0;
      }
    }
  });
}
#endif

}  // namespace

bool int4_linear_q8_supported() { return kSupported; }

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins) {
  TORCH_CHECK(kSupported, "int4_linear_q8 needs AVX512-VNNI and AVX512-VBMI, or AVX2 (this build has neither)");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int4_args::Dims dims = int4_args::check(x, bf16 ? at::kBFloat16 : at::kFloat, "float32 or bfloat16", packed,
                                                {2, kGroup, 16}, "[N/64, K/32, 2, 32, 16]", scales, mins, kTile);
  at::Tensor out = at::empty({dims.M, dims.N}, x.options());
  if (dims.M == 0) return out;
#ifdef PAGEDLLM_INT4_Q8
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  if (bf16)
    multiply(x.data_ptr<at::BFloat16>(), pk, sc, mn, dims, out.data_ptr<at::BFloat16>());
  else
    multiply(x.data_ptr<float>(), pk, sc, mn, dims, out.data_ptr<float>());
#endif
  return out;
}
