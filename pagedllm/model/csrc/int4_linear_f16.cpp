// x @ W.T for GGUF's 4-bit weights with fp16 products, x and the output in fp32 or bf16: on CPUs with AVX512-FP16,
// vfmadd231ph does 32 multiply-adds where vfmadd231ps does 16, at the same rate, and vdpbf16ps's 32 ran at 0.72x
// vfmadd231ps's rate on an Intel Xeon (model 207) whose AMX a VM hides, where oneDNN's bf16 ran at 0.55x fp32's.
//
// Numerics, not fp32's (the fp32 kernel, int4_linear_f32.cpp, stays the exact form): each weight is the exact fp32
// fma(q, d, m) rounded once to fp16 (11 significant bits, against bf16's 8), each activation row is scaled by a
// power of two and rounded to fp16, and each fp16 lane sums the products of kChunk / 2 inputs only before they are
// added in fp32. The scales keep every fp16 sum finite: the weights are scaled so that the largest is below 1 (the
// caller's w_scale), each row so that its largest is below 2^kRowBoundLog2, and kChunk / 2 * 2^kRowBoundLog2 < 65,504;
// both scales are powers of two, divided out exactly. On the default model's layer shapes the relative error of a
// product is ~1.0e-3 against rounding activations and weights to bf16's ~2.4e-3 (one outlier channel x30:
// docs/results/side_by_side/2026-11-30/xeon_fp16/int4_f16_speed.txt); bf16 activations are exact in fp16 but
// for magnitudes below 2^-14 of the row's scaled largest, and the bf16 output is the fp32 one rounded to nearest even.
// The engine runs it where `--dtype auto` chose fp32 or the model is bf16, quantization is left to it, and its
// measured route takes it (model/dispatch.py).
//
// Schedule (int4_linear_f32.cpp's wide one): the threads share half tiles of 32 output columns; each tile's panel
// (K inputs x 64 outputs, fp16, k pairs interleaved: see dequantize_tile) is dequantized once per call into a
// per-thread buffer the L2 holds, then blocks of kBlockRows rows run kBlockRows x 4 fp16 accumulators over kChunk
// inputs at a time, added into fp32 sums in L1. Measured on an Intel Xeon (model 207) with AVX512-FP16 and no AMX, 2
// threads: 1.1-1.3x int4_linear_f32's speed at 16 rows, 1.3-1.6x from 64 (docs/performance.md).
// Layout: int4_linear_f32.cpp's (Int4Weight.pack_f32).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int4_args.h"

namespace {

constexpr int64_t kTile = 64, kHalf = 32, kGroup = int4_args::kGroup, kBlockRows = 6;
constexpr int64_t kHalfBytes = kGroup * 16;  // one half tile's nibbles for one group
constexpr int64_t kChunk = 64;               // inputs summed in fp16 (32 in each lane) before fp32 takes them
constexpr int64_t kVec = 32, kPairRow = 4 * kVec;  // fp16 per vector (16 columns x 2 k), per k pair of a tile
constexpr int kRowBoundLog2 = 10;            // each scaled activation row's largest magnitude is below 2^this

#if defined(__AVX512FP16__) && defined(__AVX512F__)
constexpr bool kSupported = true;

#include "lanes16.h"

inline __m512 half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Two k's of 16 columns, fp32, as fp16 pairs: 32-bit lane j holds column j at k (low half) and at k + 1 (high).
inline __m512i pair_halves(__m512 at_k, __m512 at_k1) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i lo = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(at_k, kRound));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(at_k1, kRound));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// Halves [h0, h1) of a tile's weights, times `w_scale`, in fp16 as [K/2][4 vectors][16 columns][2 k's] in `w`: a
// 32-bit broadcast of two activations then multiplies both k's of 16 columns in one vfmadd231ph (a 16-bit broadcast
// takes a shuffle port the FMAs need).
void dequantize_tile(const uint8_t* packed, const at::Half* sc, const at::Half* mn, int64_t G, int64_t h0,
                     int64_t h1, float w_scale, _Float16* w) {
  const __m512 ws = _mm512_set1_ps(w_scale);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = h0; h < h1; ++h) {
      const at::Half* s = sc + g * kTile + h * kHalf;
      const at::Half* m = mn + g * kTile + h * kHalf;
      const __m512 d0 = _mm512_mul_ps(half16(s), ws), d1 = _mm512_mul_ps(half16(s + 16), ws);
      const __m512 m0 = _mm512_mul_ps(half16(m), ws), m1 = _mm512_mul_ps(half16(m + 16), ws);
      const uint8_t* p = packed + (g * 2 + h) * kHalfBytes;
      _Float16* wg = w + g * (kGroup / 2) * kPairRow + h * 2 * kVec;
#pragma GCC unroll 2
      for (int k = 0; k < kGroup; k += 2) {
        __m512 w0[2], w1[2];
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * (k + e))));
          w0[e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), d0, m0);
          w1[e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1);
        }
        _Float16* wk = wg + (k / 2) * kPairRow;
        _mm512_store_si512(reinterpret_cast<__m512i*>(wk), pair_halves(w0[0], w0[1]));
        _mm512_store_si512(reinterpret_cast<__m512i*>(wk + kVec), pair_halves(w1[0], w1[1]));
      }
    }
}

// Row r of x times a power of two (its largest magnitude below 2^kRowBoundLog2) in fp16; returns 1 / that power.
template <typename T>
float scaled_row(const T* x, int64_t K, _Float16* xh) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load(x + k, 0xFFFF)));
  const float largest = _mm512_reduce_max_ps(mx);
  int e = 0;
  std::frexp(largest, &e);  // largest = f * 2^e, f in [0.5, 1); 0, inf and NaN leave the row unscaled
  // at most 2^126 (a row of fp32 subnormals would otherwise ask for more than fp32 holds), so 1 / scale is normal too
  const float scale = std::isfinite(largest) && largest > 0 ? std::ldexp(1.0f, std::min(kRowBoundLog2 - e, 126)) : 1.0f;
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t k = 0; k < K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xh + k),
                        _mm512_cvtps_ph(_mm512_mul_ps(load(x + k, 0xFFFF), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return 1.0f / scale;
}

// The 32 fp16 sums of `a` added to two fp32 vectors in memory (still in pairs: column j's two k's side by side).
inline void add_halves(__m512h a, float* lo, float* hi) {
  const __m512i bits = _mm512_castph_si512(a);
  _mm512_store_ps(lo, _mm512_add_ps(_mm512_load_ps(lo), _mm512_cvtph_ps(_mm512_castsi512_si256(bits))));
  _mm512_store_ps(hi, _mm512_add_ps(_mm512_load_ps(hi), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1))));
}

// 16 columns from two vectors of 8 columns' (k, k + 1) pairs: each column's two sums added.
inline __m512 pair_sums(__m512 a, __m512 b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// R rows x V vectors of 16 columns of a panel (4: a tile, 2: a half), scaled back by `inv`. R * V fp16 accumulators
// take kChunk inputs (kChunk / 2 in each lane), then are added into fp32 sums kept in L1: the registers hold the fp16
// ones and a k pair's weights, so that each 64-byte load of the panel (from L2) feeds R FMAs. Out: fp32 or bf16.
template <int R, int V, typename Out>
void block_rows(const _Float16* w, const _Float16* x, const float* inv, int64_t K, Out* out, int64_t N) {
  alignas(64) float acc[R][2 * V][16];
  std::memset(acc, 0, sizeof(acc));
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    __m512h part[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) part[r][c] = _mm512_setzero_ph();
    const int64_t k1 = std::min(K, k0 + kChunk);
#pragma GCC unroll 2
    for (int64_t k = k0; k < k1; k += 2) {
      __m512h wk[V];
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) wk[c] = _mm512_load_ph(w + (k / 2) * kPairRow + kVec * c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + k, sizeof(pair));
        const __m512h xb = _mm512_castsi512_ph(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
        for (int c = 0; c < V; ++c) part[r][c] = _mm512_fmadd_ph(xb, wk[c], part[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) add_halves(part[r][c], acc[r][2 * c], acc[r][2 * c + 1]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c)
      store(out + r * N + 16 * c,
            _mm512_mul_ps(pair_sums(_mm512_load_ps(acc[r][2 * c]), _mm512_load_ps(acc[r][2 * c + 1])), s), 0xFFFF);
  }
}

template <typename Out>
using BlockRows = void (*)(const _Float16*, const _Float16*, const float*, int64_t, Out*, int64_t);
template <typename Out>
constexpr BlockRows<Out> kBlock[2][kBlockRows + 1] = {  // [halves - 1][rows]
    {nullptr, block_rows<1, 2, Out>, block_rows<2, 2, Out>, block_rows<3, 2, Out>, block_rows<4, 2, Out>,
     block_rows<5, 2, Out>, block_rows<6, 2, Out>},
    {nullptr, block_rows<1, 4, Out>, block_rows<2, 4, Out>, block_rows<3, 4, Out>, block_rows<4, 4, Out>,
     block_rows<5, 4, Out>, block_rows<6, 4, Out>}};

// out [M, N] = x [M, K] @ W.T, x and out of one dtype T; the weight as int4_linear_f16 checked it.
template <typename T>
void multiply(const T* xp, const uint8_t* pk, const at::Half* sc, const at::Half* mn, float w_scale,
              const int4_args::Dims& dims, T* op) {
  const int64_t tiles = dims.T, G = dims.G, M = dims.M, K = dims.K, N = dims.N;
  const int64_t tile_bytes = G * 2 * kHalfBytes;
  // The activations in fp16 once per call, each row with the power of two that bounds it.
  thread_local std::vector<_Float16> xh_buf;
  thread_local std::vector<float> inv_buf;
  xh_buf.resize(M * K);
  inv_buf.resize(M);
  _Float16* xh = xh_buf.data();
  float* inv = inv_buf.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) inv[r] = scaled_row(xp + r * K, K, xh + r * K) / w_scale;
  });
  at::parallel_for(0, 2 * tiles, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<_Float16> panel;  // per thread, reused: a fresh buffer could fault its pages each call
    if (panel.size() < static_cast<size_t>(K * kTile + 32)) panel.resize(K * kTile + 32);
    _Float16* w = panel.data() + (32 - reinterpret_cast<uintptr_t>(panel.data()) / 2 % 32) % 32;  // 64-byte aligned
    for (int64_t i = i0; i < i1;) {
      const int64_t t = i / 2, h0 = i % 2, h1 = std::min<int64_t>(2, h0 + i1 - i);  // halves [h0, h1) of tile t
      dequantize_tile(pk + t * tile_bytes, sc + t * G * kTile, mn + t * G * kTile, G, h0, h1, w_scale, w);
      for (int64_t r = 0; r < M; r += kBlockRows)
        kBlock<T>[h1 - h0 - 1][std::min(kBlockRows, M - r)](w + h0 * 2 * kVec, xh + r * K, inv + r, K,
                                                            op + r * N + t * kTile + h0 * kHalf, N);
      i += h1 - h0;
    }
  });
}
#else
constexpr bool kSupported = false;
#endif

}  // namespace

bool int4_linear_f16_supported() { return kSupported; }

at::Tensor int4_linear_f16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins, double w_scale) {
  TORCH_CHECK(kSupported, "int4_linear_f16 needs AVX512-FP16 (this build has none)");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int4_args::Dims dims = int4_args::check(x, bf16 ? at::kBFloat16 : at::kFloat, "float32 or bfloat16", packed,
                                                {2, kGroup, 16}, "[N/64, K/32, 2, 32, 16]", scales, mins, kTile);
  TORCH_CHECK(w_scale > 0 && std::isfinite(w_scale), "w_scale must be a positive power of two");
  at::Tensor out = at::empty({dims.M, dims.N}, x.options());
  if (dims.M == 0) return out;
#if defined(__AVX512FP16__) && defined(__AVX512F__)
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  const float ws = static_cast<float>(w_scale);
  if (bf16)
    multiply(x.data_ptr<at::BFloat16>(), pk, sc, mn, ws, dims, out.data_ptr<at::BFloat16>());
  else
    multiply(x.data_ptr<float>(), pk, sc, mn, ws, dims, out.data_ptr<float>());
#endif
  return out;
}
