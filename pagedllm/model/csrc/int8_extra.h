// The outlier channels' product that both int8 paths (int8_gemm, dequantize_int32) add into their output: inputs
// kept out of the int8 product (Int8Weight's outlier channels) times their rows of the plain weight.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

// Checks x [M, E] (contiguous float32) and w [E, N] (float32 or bfloat16, rows contiguous, any row stride): both or
// neither. Returns E (0: none).
int64_t extra_check(const c10::optional<at::Tensor>& x, const c10::optional<at::Tensor>& w, int64_t M, int64_t N);
