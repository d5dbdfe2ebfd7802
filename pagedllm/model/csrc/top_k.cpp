// The greedy logits pass: each row's k largest logits and its logsumexp in one read of the row
// (LlamaModel.top_logits), so that no fp32 [S, vocab] tensor, full-vocabulary topk or logsumexp is made; then, in a
// bf16 model, those candidates' logits recomputed in fp32 and the logsumexp corrected with them (rescore_top_k).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
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
      if (filled == k && !any_above(x + i, threshold)) continue;
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
    const float* xs = x.data();  // fp32 rows are read in place, others widened into x first
    if constexpr (std::is_same_v<T, float>) {
      xs = row + c0;
    } else {
      load_row(row + c0, x.data(), n);
    }
    const float cm = chunk_max(xs, n);
    if (cm == -INFINITY) continue;  // a chunk a grammar masked out entirely adds nothing (and -inf - -inf is NaN)
    if (cm > m) {
      s *= exp_nonpos(m - cm);
      m = cm;
    }
    s += chunk_exp_sum(xs, n, m);
    if (cm > top.threshold || top.filled < k) top.scan(xs, n, c0);
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

// 16 values as fp32 lanes: bf16 widened (its bits are an fp32's top half).
inline v16 widen16(const float* p) { return vload16(p); }
inline v16 widen16(const at::BFloat16* p) {
  uint16_t h[16];
  std::memcpy(h, p, sizeof(h));
  vu16 u;
  for (int i = 0; i < 16; ++i) u[i] = static_cast<uint32_t>(h[i]) << 16;
  return (v16)u;
}

// x (D fp32 values) . w (D values of W), in fp32.
template <typename W>
inline float dot(const float* x, const W* w, int64_t D) {
  v16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc += vload16(x + d) * widen16(w + d);
  float s = hsum16(acc);
  for (; d < D; ++d) s += x[d] * static_cast<float>(w[d]);
  return s;
}

// exact[s][j] = hidden[s] . weight[ids[s][j]] in fp32 for S rows of k ids, each row's hidden state widened once.
template <typename H, typename W>
void exact_rows(const H* hidden, const W* weight, int64_t ldw, const int64_t* ids, int64_t S, int64_t k, int64_t D,
                float* exact) {
  at::parallel_for(0, S, 8, [&](int64_t s0, int64_t s1) {
    std::vector<float> x(D);
    for (int64_t s = s0; s < s1; ++s) {
      for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(hidden[s * D + d]);
      for (int64_t j = 0; j < k; ++j) exact[s * k + j] = dot(x.data(), weight + ids[s * k + j] * ldw, D);
    }
  });
}

// Checks hidden [S, D], weight [V, D] (rows contiguous) and ids int64 [S, k] within the vocabulary, then fills
// exact [S, k] (fp32) by exact_rows.
void exact_logits_into(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, at::Tensor& exact) {
  check_rows(hidden, "hidden");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.size(1) == hidden.size(1) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  (weight.size(1) <= 1 || weight.stride(1) == 1),
              "weight must be float32 or bfloat16 [vocab, ", hidden.size(1), "] with contiguous rows");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous() &&
                  ids.size(0) == hidden.size(0), "ids must be a contiguous int64 [", hidden.size(0), ", k]");
  const int64_t S = ids.size(0), k = ids.size(1), D = hidden.size(1), V = weight.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(id, id + S * k, [&](int64_t t) { return t >= 0 && t < V; }), "ids must be tokens below ",
              V);
  exact = at::empty({S, k}, hidden.options().dtype(at::kFloat));
  const auto run = [&](const auto* h) {
    if (weight.scalar_type() == at::kFloat)
      exact_rows(h, weight.data_ptr<float>(), weight.stride(0), id, S, k, D, exact.data_ptr<float>());
    else
      exact_rows(h, weight.data_ptr<at::BFloat16>(), weight.stride(0), id, S, k, D, exact.data_ptr<float>());
  };
  if (hidden.scalar_type() == at::kFloat) run(hidden.data_ptr<float>());
  else run(hidden.data_ptr<at::BFloat16>());
}

}  // namespace

at::Tensor exact_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids) {
  at::Tensor exact;
  exact_logits_into(hidden, weight, ids, exact);
  return exact;
}

std::vector<at::Tensor> rescore_top_k(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& values,
                                      const at::Tensor& ids, const at::Tensor& lse) {
  at::Tensor exact;
  exact_logits_into(hidden, weight, ids, exact);
  const int64_t S = ids.size(0), k = ids.size(1);
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.sizes() == ids.sizes(),
              "values must be a contiguous float32 [S, k], as ids");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 1 && lse.size(0) == S,
              "lse must be a contiguous float32 [S]");
  at::Tensor out_lse = at::empty({S}, lse.options());
  const float *v = values.data_ptr<float>(), *l = lse.data_ptr<float>();
  float *e = exact.data_ptr<float>(), *ol = out_lse.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    // a candidate the grammar left out (-inf) stays out; the rest swap their rounded term in the sum for the exact one
    float rest = 1.0f, swapped = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      if (v[s * k + j] == -INFINITY) {
        e[s * k + j] = -INFINITY;
        continue;
      }
      rest -= std::exp(v[s * k + j] - l[s]);
      swapped += std::exp(e[s * k + j] - l[s]);
    }
    ol[s] = l[s] + std::log(std::max(rest, 0.0f) + swapped);
  }
  return {exact, out_lse};
}

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
