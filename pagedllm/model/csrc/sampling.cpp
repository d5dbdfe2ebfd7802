// The sampled path's two passes over a row of fp32 logits (already divided by the temperature): where top-k and
// top-p cut the row, found without sorting the vocabulary, and the draw by inverse CDF with one uniform per row.
// Sorting 49,152 logits per row for top-p and one uniform per token for the draw made a sampled step cost about
// twice a greedy one (docs/performance.md, "Sampled requests").

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp2_poly.h"

namespace {

#include "vec16.h"

struct Weighted {
  float v;  // the logit
  float e;  // exp(logit - the row's max)
};

// e[i] = exp(x[i] - m) for the logits >= floor and above -inf (NaN and -inf weigh 0; exp_nonpos16 alone would
// give -inf 2^-125), 16 at a time; returns their sum, added in the chunks and order draw_row walks them in.
double weights(const float* x, int64_t V, float m, float floor, float* e) {
  const int64_t whole = V / 16 * 16;
  const v16 lo = v16{} + floor, neg_inf = v16{} - INFINITY;
  double total = 0.0;
  for (int64_t i = 0; i < whole; i += 16) {
    const v16 xv = vload16(x + i);
    const vi16 keep = (xv >= lo) & (xv > neg_inf);
    const v16 w = (v16)((vi16)exp_nonpos16(xv - m) & keep);
    vstore16(e + i, w);
    total += hsum16(w);
  }
  for (int64_t i = whole; i < V; ++i) {
    e[i] = x[i] >= floor && x[i] > -INFINITY ? exp_nonpos(x[i] - m) : 0.0f;
    total += e[i];
  }
  return total;
}

inline double weight_of(const Weighted* c, int64_t n) {
  double w = 0.0;
  for (int64_t i = 0; i < n; ++i) w += c[i].e;
  return w;
}

// The smallest value v among c[0..n) such that `below` plus the weight of the values <= v exceeds `cut`: the
// smallest logit top-p keeps. Quickselect on the weight: each round partitions at a pivot and keeps the side
// that holds the boundary, so the cost is linear in n, not n log n. Values equal to the boundary's are all kept.
float mass_boundary(Weighted* c, int64_t n, double below, double cut) {
  int64_t lo = 0, hi = n;
  const auto less = [](const Weighted& a, const Weighted& b) { return a.v < b.v; };
  while (hi - lo > 32) {
    Weighted trio[3] = {c[lo], c[lo + (hi - lo) / 2], c[hi - 1]};
    std::sort(trio, trio + 3, less);
    const float pivot = trio[1].v;
    Weighted* mid = std::partition(c + lo, c + hi, [&](const Weighted& w) { return w.v < pivot; });
    if (mid == c + lo) {  // the pivot is the least value: take its ties as one group
      mid = std::partition(c + lo, c + hi, [&](const Weighted& w) { return w.v <= pivot; });
      const double w = weight_of(c + lo, mid - (c + lo));
      if (below + w > cut) return pivot;
      below += w;
      lo = mid - c;
      continue;
    }
    const double w = weight_of(c + lo, mid - (c + lo));
    if (below + w > cut) {
      hi = mid - c;
    } else {
      below += w;
      lo = mid - c;
    }
  }
  std::sort(c + lo, c + hi, less);
  for (int64_t i = lo; i < hi; ++i) {
    below += c[i].e;
    if (below > cut) return c[i].v;
  }
  return hi > lo ? c[hi - 1].v : INFINITY;  // rounding left the boundary past the last value: keep the largest
}

// One row's threshold: keep the logits >= it. top-k keeps the k largest (and their ties); top-p then drops the
// longest low tail whose share of the survivors' probability is <= 1 - p (vLLM's rule), always keeping the top.
// Any token whose share is at most (1 - p) / n (n survivors) is in that tail, so only the rest are selected among;
// they are found 16 at a time (a serial sum over the row's 49,152 weights had taken 4x the rest of the pass).
float row_threshold(const float* x, int64_t V, int64_t k, double p, std::vector<float>& scratch,
                    std::vector<Weighted>& cand) {
  float kth = -INFINITY;
  int64_t n = V;
  if (k < V) {
    scratch.assign(x, x + V);
    for (float& v : scratch) v = std::isnan(v) ? -INFINITY : v;
    std::nth_element(scratch.begin(), scratch.begin() + (V - k), scratch.end());
    kth = scratch[V - k];
    n = k;
  }
  if (!(p < 1.0)) return kth;
  const float m = chunk_max(x, V);
  if (m == -INFINITY) return kth;
  scratch.resize(V);
  float* e = scratch.data();
  const double total = weights(x, V, m, kth, e);
  const double cut = (1.0 - p) * total;
  const float floor_e = static_cast<float>(cut / static_cast<double>(n));
  cand.clear();
  double kept = 0.0;
  const auto offer = [&](int64_t i) {
    if (e[i] > floor_e) {
      cand.push_back({x[i], e[i]});
      kept += e[i];
    }
  };
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    if (any_above(e + i, floor_e))
      for (int64_t j = i; j < i + 16; ++j) offer(j);
  for (; i < V; ++i) offer(i);
  // never above the top logit: a top_p that rounds to 0 in float32 on a flat row leaves no candidate above the floor
  const float boundary = mass_boundary(cand.data(), static_cast<int64_t>(cand.size()), total - kept, cut);
  return std::max(kth, std::min(boundary, m));
}

// The index of row x[0..V) drawn with probability softmax(x): the first whose cumulative weight passes u times the
// total. The total is summed in the same chunks, in the same order, as the walk, so the walk always ends inside
// the row; -inf (weight 0) and NaN logits are never drawn. A row with nothing to draw gives 0.
int64_t draw_row(const float* x, int64_t V, float u, std::vector<float>& e) {
  const float m = chunk_max(x, V);
  if (m == -INFINITY) return 0;
  e.resize(V);
  const int64_t whole = V / 16 * 16;
  const double total = weights(x, V, m, -INFINITY, e.data());
  const double target = static_cast<double>(u) * total;
  double acc = 0.0;
  int64_t i = 0;
  for (; i < whole; i += 16) {
    const double chunk = hsum16(vload16(e.data() + i));
    if (acc + chunk > target) break;
    acc += chunk;
  }
  int64_t last = -1;
  for (; i < V; ++i) {
    if (e[i] <= 0.0f) continue;
    last = i;
    acc += e[i];
    if (acc > target) return i;
  }
  if (last >= 0) return last;  // u * total rounded up to the total: the last token that can be drawn
  for (i = V - 1; i >= 0 && !(e[i] > 0.0f); --i) {
  }
  return std::max<int64_t>(i, 0);
}

void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous(), "logits must be a contiguous float32 [S, vocab] CPU tensor");
}

void check_per_row(const at::Tensor& t, at::ScalarType type, int64_t S, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == S && t.is_contiguous(),
              name, " must be a contiguous 1-d CPU tensor of ", S, " ", c10::toString(type));
}

}  // namespace

at::Tensor truncate_(at::Tensor& logits, const c10::optional<at::Tensor>& top_k,
                     const c10::optional<at::Tensor>& top_p) {
  check_logits(logits);
  const int64_t S = logits.size(0), V = logits.size(1);
  if (top_k) check_per_row(*top_k, at::kLong, S, "top_k");
  if (top_p) check_per_row(*top_p, at::kFloat, S, "top_p");
  const int64_t* k = top_k ? top_k->data_ptr<int64_t>() : nullptr;
  const float* p = top_p ? top_p->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({S}, logits.options());
  float* x = logits.data_ptr<float>();
  float* t = out.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch;
    std::vector<Weighted> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t kr = k && k[r] > 0 ? std::min(k[r], V) : V;
      const double pr = p ? std::clamp(static_cast<double>(p[r]), 0.0, 1.0) : 1.0;
      float* row = x + r * V;
      t[r] = row_threshold(row, V, kr, pr, scratch, cand);
      if (t[r] == -INFINITY) continue;  // no top-k and top_p 1 (or a row of -inf): nothing to mask
      for (int64_t i = 0; i < V; ++i) row[i] = row[i] < t[r] ? -INFINITY : row[i];
    }
  });
  return out;
}

at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& u) {
  check_logits(logits);
  const int64_t S = logits.size(0), V = logits.size(1);
  check_per_row(u, at::kFloat, S, "u");
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* ur = u.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e;
    for (int64_t r = r0; r < r1; ++r) o[r] = draw_row(x + r * V, V, std::clamp(ur[r], 0.0f, 1.0f), e);
  });
  return out;
}
