// The int8 GEMM of the w8a8 linear layers (Int8Weight), above all the lm_head: x [M, K] int8 (one scale per row,
// quantize_rows_int8) times W [N, K] int8 (one scale per output row), exact int32 sums, then scaled back to the
// output dtype straight into the output (out = acc * row_scale * col_scale (+ bias)), with no int32 [M, N]
// temporary. The lm_head's outlier channels (Int8Weight.mm) are added in the same pass, before the one rounding:
// as a bf16 addmm over the written logits afterwards, the greedy logits pass took 4.8 instead of 4.3 ms at 64 rows,
// 17.6 instead of 15.1 at 256 on Zen 5 (docs/scripts/logits_pass.py). The weight is packed once at load
// (Int8Weight); torch._int_mm got a plain weight on every call and oneDNN reordered it each time, which made the
// lm_head (K = 576, N = 49,152) no faster than bf16.
//
// vpdpbusd multiplies unsigned bytes (its first source) by signed bytes (its second). The activations are the
// second operand, a 4-byte group broadcast to all lanes, so they stay signed and
// the weights are stored unsigned, w + 128 (1..255, as w is -127..127); each product then carries 128 * x, and
// 128 * sum_k x[r, k] comes off each row's sums before the scales apply (exact in int32). The other way round (x
// shifted to u8, 128 * colsum(w) off each column) would cost a pass over the weight's columns.
// |sum| <= K * 255 * 127 must fit int32: K <= 66,308.
//
// Layout (Int8Weight.pack): output columns in panels of 64 (4 tiles of 16), inputs in groups of 4:
//   packed [P, K/4, 4, 64] uint8: byte 4j + b of [p, g, c] = W[64p + 16c + j, 4g + b] + 128   (j < 16, b < 4)
// rows past N (the last panel's padding) hold W = 0. One 64-byte load is one tile's k-group in vpdpbusd's lane
// order, and a panel's groups follow each other, so a pass over a panel reads one contiguous stream.
//
// Register blocking: 6 rows x 4 tiles of int32 sums (24 zmm) plus the 4 weight vectors and a row's broadcast group;
// the inner loop is 4 weight loads, 6 broadcasts and 24 vpdpbusd (broadcasting from memory in every vpdpbusd,
// {1to16}, made it 28 loads for 24 products, the bound: the lm_head ran 1.33-1.49 against 1.54-1.70 TOP/s at
// 64-256 rows on Zen 5, docs/scripts/gemm_kernels_speed.py). Threads claim runs of panels (and blocks of rows when M
// is large) as they go (claimed_for.h): a panel is 36 KB at K = 576, so it stays in L1/L2 while every row of x passes
// over it.
//
// Without VNNI (AVX2 and FMA: AMD EPYC before Zen 4, most desktop CPUs) int8_gemm_avx2.h's panel kernel reads the
// same packed weight and gives the same sums and bits with vpmaddubsw and vpmaddwd, for activations within +-64
// (int8_gemm_input_max; the callers quantise to it).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "claimed_for.h"
#include "int8_extra.h"

namespace {

constexpr int64_t kTile = 16, kTiles = 4, kPanel = kTile * kTiles, kMaxBlockRows = 192, kMaxK = 66308;
constexpr int64_t kClaimRun = 16;  // panels a thread claims at a time: 576 KB of the lm_head's at K = 576

// What the epilogue needs besides the sums: where they go, how they scale, and the outlier channels' product.
template <typename T, typename W = T>
struct Epilogue {
  const int32_t* xsum128;  // 128 * sum_k x[r, k] per row
  const float* row_scale;  // [M], unused for int32 output
  const float* col_scale;  // [N]
  const T* bias;           // [N] or nullptr
  T* out;
  int64_t ldo, n;          // row stride of out, valid columns
  const float* extra_x = nullptr;  // [M, E]: inputs kept out of the int8 product (Int8Weight's outlier channels)
  const W* extra_w = nullptr;      // the plain weight's rows, N columns each: channel j's at extra_w + extra_off[j]
  const int64_t* extra_off = nullptr;
  int64_t E = 0;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDLLM_INT8_GEMM 1
constexpr bool kSupported = true;
constexpr int64_t kRows = 6;  // rows per register block
constexpr int kInputMax = 127;  // the activations' range (the quantiser's; -128 never comes from it)

// The epilogue's loads and stores of one 16-column tile, fp32 or bf16 (T), masked to the tile's valid columns.
#include "lanes16.h"

// acc += w (unsigned bytes) . x4 (4 signed bytes in every lane). Inline assembly: GCC 12 compiles
// _mm512_dpbusd_epi32 with a register copy around every call (it does not tie the accumulator to the output):
// ~230 GOP/s for the 6 x 4 block.
inline void dpbusd(__m512i& acc, __m512i w, __m512i x4) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x4));
}

// R rows of x (row stride ldx) against one panel (G k-groups): sums in registers over all of K, then the epilogue
// for columns [col0, col0 + 64) of those rows.
template <int R, typename T, typename W>
inline void panel_rows(const uint8_t* panel, const int8_t* x, int64_t ldx, int64_t G, int64_t row0, int64_t col0,
                       const Epilogue<T, W>& e) {
  __m512i acc[R][kTiles];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kTiles; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = panel + g * kTiles * 64;
    __m512i w[kTiles];
#pragma GCC unroll 4
    for (int c = 0; c < kTiles; ++c) w[c] = _mm512_loadu_si512(wg + c * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t group;
      std::memcpy(&group, x + r * ldx + 4 * g, sizeof(group));
      const __m512i xb = _mm512_set1_epi32(group);
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c) dpbusd(acc[r][c], w[c], xb);
    }
  }
  __mmask16 masks[kTiles];
#pragma GCC unroll 4
  for (int c = 0; c < kTiles; ++c) {
    const int64_t valid = std::clamp<int64_t>(e.n - col0 - c * kTile, 0, kTile);
    masks[c] = static_cast<__mmask16>((1u << valid) - 1u);
  }
  if constexpr (std::is_same_v<T, int32_t>) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i shift = _mm512_set1_epi32(e.xsum128[row0 + r]);
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c)
        _mm512_mask_storeu_epi32(e.out + (row0 + r) * e.ldo + col0 + c * kTile, masks[c],
                                 _mm512_sub_epi32(acc[r][c], shift));
    }
    return;
  } else {
    // (acc * row_scale) * col_scale (+ bias in the same rounding), then + x_e * w_e for each outlier channel e in
    // turn, each an FMA, as dequantize_int32 computes them, so the two paths give the same bits
    __m512 v[R][kTiles];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i shift = _mm512_set1_epi32(e.xsum128[row0 + r]);
      const __m512 rs = _mm512_set1_ps(e.row_scale[row0 + r]);
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c) {
        const __m512 cs = load(e.col_scale + col0 + c * kTile, masks[c]);
        const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], shift)), rs);
        v[r][c] = e.bias == nullptr ? _mm512_mul_ps(a, cs)
                                    : _mm512_fmadd_ps(a, cs, load(e.bias + col0 + c * kTile, masks[c]));
      }
    }
    for (int64_t j = 0; j < e.E; ++j) {
      __m512 w[kTiles];
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c) w[c] = load(e.extra_w + e.extra_off[j] + col0 + c * kTile, masks[c]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_set1_ps(e.extra_x[(row0 + r) * e.E + j]);
#pragma GCC unroll 4
        for (int c = 0; c < kTiles; ++c) v[r][c] = _mm512_fmadd_ps(xe, w[c], v[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kTiles; ++c)
        if (masks[c] != 0) store(e.out + (row0 + r) * e.ldo + col0 + c * kTile, v[r][c], masks[c]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_INT8_GEMM 1
constexpr bool kSupported = true;
constexpr int64_t kRows = 6;
#include "int8_gemm_avx2.h"  // panel_rows a tile at a time, exact int32 sums by vpmaddubsw and vpmaddwd
#else
constexpr bool kSupported = false;
constexpr int kInputMax = 0;
#endif

#if defined(PAGEDLLM_INT8_GEMM)
// The last n < kRows rows of a block.
template <int R, typename T, typename W>
inline void panel_tail(int64_t n, const uint8_t* panel, const int8_t* x, int64_t ldx, int64_t G, int64_t row0,
                       int64_t col0, const Epilogue<T, W>& e) {
  if constexpr (R >= 1) {
    if (n == R) return panel_rows<R>(panel, x, ldx, G, row0, col0, e);
    panel_tail<R - 1>(n, panel, x, ldx, G, row0, col0, e);
  }
}

template <typename T, typename W>
void gemm(const int8_t* x, int64_t M, int64_t K, const uint8_t* packed, int64_t P, const Epilogue<T, W>& e) {
  const int64_t G = K / 4;
  // Blocks of rows when M is large (x's block stays in L2 while the panels pass; each block reads the weights once
  // more, ~1 ms against ~20 ms of arithmetic), and also when there are too few panels to share among the threads.
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
  while (blocks * P < 8 * threads && (M + blocks - 1) / blocks > kRows) blocks *= 2;
  int64_t row_block = (M + blocks - 1) / blocks;
  if (row_block > kRows) row_block = (row_block + kRows - 1) / kRows * kRows;
  blocks = (M + row_block - 1) / row_block;
  for_each_claimed(blocks * P, kClaimRun, [&](int64_t i, int64_t) {
    const int64_t rb = i / P, p = i % P;
    const uint8_t* panel = packed + p * G * kTiles * 64;
    const int64_t r1 = std::min(M, (rb + 1) * row_block);
    int64_t r = rb * row_block;
    for (; r + kRows <= r1; r += kRows) panel_rows<kRows>(panel, x + r * K, K, G, r, p * kPanel, e);
    if (r < r1) panel_tail<kRows - 1>(r1 - r, panel, x + r * K, K, G, r, p * kPanel, e);
  });
}
#endif

}  // namespace

bool int8_gemm_supported() { return kSupported; }

int64_t int8_gemm_input_max() { return kInputMax; }

void int8_gemm(const at::Tensor& q, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
               const c10::optional<at::Tensor>& col_scale, const c10::optional<at::Tensor>& bias, at::Tensor& out,
               const c10::optional<at::Tensor>& extra_x, const c10::optional<at::Tensor>& extra_w,
               const c10::optional<at::Tensor>& extra_rows) {
  TORCH_CHECK(kSupported, "int8_gemm needs AVX512-VNNI, or AVX2 and FMA (this build has neither)");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "q must be a contiguous int8 CPU matrix [M, K]");
  const int64_t M = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 4 == 0 && K > 0 && K <= kMaxK, "K must be a positive multiple of 4 up to ", kMaxK, ", got ", K);
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte && packed.size(1) == K / 4 && packed.size(2) == kTiles &&
                  packed.size(3) == 64,
              "packed must be a contiguous uint8 [N/64, K/4, 4, 64] (K = ", K, ")");
  const int64_t P = packed.size(0);
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == M && (out.size(1) <= 1 || out.stride(1) == 1),
              "out must be [M, N] with contiguous rows (a block of columns of a wider tensor is fine)");
  const int64_t N = out.size(1);
  TORCH_CHECK(M <= 1 || out.stride(0) >= N, "out's rows must not overlap");
  TORCH_CHECK(N <= P * kPanel && N > (P - 1) * kPanel, "out has ", N, " columns, packed holds ", P * kPanel);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kInt, "out must be float32, bfloat16 "
              "or int32 (the raw sums)");
  const std::vector<int64_t> off = extra_offsets(extra_x, extra_w, extra_rows, M, N);
  const int64_t E = static_cast<int64_t>(off.size());
  if (dtype == at::kInt) {
    TORCH_CHECK(!row_scale.has_value() && !col_scale.has_value() && !bias.has_value() && E == 0,
                "int32 output takes no scales, bias or extra product");
  } else {
    TORCH_CHECK(row_scale.has_value() && row_scale->scalar_type() == at::kFloat && row_scale->numel() == M &&
                    row_scale->is_contiguous(), "row_scale must be float32 [M]");
    TORCH_CHECK(col_scale.has_value() && col_scale->scalar_type() == at::kFloat && col_scale->numel() == N &&
                    col_scale->is_contiguous(), "col_scale must be float32 [N]");
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == N && bias->is_contiguous()),
                "bias must be [N] of out's dtype");
  }
  if (M == 0 || N == 0) return;
#if defined(PAGEDLLM_INT8_GEMM)
  const int8_t* q8 = q.data_ptr<int8_t>();
  std::vector<int32_t> xsum128(M);
  std::atomic<bool> in_range{true};
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int32_t s = 0, amax = 0;
      for (int64_t k = 0; k < K; ++k) s += q8[r * K + k], amax = std::max<int32_t>(amax, std::abs(q8[r * K + k]));
      xsum128[r] = 128 * s;
      if (amax > kInputMax) in_range.store(false, std::memory_order_relaxed);
    }
  });
  TORCH_CHECK(in_range.load(), "int8_gemm here takes activations within +-", kInputMax, " (int8_gemm_input_max)");
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  if (dtype == at::kInt) {
    gemm<int32_t, int32_t>(q8, M, K, pk, P,
                           {xsum128.data(), nullptr, nullptr, nullptr, out.data_ptr<int32_t>(), out.stride(0), N});
    return;
  }
  const auto run = [&](auto* o, auto* w) {
    using T = std::remove_pointer_t<decltype(o)>;
    using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    gemm<T, W>(q8, M, K, pk, P, {xsum128.data(), row_scale->data_ptr<float>(), col_scale->data_ptr<float>(), b, o,
                                 out.stride(0), N, E ? extra_x->data_ptr<float>() : nullptr, w, off.data(), E});
  };
  const bool w32 = E && extra_w->scalar_type() == at::kFloat;
  const auto with_w = [&](auto* o) {
    if (w32) run(o, extra_w->data_ptr<float>());
    else run(o, E ? extra_w->data_ptr<at::BFloat16>() : static_cast<at::BFloat16*>(nullptr));
  };
  if (dtype == at::kFloat) with_w(out.data_ptr<float>());
  else with_w(out.data_ptr<at::BFloat16>());
#endif
}
