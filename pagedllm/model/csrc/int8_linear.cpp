// Linear layers with int8 weights and int8 activations (w8a8), as llama.cpp computes by default: each activation
// row (token) is quantised on the fly with its own scale, each weight row (output channel) once at load; the int8
// matmul itself is torch._int_mm (oneDNN, VNNI). These two passes bracket it: quantise the rows, then scale the
// int32 products back in one pass (no fp32 [M, N] temporary), into a block of columns of the output when the
// caller runs the matmul a block of columns at a time. With AVX512-VNNI the matmul and the scale-back are one
// kernel instead (int8_gemm.cpp); quantize_rows_int8 serves both, and split_outliers_int8 where a call's largest
// input channels stay out of the int8 product (the lm_head's).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "int8_extra.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

// One row: scale = amax / qmax (1 for a row of zeros), q = round(x / scale) to nearest even, as x * (1 / scale),
// within +-qmax whatever the row holds (a NaN gives -qmax; an infinity makes the scale infinite, so the row's finite
// values give 0 and the infinity, as inf * 0, -qmax): int8_gemm refuses values past its range, and a step must not
// fail on a row gone wrong.
template <typename T>
void quantize_row(const T* row, int8_t* out, float* scale, int64_t n, float qmax) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // The same arithmetic 16 at a time: |x| by clearing the sign, the max is exact in any order, and vcvtps2dq
  // rounds to nearest even as nearbyint does.
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(load16(row + i, m)), abs_mask));
    vmax = _mm512_max_ps(v, vmax);  // a NaN is skipped, as std::max(amax, NaN) does
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const float s = amax > 0.0f ? amax / qmax : 1.0f;
  const __m512 inv = _mm512_set1_ps(1.0f / s), lo = _mm512_set1_ps(-qmax), hi = _mm512_set1_ps(qmax);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1u);
    const __m512 v = _mm512_max_ps(_mm512_mul_ps(load16(row + i, m), inv), lo);  // NaN -> lo (max's second operand)
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(v, hi));
    _mm_mask_storeu_epi8(out + i, m, _mm512_cvtsepi32_epi8(q));
  }
  *scale = s;
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(row[i])));
  const float s = amax > 0.0f ? amax / qmax : 1.0f;
  const float inv = 1.0f / s;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::fmax(static_cast<float>(row[i]) * inv, -qmax);  // NaN -> -qmax (fmax drops a NaN)
    out[i] = static_cast<int8_t>(std::nearbyint(std::fmin(v, qmax)));
  }
  *scale = s;
#endif
}

template <typename T>
void quantize_rows(const T* x, int8_t* q, float* scale, int64_t rows, int64_t n, float qmax) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * n, q + r * n, scale + r, n, qmax);
  });
}

// The E channels of x [rows, n] largest in magnitude over its rows (a NaN counts as largest), largest first, the
// lower channel first among equals: what torch's amax(0).topk(E) picks, in a fixed order.
template <typename T>
std::vector<int64_t> largest_channels(const T* x, int64_t rows, int64_t n, int64_t E) {
  std::vector<float> amax(n, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) {
      const float v = std::fabs(static_cast<float>(x[r * n + k]));
      amax[k] = std::isnan(v) ? INFINITY : std::max(amax[k], v);
    }
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) order[k] = k;
  std::partial_sort(order.begin(), order.begin() + E, order.end(), [&](int64_t a, int64_t b) {
    return amax[a] > amax[b] || (amax[a] == amax[b] && a < b);
  });
  order.resize(E);
  return order;
}

// Each row quantised without `channels` (zeroed first: the row's scale no longer has to hold them), and their
// values kept in fp32 (extra [rows, E]): index_fill, quantize_rows_int8 and index_select in one pass, the same
// bits.
template <typename T>
void quantize_rows_except(const T* x, const std::vector<int64_t>& channels, int8_t* q, float* scale, float* extra,
                          int64_t rows, int64_t n, float qmax) {
  const int64_t E = static_cast<int64_t>(channels.size());
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    std::vector<T> row(n);
    for (int64_t r = r0; r < r1; ++r) {
      std::copy(x + r * n, x + (r + 1) * n, row.begin());
      for (int64_t j = 0; j < E; ++j) {
        extra[r * E + j] = static_cast<float>(row[channels[j]]);
        row[channels[j]] = T(0.0f);
      }
      quantize_row(row.data(), q + r * n, scale + r, n, qmax);
    }
  });
}

// The outlier channels' product (int8_extra.h): x [rows, E], channel j's weights at w + off[j]; E = 0: none.
template <typename W>
struct Extra {
  const float* x;
  const W* w;
  const int64_t* off;
  int64_t E;
};

// v[q][0..m) += sum_j x[r0 + q, j] * w[j, i0 ..] for the R rows q < R (rows of v kCols apart): one FMA per channel
// j in turn, in int8_gemm's order (so the same bits); 64 columns of R rows at a time in registers across the
// channels, each of w's vectors widened once for the R rows.
constexpr int64_t kCols = 512, kExtraRows = 4;

template <int R, typename W>
void add_extra(float* v, int64_t m, const Extra<W>& ex, int64_t r0, int64_t i0) {
  const float* x = ex.x + r0 * ex.E;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i + 64 <= m; i += 64) {
    __m512 a[R][4];
    for (int q = 0; q < R; ++q)
      for (int t = 0; t < 4; ++t) a[q][t] = _mm512_loadu_ps(v + q * kCols + i + 16 * t);
    for (int64_t j = 0; j < ex.E; ++j) {
      const W* w = ex.w + ex.off[j] + i0 + i;
      __m512 wv[4];
      for (int t = 0; t < 4; ++t) wv[t] = load16(w + 16 * t, __mmask16(0xFFFF));
      for (int q = 0; q < R; ++q) {
        const __m512 xj = _mm512_set1_ps(x[q * ex.E + j]);
        for (int t = 0; t < 4; ++t) a[q][t] = _mm512_fmadd_ps(xj, wv[t], a[q][t]);
      }
    }
    for (int q = 0; q < R; ++q)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(v + q * kCols + i + 16 * t, a[q][t]);
  }
#endif
  // The rest (all of it without AVX-512): channel by channel over the columns, a loop GCC vectorises (AVX2 + FMA).
  for (int q = 0; q < R; ++q)
    for (int64_t j = 0; j < ex.E; ++j) {
      const float xj = x[q * ex.E + j];
      const W* w = ex.w + ex.off[j] + i0;
      float* vq = v + q * kCols;
      for (int64_t k = i; k < m; ++k) vq[k] = std::fma(xj, static_cast<float>(w[k]), vq[k]);
    }
}

template <typename W>
void add_extra_rows(int64_t R, float* v, int64_t m, const Extra<W>& ex, int64_t r0, int64_t i0) {
  switch (R) {
    case 4: return add_extra<4>(v, m, ex, r0, i0);
    case 3: return add_extra<3>(v, m, ex, r0, i0);
    case 2: return add_extra<2>(v, m, ex, r0, i0);
    default: return add_extra<1>(v, m, ex, r0, i0);
  }
}

template <typename T, typename W>
void dequantize_rows(const int32_t* acc, const float* row_scale, const float* col_scale, const T* bias, T* out,
                     int64_t out_stride, int64_t rows, int64_t n, const Extra<W>& ex) {
  // Blocks of kCols columns, every row of one block before the next, so that the block's extra_w rows (E x kCols)
  // stay in L1 across the rows (row by row over whole rows they came from L2 or beyond for every row).
  const int64_t blocks = (n + kCols - 1) / kCols;
  at::parallel_for(0, blocks, std::max<int64_t>(1, 16384 / (kCols * std::max<int64_t>(1, rows))), [&](int64_t b0,
                                                                                                      int64_t b1) {
    float v[kExtraRows * kCols];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kCols, m = std::min(kCols, n - i0);
      const float* cs = col_scale + i0;
      for (int64_t r0 = 0; r0 < rows; r0 += kExtraRows) {
        const int64_t R = std::min(kExtraRows, rows - r0);
        for (int64_t q = 0; q < R; ++q) {
          const int32_t* a = acc + (r0 + q) * n + i0;
          const float s = row_scale[r0 + q];
          float* vq = v + q * kCols;
          if (bias != nullptr) {
            const T* bb = bias + i0;
            for (int64_t i = 0; i < m; ++i) vq[i] = static_cast<float>(a[i]) * s * cs[i] + static_cast<float>(bb[i]);
          } else {
            for (int64_t i = 0; i < m; ++i) vq[i] = static_cast<float>(a[i]) * s * cs[i];
          }
        }
        if (ex.E > 0) add_extra_rows(R, v, m, ex, r0, i0);
        for (int64_t q = 0; q < R; ++q) {
          T* o = out + (r0 + q) * out_stride + i0;
          for (int64_t i = 0; i < m; ++i) o[i] = static_cast<T>(v[q * kCols + i]);
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t qmax) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(qmax >= 1 && qmax <= 127, "qmax must be 1..127, got ", qmax);
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options().dtype(at::kFloat));
  const float m = static_cast<float>(qmax);
  if (x.scalar_type() == at::kFloat)
    quantize_rows<float>(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, n, m);
  else
    quantize_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, n, m);
  return {q, scale};
}

std::vector<at::Tensor> split_outliers_int8(const at::Tensor& x, int64_t E, int64_t qmax) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(qmax >= 1 && qmax <= 127, "qmax must be 1..127, got ", qmax);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(E >= 1 && E <= n, "E must be 1..", n, " (the inputs), got ", E);
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options().dtype(at::kFloat));
  auto extra = at::empty({rows, E}, x.options().dtype(at::kFloat));
  auto channels = at::empty({E}, x.options().dtype(at::kLong));
  const auto run = [&](const auto* xs) {
    const std::vector<int64_t> picked = largest_channels(xs, rows, n, E);
    std::copy(picked.begin(), picked.end(), channels.data_ptr<int64_t>());
    quantize_rows_except(xs, picked, q.data_ptr<int8_t>(), scale.data_ptr<float>(), extra.data_ptr<float>(), rows, n,
                         static_cast<float>(qmax));
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>());
  return {q, scale, channels, extra};
}

std::vector<int64_t> extra_offsets(const c10::optional<at::Tensor>& x, const c10::optional<at::Tensor>& w,
                                   const c10::optional<at::Tensor>& rows, int64_t M, int64_t N) {
  TORCH_CHECK(x.has_value() == w.has_value(), "extra_x and extra_w go together");
  TORCH_CHECK(!rows.has_value() || x.has_value(), "extra_rows needs extra_x and extra_w");
  if (!x.has_value()) return {};
  TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->dim() == 2 && x->size(0) == M &&
                  x->is_contiguous(), "extra_x must be a contiguous float32 [M, E]");
  const int64_t E = x->size(1), W = rows.has_value() ? w->size(0) : E;
  TORCH_CHECK(w->device().is_cpu() && (w->scalar_type() == at::kFloat || w->scalar_type() == at::kBFloat16) &&
                  w->dim() == 2 && w->size(0) == W && w->size(1) == N && (N <= 1 || w->stride(1) == 1) &&
                  (W <= 1 || w->stride(0) >= N),
              "extra_w must be float32 or bfloat16 [E, N] (or, with extra_rows, [any, N]) with contiguous rows (E = ",
              E, ", N = ", N, ")");
  std::vector<int64_t> off(E);
  for (int64_t j = 0; j < E; ++j) off[j] = j * w->stride(0);
  if (rows.has_value()) {
    TORCH_CHECK(rows->device().is_cpu() && rows->scalar_type() == at::kLong && rows->dim() == 1 &&
                    rows->numel() == E && rows->is_contiguous(), "extra_rows must be a contiguous int64 [E]");
    const int64_t* r = rows->data_ptr<int64_t>();
    for (int64_t j = 0; j < E; ++j) {
      TORCH_CHECK(r[j] >= 0 && r[j] < W, "extra_rows[", j, "] = ", r[j], " is not a row of extra_w (", W, " rows)");
      off[j] = r[j] * w->stride(0);
    }
  }
  return off;
}

void dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                      const c10::optional<at::Tensor>& bias, at::Tensor& out, const c10::optional<at::Tensor>& extra_x,
                      const c10::optional<at::Tensor>& extra_w, const c10::optional<at::Tensor>& extra_rows) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(), "acc must be int32 [M, N]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == rows && row_scale.is_contiguous(),
              "row_scale must be float32 [M]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.numel() == n && col_scale.is_contiguous(),
              "col_scale must be float32 [N]");
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "out must be float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == n && (n <= 1 || out.stride(1) == 1),
              "out must be [M, N] with contiguous rows (a block of columns of a wider tensor is fine)");
  const std::vector<int64_t> off = extra_offsets(extra_x, extra_w, extra_rows, rows, n);
  const int64_t E = static_cast<int64_t>(off.size());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "dequantize_int32", [&] {
    const scalar_t* b = nullptr;
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == n && bias->is_contiguous(), "bad bias");
      b = bias->data_ptr<scalar_t>();
    }
    const auto run = [&](const auto* w) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
      const Extra<W> ex{E ? extra_x->data_ptr<float>() : nullptr, w, off.data(), E};
      dequantize_rows<scalar_t, W>(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(),
                                   b, out.data_ptr<scalar_t>(), out.stride(0), rows, n, ex);
    };
    if (E && extra_w->scalar_type() == at::kFloat) run(extra_w->data_ptr<float>());
    else run(E ? extra_w->data_ptr<at::BFloat16>() : static_cast<const at::BFloat16*>(nullptr));
  });
}
