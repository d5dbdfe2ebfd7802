// The outlier channels' product that both int8 paths (int8_gemm, dequantize_int32) add into their output: inputs
// kept out of the int8 product (Int8Weight's outlier channels) times their rows of the plain weight.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// Checks x [M, E] (contiguous float32) and w (float32 or bfloat16, rows contiguous, any row stride, N columns): both
// or neither. Without `rows`, w is [E, N], one row a channel; with it (int64 [E]), channel j is w's row rows[j]
// (the whole transposed weight passed as it is, nothing gathered). Returns each channel's offset into w, in
// elements (none: no extra product).
std::vector<int64_t> extra_offsets(const c10::optional<at::Tensor>& x, const c10::optional<at::Tensor>& w,
                                   const c10::optional<at::Tensor>& rows, int64_t M, int64_t N);
