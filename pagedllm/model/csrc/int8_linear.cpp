// Linear layers with int8 weights and int8 activations (w8a8), as llama.cpp computes by default: each activation
// row (token) is quantised on the fly with its own scale, each weight row (output channel) once at load; the int8
// matmul itself is torch._int_mm (oneDNN, VNNI). These two passes bracket it: quantise the rows, then scale the
// int32 products back in one pass (no fp32 [M, N] temporary), into a block of columns of the output when the
// caller runs the matmul a block of columns at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
void quantize_rows(const T* x, int8_t* q, float* scale, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    std::vector<float> v(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * n;
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        v[i] = static_cast<float>(row[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      const float inv = 1.0f / s;
      int8_t* out = q + r * n;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      scale[r] = s;
    }
  });
}

template <typename T>
void dequantize_rows(const int32_t* acc, const float* row_scale, const float* col_scale, const T* bias, T* out,
                     int64_t out_stride, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* a = acc + r * n;
      const float s = row_scale[r];
      T* o = out + r * out_stride;
      if (bias != nullptr) {
        for (int64_t i = 0; i < n; ++i)
          o[i] = static_cast<T>(static_cast<float>(a[i]) * s * col_scale[i] + static_cast<float>(bias[i]));
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(a[i]) * s * col_scale[i]);
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = at::empty({rows, n}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quantize_rows_int8", [&] {
    quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, n);
  });
  return {q, scale};
}

void dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                      const c10::optional<at::Tensor>& bias, at::Tensor& out) {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "dequantize_int32", [&] {
    const scalar_t* b = nullptr;
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == n && bias->is_contiguous(), "bad bias");
      b = bias->data_ptr<scalar_t>();
    }
    dequantize_rows<scalar_t>(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(),
                              b, out.data_ptr<scalar_t>(), out.stride(0), rows, n);
  });
}
