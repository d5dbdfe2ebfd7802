// The argument checks of the two 4-bit kernels (int4_linear.cpp in bf16, int4_linear_f32.cpp in fp32): both take
// x [M, K], nibbles packed [N/tile, K/32, ...] and fp16 scales and mins [N/tile, K/32, tile]; only x's dtype, the
// tile width and the packed layout within a tile's group differ.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>

namespace int4_args {

constexpr int64_t kGroup = 32;  // inputs per d and m (a GGUF Q4 block)

struct Dims {
  int64_t T, G, M, K, N;  // output tiles, input groups, rows of x, inputs, outputs
};

// `layout` is the packed tensor's sizes after [N/tile, K/32], `layout_text` the whole shape as the error names it.
inline Dims check(const at::Tensor& x, at::ScalarType x_dtype, const char* x_dtype_name, const at::Tensor& packed,
                  std::initializer_list<int64_t> layout, const char* layout_text, const at::Tensor& scales,
                  const at::Tensor& mins, int64_t tile) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == x_dtype, "x must be a contiguous ",
              x_dtype_name, " matrix");
  bool packed_ok = packed.dim() == 2 + static_cast<int64_t>(layout.size()) && packed.is_contiguous() &&
                   packed.scalar_type() == at::kByte;
  int64_t dim = 2;
  for (const int64_t size : layout) packed_ok = packed_ok && packed.size(dim++) == size;
  TORCH_CHECK(packed_ok, "packed must be contiguous uint8 ", layout_text);
  const int64_t T = packed.size(0), G = packed.size(1), M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == G * kGroup, "x has ", K, " columns, the weight ", G * kGroup);
  for (const at::Tensor* s : {&scales, &mins})
    TORCH_CHECK(s->is_contiguous() && s->scalar_type() == at::kHalf && s->dim() == 3 && s->size(0) == T &&
                    s->size(1) == G && s->size(2) == tile,
                "scales and mins must be contiguous float16 [N/", tile, ", K/32, ", tile, "]");
  return {T, G, M, K, T * tile};
}

}  // namespace int4_args
