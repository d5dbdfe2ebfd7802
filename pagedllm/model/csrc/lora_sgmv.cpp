// Batched multi-LoRA: Punica's SGMV (segmented gather matmul) on the CPU. A step's adapter tokens, sorted by adapter
// slot, form segments; for one fused matmul of one layer, out[t] += B_slot (A_slot x[t]) for every token t of every
// segment, with no padding: each segment reads its adapter's A and B once per tile of its own tokens.
//
// Two passes, each spread over the threads as work items taken dynamically:
//  - shrink: (segment, tile of tokens, block of up to 64 rank columns) -> h = x A, fp32, in a small scratch
//    [tokens, W]; the fused matmul's projections (q/k/v, gate/up) sit side by side in A, so qkv is one shrink of width
//    3 * rank (up to the last column the segment's adapter uses).
//  - expand: (segment, block of tokens, tile of 64 output columns of one projection) -> out += h B, reading only
//    the rows of that projection's rank in the segment's adapter (B is block-diagonal over the projections, ranks
//    are padded to the largest: those zeros are never read; a projection the adapter does not target costs nothing).
// Rows of x and out are read and written in place through the sorted token index (no gather or scatter copies).
// Weights, x and out are float32 or bfloat16 (all one dtype), accumulation in fp32. Vectors are GCC vector
// extensions (16 floats): AVX-512 with -march=native where present, narrower registers elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

constexpr int kShrinkTokens = 6;     // tokens per shrink micro-kernel (x up to 4 vectors: 24 accumulators)
constexpr int kExpandTokens = 4;     // tokens per expand micro-kernel (x up to 4 vectors: 16 accumulators)
constexpr int64_t kColumns = 64;     // output (or rank) columns per work item
constexpr int64_t kTokenBlock = 64;  // tokens per expand work item
constexpr int64_t kPrefetchRows = 8; // weight rows fetched ahead of the one multiplied

inline v16 vset(float x) { return v16{} + x; }
inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16 load16(const at::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v16)(__builtin_convertvector(h, vu16) << 16);
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline void store16(at::BFloat16* p, v16 v) {  // round to nearest even, as c10::BFloat16 does for finite values
  vu16 u = (vu16)v;
  u += 0x7FFFu + ((u >> 16) & 1u);
  const vh16 h = __builtin_convertvector(u >> 16, vh16);
  std::memcpy(p, &h, sizeof(h));
}

// h[t][0, 16 NV) = x[t] . A[:, 0, 16 NV) for kShrinkTokens rows (a partial tile repeats a row into a dummy h row).
template <typename T, int NV>
void shrink_tile(const T* const* xr, const T* a, int64_t in, int64_t lda, float* const* hr) {
  v16 acc[kShrinkTokens][NV] = {};
  for (int64_t i = 0; i < in; ++i) {
    v16 av[NV];
    for (int v = 0; v < NV; ++v) {
      __builtin_prefetch(a + (i + kPrefetchRows) * lda + 16 * v);
      av[v] = load16(a + i * lda + 16 * v);
    }
    for (int t = 0; t < kShrinkTokens; ++t) {
      const v16 xv = vset(to_f32(xr[t][i]));
      for (int v = 0; v < NV; ++v) acc[t][v] += xv * av[v];
    }
  }
  for (int t = 0; t < kShrinkTokens; ++t)
    for (int v = 0; v < NV; ++v) store16(hr[t] + 16 * v, acc[t][v]);
}

// out[t][0, 16 NC) += h[t][0, rank) . B[0, rank)[0, 16 NC) for kExpandTokens rows (a partial tile writes dummies).
template <typename T, int NC>
void expand_tile(T* const* outr, const float* const* hr, const T* b, int64_t rank, int64_t ldb) {
  v16 acc[kExpandTokens][NC] = {};
  for (int64_t r = 0; r < rank; ++r) {
    v16 bv[NC];
    for (int v = 0; v < NC; ++v) {
      __builtin_prefetch(b + (r + kPrefetchRows) * ldb + 16 * v);
      bv[v] = load16(b + r * ldb + 16 * v);
    }
    for (int t = 0; t < kExpandTokens; ++t) {
      const v16 hv = vset(hr[t][r]);
      for (int v = 0; v < NC; ++v) acc[t][v] += hv * bv[v];
    }
  }
  for (int t = 0; t < kExpandTokens; ++t)
    for (int v = 0; v < NC; ++v) store16(outr[t] + 16 * v, load16(outr[t] + 16 * v) + acc[t][v]);
}

// Columns past the last whole vector of a projection, one at a time.
template <typename T>
void expand_tail(T* const* outr, const float* const* hr, const T* b, int64_t rank, int64_t ldb, int64_t n) {
  for (int t = 0; t < kExpandTokens; ++t)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      for (int64_t r = 0; r < rank; ++r) s += hr[t][r] * to_f32(b[r * ldb + c]);
      outr[t][c] = static_cast<T>(to_f32(outr[t][c]) + s);
    }
}

struct Item {
  int64_t seg, t0, t1, c0, c1, r0, rank;  // a segment's sorted positions [t0, t1), columns [c0, c1), rank rows
                                          // [r0, r0 + rank)
};

struct Problem {
  int64_t in, out_features, W, rank, num_segments, num_projections;
  const int64_t* tokens;  // sorted position -> token (row of x and out)
  const int64_t* starts;  // segment -> its first sorted position; [S + 1]
  const int64_t* slots;   // segment -> its adapter's slot in A and B
  const int64_t* ranks;   // slot -> each projection's rank in it [slots, n] (0: not targeted)

  int64_t rank_of(int64_t seg, int64_t p) const { return ranks[slots[seg] * num_projections + p]; }
  // A's columns a segment's adapter uses, rounded up to a vector (0: it targets none of the projections)
  int64_t columns(int64_t seg) const {
    int64_t used = 0;
    for (int64_t p = 0; p < num_projections; ++p)
      if (rank_of(seg, p) > 0) used = p * rank + rank_of(seg, p);
    return (used + 15) / 16 * 16;
  }
};

// Runs fn(item) for every item, the items taken in order by whichever thread is free.
template <typename F>
void run_items(const std::vector<Item>& items, F fn) {
  std::atomic<size_t> next{0};
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, std::max<int64_t>(nthreads, 1), 1, [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) fn(items[i]);
  });
}

// h[position] = x[tokens[position]] A_slot, fp32, for every sorted position.
template <typename T>
void shrink(const Problem& P, const T* x, int64_t ldx, const T* a, float* h) {
  std::vector<Item> items;
  for (int64_t s = 0; s < P.num_segments; ++s)
    for (int64_t t0 = P.starts[s]; t0 < P.starts[s + 1]; t0 += kShrinkTokens)
      for (int64_t c0 = 0, used = P.columns(s); c0 < used; c0 += kColumns)
        items.push_back({s, t0, std::min(t0 + kShrinkTokens, P.starts[s + 1]), c0, std::min(c0 + kColumns, used),
                         0, 0});
  run_items(items, [&](const Item& it) {
    const T* xr[kShrinkTokens];
    float* hr[kShrinkTokens];
    float dummy[kColumns];
    for (int t = 0; t < kShrinkTokens; ++t) {
      const int64_t p = std::min(it.t0 + t, it.t1 - 1);
      xr[t] = x + P.tokens[p] * ldx;
      hr[t] = it.t0 + t < it.t1 ? h + p * P.W + it.c0 : dummy;
    }
    const T* as = a + P.slots[it.seg] * P.in * P.W + it.c0;
    switch ((it.c1 - it.c0) / 16) {
      case 1: shrink_tile<T, 1>(xr, as, P.in, P.W, hr); break;
      case 2: shrink_tile<T, 2>(xr, as, P.in, P.W, hr); break;
      case 3: shrink_tile<T, 3>(xr, as, P.in, P.W, hr); break;
      default: shrink_tile<T, 4>(xr, as, P.in, P.W, hr); break;
    }
  });
}

// out[tokens[position]] += h[position] B_slot, each projection's columns from its own rank rows only.
template <typename T>
void expand(const Problem& P, const std::vector<int64_t>& widths, const float* h, const T* b, T* out,
            int64_t ldo) {
  std::vector<Item> items;
  for (int64_t s = 0; s < P.num_segments; ++s)
    for (int64_t t0 = P.starts[s]; t0 < P.starts[s + 1]; t0 += kTokenBlock)
      for (int64_t p = 0, start = 0; p < static_cast<int64_t>(widths.size()); start += widths[p++])
        for (int64_t c0 = start; P.rank_of(s, p) > 0 && c0 < start + widths[p]; c0 += kColumns)
          items.push_back({s, t0, std::min(t0 + kTokenBlock, P.starts[s + 1]), c0,
                           std::min(c0 + kColumns, start + widths[p]), p * P.rank, P.rank_of(s, p)});
  const std::vector<float> zeros(P.W, 0.0f);
  run_items(items, [&](const Item& it) {
    T dummy[kColumns];
    const T* bs = b + P.slots[it.seg] * P.W * P.out_features + it.r0 * P.out_features + it.c0;
    const int64_t whole = (it.c1 - it.c0) / 16, tail = (it.c1 - it.c0) % 16;
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += kExpandTokens) {
      T* outr[kExpandTokens];
      const float* hr[kExpandTokens];
      for (int t = 0; t < kExpandTokens; ++t) {
        const bool real = t0 + t < it.t1;
        outr[t] = real ? out + P.tokens[t0 + t] * ldo + it.c0 : dummy;
        hr[t] = (real ? h + (t0 + t) * P.W : zeros.data()) + it.r0;
      }
      switch (whole) {
        case 0: break;
        case 1: expand_tile<T, 1>(outr, hr, bs, it.rank, P.out_features); break;
        case 2: expand_tile<T, 2>(outr, hr, bs, it.rank, P.out_features); break;
        case 3: expand_tile<T, 3>(outr, hr, bs, it.rank, P.out_features); break;
        default: expand_tile<T, 4>(outr, hr, bs, it.rank, P.out_features); break;
      }
      if (tail) {
        for (int t = 0; t < kExpandTokens; ++t) outr[t] += whole * 16;
        expand_tail<T>(outr, hr, bs + whole * 16, it.rank, P.out_features, tail);
      }
    }
  });
}

}  // namespace

void lora_sgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& tokens, const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& ranks,
               int64_t rank, const std::vector<int64_t>& widths) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_sgmv: x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype && a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_sgmv: out, x, A and B must share a dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_sgmv: x [T, in] and out [T, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(1) == x.size(1) && a.size(2) == b.size(1) && b.size(2) == out.size(1),
              "lora_sgmv: A [slots, in, W] and B [slots, W, out], contiguous");
  const int64_t W = a.size(2), n = static_cast<int64_t>(widths.size());
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  TORCH_CHECK(W % 16 == 0 && n > 0 && n * rank <= W && total == out.size(1),
              "lora_sgmv: W must be a multiple of 16 holding the projections' ranks, widths must sum to out's");
  for (const at::Tensor* t : {&tokens, &starts, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "lora_sgmv: int64 indices");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous(), "lora_sgmv: int64 ranks");
  const int64_t S = slots.size(0), N = tokens.size(0);
  TORCH_CHECK(ranks.numel() == a.size(0) * n, "lora_sgmv: ranks must be [slots, projections]");
  for (int64_t i = 0; i < ranks.numel(); ++i)
    TORCH_CHECK(ranks.data_ptr<int64_t>()[i] >= 0 && ranks.data_ptr<int64_t>()[i] <= rank, "lora_sgmv: bad rank");
  TORCH_CHECK(starts.size(0) == S + 1, "lora_sgmv: starts must have one more entry than slots");
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || (st[0] == 0 && st[S] == N), "lora_sgmv: segments must cover the sorted tokens");
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(st[s] <= st[s + 1] && slots.data_ptr<int64_t>()[s] >= 0 && slots.data_ptr<int64_t>()[s] < a.size(0),
                "lora_sgmv: bad segment or slot");
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < x.size(0), "lora_sgmv: token out of range");
  if (N == 0) return;
  const Problem P{x.size(1), out.size(1), W, rank, S, n, tok, st, slots.data_ptr<int64_t>(), ranks.data_ptr<int64_t>()};
  std::vector<float> h(static_cast<size_t>(N * W));
  if (dtype == at::kFloat) {
    shrink<float>(P, x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(), h.data());
    expand<float>(P, widths, h.data(), b.data_ptr<float>(), out.data_ptr<float>(), out.stride(0));
  } else {
    shrink<at::BFloat16>(P, x.data_ptr<at::BFloat16>(), x.stride(0), a.data_ptr<at::BFloat16>(), h.data());
    expand<at::BFloat16>(P, widths, h.data(), b.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                         out.stride(0));
  }
}
