// The small ops of a decoder layer, fused: each is one pass over its rows instead of 5-10 aten ops, which at
// decode batch sizes cost more in dispatch and temporaries than in arithmetic.
//
// Numerics follow the unfused torch code in layers.py (and so transformers'): math in float32, results rounded
// to the tensor's dtype at the same points where a bf16 torch op would round. Rows run 32 values at a time as
// two 16-lane vectors (GCC vector extensions: AVX-512 here, split by GCC elsewhere), a row's last n % 32 values
// one by one with the same arithmetic. As plain float loops they ran 2-5x slower (-O3 cannot vectorise the sum
// of squares without reassociating); these loops are bound by the vector ALUs, so ops per value count.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "exp2_poly.h"

namespace {

#include "vec16.h"


// float -> bfloat16 -> float, round to nearest even (what a bf16 torch op's store does); NaN stays NaN.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  u = (u & 0x7F800000u) == 0x7F800000u ? (u & 0xFFFF0000u) | ((u & 0xFFFFu) ? 0x400000u : 0u) : rounded;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

template <typename T>
inline float rnd(float x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return round_bf16(x);
  return x;
}

// round_bf16 on 16 lanes, without its branch for infinities and NaNs: every lane rounded here is computed from
// bf16 values, so a NaN is one of theirs or an invalid operation's (0xFFC00000), with its low 16 bits zero; the
// rounding add then leaves it (and an infinity) as that branch would.
template <typename T>
inline v16 rnd16(v16 x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const vu16 u = (vu16)x;
    return (v16)((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  }
  return x;
}


// 32 consecutive values of a row as two fp32 vectors. A bf16 row splits into its even values (shifted up) and
// odd values (masked) within each 32-bit word: one op per 16 values and no shuffles. Elementwise math does not
// mind which value a lane holds as long as every operand is loaded alike, and store32 puts them back.
struct v32 {
  v16 a, b;
};

inline v32 load32(const float* p) { return {vload16(p), vload16(p + 16)}; }
inline v32 load32(const at::BFloat16* p) {
  vu16 w;
  std::memcpy(&w, p, sizeof(w));
  return {(v16)(w << 16), (v16)(w & 0xFFFF0000u)};
}

// Stores values already rounded to the row's dtype.
inline void store32(float* p, v32 v) {
  vstore16(p, v.a);
  vstore16(p + 16, v.b);
}
inline void store32(at::BFloat16* p, v32 v) {
  const vu16 w = ((vu16)v.a >> 16) | (vu16)v.b;
  std::memcpy(p, &w, sizeof(w));
}




// Rows per parallel chunk, so that a second thread is woken only for ~8K input values or more: measured on 2
// threads, waking it costs ~1 us, and below that each op is faster alone (M = 1 never forks).
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_elems)); }

// The row functions below take every size and pointer by value: as a parallel_for lambda's captures, they were
// reloaded after every store (a store through T* may alias them).

// One row of add_rms_norm, in two passes: the add (stored) and the sum of squares, then the scaling, from the
// stored residual.
template <typename T>
void add_rms_norm_row(const T* x, T* res, const T* weight, T* out, int64_t n, float eps) {
  v16 acc_a = {}, acc_b = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    v32 h = load32(res + i);
    if (x != nullptr) {
      const v32 xv = load32(x + i);
      h = {rnd16<T>(h.a + xv.a), rnd16<T>(h.b + xv.b)};
      store32(res + i, h);
    }
    acc_a += h.a * h.a;
    acc_b += h.b * h.b;
  }
  float ss = hsum16(acc_a + acc_b);
  for (; i < n; ++i) {
    float h = static_cast<float>(res[i]);
    if (x != nullptr) {
      h = rnd<T>(h + static_cast<float>(x[i]));
      res[i] = static_cast<T>(h);
    }
    ss += h * h;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i + 32 <= n; i += 32) {
    const v32 h = load32(res + i), w = load32(weight + i);
    store32(out + i, {rnd16<T>(w.a * rnd16<T>(h.a * inv)), rnd16<T>(w.b * rnd16<T>(h.b * inv))});
  }
  for (; i < n; ++i)
    out[i] = static_cast<T>(rnd<T>(static_cast<float>(weight[i]) * rnd<T>(static_cast<float>(res[i]) * inv)));
}

// silu(a) * u for 16 lanes, rounded where torch's bf16 silu and mul round.
template <typename T>
inline v16 silu_mul16(v16 a, v16 u) {
  const v16 one = v16{} + 1.0f;
  const v16 e = exp_nonpos16((v16)((vu16)a | 0x80000000u));  // e^-|a|: no overflow either side
  // sigmoid: e / (1 + e) where a < 0, else 1 / (1 + e). Chosen by the sign bit (a = -0 has e = 1, either way):
  // a vector ?: on a comparison is scalarised by GCC where the 16 lanes span two AVX2 registers.
  const vu16 neg = (vu16)((vi16)a >> 31);
  const v16 sig = (v16)(((vu16)e & neg) | ((vu16)one & ~neg)) / (one + e);
  return rnd16<T>(rnd16<T>(a * sig) * u);
}

// out = silu(gate) * up for one row of n.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const v32 g = load32(gate + i), u = load32(up + i);
    store32(out + i, {silu_mul16<T>(g.a, u.a), silu_mul16<T>(g.b, u.b)});
  }
  for (; i < n; ++i) {
    const float a = static_cast<float>(gate[i]);
    const float e = exp_nonpos(a < 0.0f ? a : -a);
    const float sig = a < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
    out[i] = static_cast<T>(rnd<T>(rnd<T>(a * sig) * static_cast<float>(up[i])));
  }
}

// v * c + w * s for 16 lanes, each product and the sum rounded (three bf16 torch ops).
template <typename T>
inline v16 rotate16(v16 v, v16 c, v16 w, v16 s) {
  return rnd16<T>(rnd16<T>(v * c) + rnd16<T>(w * s));
}

// One token's heads rotated in place by its cos/sin rows; each 32 values of cos and sin serve every head.
template <typename T>
void rotary_token(T* x, int64_t stride_h, int64_t heads, int64_t d, const T* c, const T* s) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + 32 <= half; i += 32) {
    const v32 c1 = load32(c + i), c2 = load32(c + half + i), s1 = load32(s + i), s2 = load32(s + half + i);
    const v32 ns1 = {-s1.a, -s1.b};  // rotate_half's -x[half:] * sin: the same product as x[half:] * -sin
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + h * stride_h;
      const v32 v1 = load32(row + i), v2 = load32(row + half + i);
      store32(row + i, {rotate16<T>(v1.a, c1.a, v2.a, ns1.a), rotate16<T>(v1.b, c1.b, v2.b, ns1.b)});
      store32(row + half + i, {rotate16<T>(v2.a, c2.a, v1.a, s2.a), rotate16<T>(v2.b, c2.b, v1.b, s2.b)});
    }
  }
  for (; i < half; ++i) {
    const float c1 = static_cast<float>(c[i]), c2 = static_cast<float>(c[half + i]);
    const float s1 = static_cast<float>(s[i]), s2 = static_cast<float>(s[half + i]);
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + h * stride_h;
      const float v1 = static_cast<float>(row[i]), v2 = static_cast<float>(row[half + i]);
      row[i] = static_cast<T>(rnd<T>(rnd<T>(v1 * c1) + rnd<T>(-v2 * s1)));
      row[half + i] = static_cast<T>(rnd<T>(rnd<T>(v2 * c2) + rnd<T>(v1 * s2)));
    }
  }
}

// out = weight * rms_norm(residual), after residual += x when x is given (rounded to the dtype, as h = h + x).
template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      add_rms_norm_row(x != nullptr ? x + r * n : nullptr, residual + r * n, weight, out + r * n, n, eps);
  });
}

// out[r] = silu(gate[r]) * up[r] with gate_up[r] = [gate | up].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
  });
}

// In place: x[t, h] = x * cos[pos] + rotate_half(x) * sin[pos] for every head h (rotate-half convention).
template <typename T>
void rotary_rows(T* x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t heads, int64_t d,
                 const T* cos, const T* sin, const int64_t* positions) {
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      rotary_token(x + t * stride_t, stride_h, heads, d, cos + positions[t] * d, sin + positions[t] * d);
  });
}


// The dtypes check_rows admits; the row loops have no double path.
#define DISPATCH_FLOAT_BF16(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace

at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(residual, "residual");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.numel() == residual.size(1) &&
                  weight.scalar_type() == residual.scalar_type(),
              "weight must be a contiguous [hidden] tensor of the residual's dtype");
  if (x.has_value()) {
    check_rows(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes() && x->scalar_type() == residual.scalar_type(),
                "x and residual differ in shape or dtype");
  }
  at::Tensor out = at::empty_like(residual);
  const int64_t rows = residual.size(0), n = residual.size(1);
  DISPATCH_FLOAT_BF16(residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.has_value() ? x->data_ptr<scalar_t>() : nullptr, residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, float(eps));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  DISPATCH_FLOAT_BF16(gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with contiguous rows");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin must have x's dtype");
  TORCH_CHECK(cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() && x.size(2) % 2 == 0,
              "cos/sin must be [positions, head_dim] with an even head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "positions must be int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " out of range");
  DISPATCH_FLOAT_BF16(x.scalar_type(), "rotary_", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(0), x.size(1), x.size(2),
                          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pos);
  });
}
