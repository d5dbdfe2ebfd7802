// The small ops of a decoder layer, fused: each is one pass over its rows instead of 5-10 aten ops, which at
// decode batch sizes cost more in dispatch and temporaries than in arithmetic.
//
// Numerics follow the unfused torch code in layers.py (and so transformers'): math in float32, results rounded
// to the tensor's dtype at the same points where a bf16 torch op would round. Loops are written plainly over
// float arrays so that -O3 -march=native vectorises them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "exp2_poly.h"

namespace {

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

// e^x for x <= 0 (relative error ~1e-7): 2^(x log2 e), integer part in the exponent, degree-7 polynomial.
inline float exp_nonpos(float x) {
  float t = x * 1.4426950408889634f;
  t = t < -125.0f ? -125.0f : t;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to an integer
  const float p = exp2_poly(t - n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// out = weight * rms_norm(residual), after residual += x when x is given (rounded to the dtype, as h = h + x).
template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> h(n), w(n);
    load_row(weight, w.data(), n);
    for (int64_t r = r0; r < r1; ++r) {
      T* res = residual + r * n;
      load_row(res, h.data(), n);
      if (x != nullptr) {
        const T* xr = x + r * n;
        for (int64_t i = 0; i < n; ++i) h[i] = rnd<T>(h[i] + static_cast<float>(xr[i]));
        store_row(h.data(), res, n);
      }
      float ss = 0.0f;
      for (int64_t i = 0; i < n; ++i) ss += h[i] * h[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) h[i] = rnd<T>(w[i] * rnd<T>(h[i] * inv));
      store_row(h.data(), out + r * n, n);
    }
  });
}

// out[r] = silu(gate[r]) * up[r] with gate_up[r] = [gate | up].
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    std::vector<float> g(n), u(n);
    for (int64_t r = r0; r < r1; ++r) {
      load_row(gate_up + r * 2 * n, g.data(), n);
      load_row(gate_up + r * 2 * n + n, u.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float a = g[i];
        const float e = exp_nonpos(a < 0.0f ? a : -a);  // e^-|a|: no overflow either side
        const float sig = a < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        g[i] = rnd<T>(rnd<T>(a * sig) * u[i]);
      }
      store_row(g.data(), out + r * n, n);
    }
  });
}

// In place: x[t, h] = x * cos[pos] + rotate_half(x) * sin[pos] for every head h (rotate-half convention).
template <typename T>
void rotary_rows(T* x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t heads, int64_t d,
                 const T* cos, const T* sin, const int64_t* positions) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, grain(heads * d), [&](int64_t t0, int64_t t1) {
    std::vector<float> c(d), s(d), v(d), o(d);
    for (int64_t t = t0; t < t1; ++t) {
      load_row(cos + positions[t] * d, c.data(), d);
      load_row(sin + positions[t] * d, s.data(), d);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * stride_t + h * stride_h;
        load_row(row, v.data(), d);
        for (int64_t i = 0; i < half; ++i)
          o[i] = rnd<T>(rnd<T>(v[i] * c[i]) + rnd<T>(-v[i + half] * s[i]));
        for (int64_t i = half; i < d; ++i)
          o[i] = rnd<T>(rnd<T>(v[i] * c[i]) + rnd<T>(v[i - half] * s[i]));
        store_row(o.data(), row, d);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-d tensor");
}

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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, residual.scalar_type(), "add_rms_norm", [&] {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
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
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary_", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(0), x.size(1), x.size(2),
                          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pos);
  });
}

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline v16 vload16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// e^x for x <= 0, 16 lanes at a time (exp_nonpos's arithmetic).
inline v16 exp_nonpos16(v16 x) {
  v16 t = x * 1.4426950408889634f;
  const v16 lo = v16{} - 125.0f;
  t = t < lo ? lo : t;
  const v16 n = (t + 12582912.0f) - 12582912.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  return exp2_poly(t - n) * (v16)bits;
}

inline float hmax16(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum16(v16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// The largest of x[0..n), and sum(exp(x - m)) once it is known: 16 lanes at a time, the tail one by one.
inline float chunk_max(const float* x, int64_t n) {
  v16 mv = v16{} - INFINITY;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = vload16(x + i);
    mv = v > mv ? v : mv;
  }
  float m = hmax16(mv);
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline float chunk_exp_sum(const float* x, int64_t n, float m) {
  v16 sv = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) sv += exp_nonpos16(vload16(x + i) - m);
  float s = hsum16(sv);
  for (; i < n; ++i) s += exp_nonpos(x[i] - m);
  return s;
}

// Keeps the k largest (value, index) pairs seen so far; `threshold` is the smallest kept once k are kept.
struct TopK {
  float* v;
  int64_t* ix;
  int64_t k, filled = 0, min_at = 0;
  float threshold = -INFINITY;

  void offer(float x, int64_t i) {
    if (filled == k && !(x > threshold)) return;
    if (filled < k) {
      v[filled] = x;
      ix[filled++] = i;
    } else {
      v[min_at] = x;
      ix[min_at] = i;
    }
    if (filled == k) {
      min_at = 0;
      for (int64_t j = 1; j < k; ++j)
        if (v[j] < v[min_at] || (v[j] == v[min_at] && ix[j] > ix[min_at])) min_at = j;
      threshold = v[min_at];
    }
  }

  // Offers x[0..n) (indices c0 + i), skipping 16 at a time those that cannot enter.
  void scan(const float* x, int64_t n, int64_t c0) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const vi16 above = vload16(x + i) > (v16{} + threshold);
      bool any = false;
      for (int j = 0; j < 16; ++j) any |= above[j] != 0;
      if (filled == k && !any) continue;
      for (int j = 0; j < 16; ++j) offer(x[i + j], c0 + i + j);
    }
    for (; i < n; ++i) offer(x[i], c0 + i);
  }
};

// One pass over a row of logits: its k largest (value, index) pairs, largest first, and log(sum(exp(row))).
// The sum runs online per chunk (running max and rescaled sum), so the row is read once; max, sum and the top-k
// filter run 16 lanes at a time (their scalar loops, which -O3 cannot vectorise without reassociating, took
// 12 ms for 256 rows of 49,152 logits: `python docs/scripts/logits_pass.py`).
template <typename T>
void top_k_logsumexp_row(const T* row, int64_t V, int64_t k, float* top_v, int64_t* top_i, float* lse) {
  std::vector<float> x(std::min<int64_t>(V, 4096));
  float m = -INFINITY, s = 0.0f;
  TopK top{top_v, top_i, k};
  for (int64_t c0 = 0; c0 < V; c0 += static_cast<int64_t>(x.size())) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(x.size()), V - c0);
    load_row(row + c0, x.data(), n);
    const float cm = chunk_max(x.data(), n);
    if (cm == -INFINITY) continue;  // a chunk a grammar masked out entirely adds nothing (and -inf - -inf is NaN)
    if (cm > m) {
      s *= exp_nonpos(m - cm);
      m = cm;
    }
    s += chunk_exp_sum(x.data(), n, m);
    if (cm > top.threshold || top.filled < k) top.scan(x.data(), n, c0);
  }
  for (int64_t j = top.filled; j < k; ++j) {  // fewer than k tokens allowed: the rest are -inf
    top_v[j] = -INFINITY;
    top_i[j] = 0;
  }
  // Largest first; among equal values the lower index first (what argmax picks).
  for (int64_t a = 1; a < k; ++a)
    for (int64_t b = a; b > 0 && (top_v[b] > top_v[b - 1] || (top_v[b] == top_v[b - 1] && top_i[b] < top_i[b - 1]));
         --b) {
      std::swap(top_v[b], top_v[b - 1]);
      std::swap(top_i[b], top_i[b - 1]);
    }
  *lse = m + std::log(s);
}

}  // namespace

std::vector<at::Tensor> top_k_logsumexp(const at::Tensor& logits, int64_t k) {
  check_rows(logits, "logits");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "k must be in [1, vocab]");
  at::Tensor values = at::empty({S, k}, logits.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({S, k}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({S}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "top_k_logsumexp", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    float* v = values.data_ptr<float>();
    int64_t* ix = indices.data_ptr<int64_t>();
    float* l = lse.data_ptr<float>();
    at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) top_k_logsumexp_row(base + r * V, V, k, v + r * k, ix + r * k, l + r);
    });
  });
  return {values, indices, lse};
}
