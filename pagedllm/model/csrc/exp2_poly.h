// 2^f for f in [-0.5, 0.5]: the degree-7 polynomial behind the kernels' exp (relative error ~1e-7). Shared by
// the vector code of paged_attention.cpp and vec16.h (v16: fused_ops.cpp, top_k.cpp) and their scalar tails (float).
#pragma once

template <typename V>
inline V exp2_poly(V f) {
  V p = f * 1.525273380405984e-05f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  return p * f + 1.0f;
}

// 2^f for f in [-0.5, 0.5] to a relative ~3e-6 (degree 4, fitted on Chebyshev nodes): for probabilities rounded to
// bf16 right after (steps of 4e-3), where the degree-7 polynomial's last digits are lost anyway.
template <typename V>
inline V exp2_poly4(V f) {
  V p = f * 0.009560510516166687f + 0.05591703951358795f;
  p = p * f + 0.24024981260299683f;
  p = p * f + 0.6931219696998596f;
  return p * f + 0.9999991655349731f;
}
