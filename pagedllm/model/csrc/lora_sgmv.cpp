// Batched multi-LoRA: Punica's SGMV (segmented gather matmul) on the CPU. A step's adapter tokens, sorted by adapter
// slot, form segments; for one fused matmul of one layer, out[t] += B_slot (A_slot x[t]) for every token t of every
// segment, with no padding: each segment reads its adapter's A and B once per tile of its own tokens.
//
// The weights live in the KV cache's blocks (S-LoRA's unified paging): each slot's A and B are rows packed into
// pages (one layer's K or V part of a block the adapter holds), a row never across two pages. A slot's page table
// gives each page's address: row i is at pages[i / rows_per_page] + (i % rows_per_page) * row length.
//  - A: `in` rows of the slot's projections' ranks side by side (q's, then k's, then v's columns), rounded up to 16.
//  - B: per targeted projection p (in order), per tile of 64 of its output columns, rank_p rows of 64 columns (B's
//    transpose in tiles: a row is 64 elements, so it fits a small page; the tail tile is padded).
//
// Two passes, each spread over the threads as work items taken dynamically:
//  - shrink: (segment, tile of tokens, block of up to 64 rank columns) -> h = x A, fp32, in a small scratch
//    [tokens, W]; qkv is one shrink of width rank_q + rank_k + rank_v.
//  - expand: (segment, block of tokens, tile of 64 output columns of one projection) -> out += h B, reading only
//    that projection's rank rows of the tile (a projection the adapter does not target has no rows and costs nothing).
// Rows of x and out are read and written in place through the sorted token index (no gather or scatter copies).
// Weights, x and out are float32 or bfloat16 (all one dtype), accumulation in fp32. Vectors are GCC vector
// extensions (16 floats): AVX-512 with -march=native where present, narrower registers elsewhere.

#include <ATen/core/Tensor.h>
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
constexpr int64_t kColumns = 64;     // output (or rank) columns per work item; B's rows are tiles this wide
constexpr int64_t kMaxRank = 1024;   // a projection's rank at most
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

// h[t][0, 16 NV) = x[t] . A[:, 0, 16 NV) for kShrinkTokens rows (a partial tile repeats a row into a dummy h row);
// A's rows in pages of `rpp` rows of `lda` elements, from column c0.
template <typename T, int NV>
void shrink_tile(const T* const* xr, const int64_t* pages, int64_t rpp, int64_t c0, int64_t in, int64_t lda,
                 float* const* hr) {
  v16 acc[kShrinkTokens][NV] = {};
  for (int64_t i0 = 0; i0 < in; i0 += rpp) {
    const T* a = reinterpret_cast<const T*>(pages[i0 / rpp]) + c0;  // row i0 of the page's rows
    const int64_t n = std::min(in - i0, rpp);
    // the next page's first rows are fetched ahead while this page's last ones are multiplied
    const T* next = i0 + rpp < in ? reinterpret_cast<const T*>(pages[i0 / rpp + 1]) + c0 - n * lda : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = i0 + j;
      const T* ahead = j + kPrefetchRows < n ? a : next;
      v16 av[NV];
      for (int v = 0; v < NV; ++v) {
        if (ahead != nullptr) __builtin_prefetch(ahead + (j + kPrefetchRows) * lda + 16 * v);
        av[v] = load16(a + j * lda + 16 * v);
      }
      for (int t = 0; t < kShrinkTokens; ++t) {
        const v16 xv = vset(to_f32(xr[t][i]));
        for (int v = 0; v < NV; ++v) acc[t][v] += xv * av[v];
      }
    }
  }
  for (int t = 0; t < kShrinkTokens; ++t)
    for (int v = 0; v < NV; ++v) store16(hr[t] + 16 * v, acc[t][v]);
}

// out[t][0, 16 NC) += h[t][0, rank) . B[0, rank)[0, 16 NC) for kExpandTokens rows (a partial tile writes dummies);
// B's row r at b[r].
template <typename T, int NC>
void expand_tile(T* const* outr, const float* const* hr, const T* const* b, int64_t rank) {
  v16 acc[kExpandTokens][NC] = {};
  for (int64_t r = 0; r < rank; ++r) {
    v16 bv[NC];
    for (int v = 0; v < NC; ++v) {
      if (r + kPrefetchRows < rank) __builtin_prefetch(b[r + kPrefetchRows] + 16 * v);
      bv[v] = load16(b[r] + 16 * v);
    }
    for (int t = 0; t < kExpandTokens; ++t) {
      const v16 hv = vset(hr[t][r]);
      for (int v = 0; v < NC; ++v) acc[t][v] += hv * bv[v];
    }
  }
  for (int t = 0; t < kExpandTokens; ++t)
    for (int v = 0; v < NC; ++v) store16(outr[t] + 16 * v, load16(outr[t] + 16 * v) + acc[t][v]);
}

// Columns past the last whole vector of a projection, one at a time (B's row r at b[r], from column c).
template <typename T>
void expand_tail(T* const* outr, const float* const* hr, const T* const* b, int64_t rank, int64_t c0, int64_t n) {
  for (int t = 0; t < kExpandTokens; ++t)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      for (int64_t r = 0; r < rank; ++r) s += hr[t][r] * to_f32(b[r][c0 + c]);
      outr[t][c] = static_cast<T>(to_f32(outr[t][c]) + s);
    }
}

struct Item {
  int64_t seg, t0, t1, c0, c1, r0, rank, row;  // a segment's sorted positions [t0, t1), columns [c0, c1), rank
                                               // columns of h [r0, r0 + rank), B's first row of the tile
};

struct Problem {
  int64_t in, out_features, W, rank, num_segments, num_projections;
  const int64_t *a_pages, *b_pages;  // slot -> its pages' addresses [slots, pages_a] and [slots, pages_b]
  int64_t pages_a, pages_b, page_elems;  // page table widths, elements per page
  const int64_t* tokens;  // sorted position -> token (row of x and out)
  const int64_t* starts;  // segment -> its first sorted position; [S + 1]
  const int64_t* slots;   // segment -> its adapter's slot in A and B
  const int64_t* ranks;   // slot -> each projection's rank in it [slots, n] (0: not targeted)

  int64_t rank_of(int64_t seg, int64_t p) const { return ranks[slots[seg] * num_projections + p]; }
  const int64_t* a_table(int64_t seg) const { return a_pages + slots[seg] * pages_a; }
  const int64_t* b_table(int64_t seg) const { return b_pages + slots[seg] * pages_b; }
  // the first column of projection p in a segment's A row (and h)
  int64_t offset(int64_t seg, int64_t p) const {
    int64_t used = 0;
    for (int64_t q = 0; q < p; ++q) used += rank_of(seg, q);
    return used;
  }
  // A's row length in a segment's adapter: its ranks, rounded up to a vector (0: it targets none of the projections)
  int64_t columns(int64_t seg) const { return (offset(seg, num_projections) + 15) / 16 * 16; }
  int64_t rpp_a(int64_t seg) const { return page_elems / columns(seg); }
  int64_t rpp_b() const { return page_elems / kColumns; }
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
void shrink(const Problem& P, const T* x, int64_t ldx, float* h) {
  std::vector<Item> items;
  for (int64_t s = 0; s < P.num_segments; ++s)
    for (int64_t t0 = P.starts[s]; t0 < P.starts[s + 1]; t0 += kShrinkTokens)
      for (int64_t c0 = 0, used = P.columns(s); c0 < used; c0 += kColumns)
        items.push_back({s, t0, std::min(t0 + kShrinkTokens, P.starts[s + 1]), c0, std::min(c0 + kColumns, used),
                         0, 0, 0});
  run_items(items, [&](const Item& it) {
    const T* xr[kShrinkTokens];
    float* hr[kShrinkTokens];
    float dummy[kColumns];
    for (int t = 0; t < kShrinkTokens; ++t) {
      const int64_t p = std::min(it.t0 + t, it.t1 - 1);
      xr[t] = x + P.tokens[p] * ldx;
      hr[t] = it.t0 + t < it.t1 ? h + p * P.W + it.c0 : dummy;
    }
    const int64_t* pages = P.a_table(it.seg);
    const int64_t rpp = P.rpp_a(it.seg), lda = P.columns(it.seg);
    switch ((it.c1 - it.c0) / 16) {
      case 1: shrink_tile<T, 1>(xr, pages, rpp, it.c0, P.in, lda, hr); break;
      case 2: shrink_tile<T, 2>(xr, pages, rpp, it.c0, P.in, lda, hr); break;
      case 3: shrink_tile<T, 3>(xr, pages, rpp, it.c0, P.in, lda, hr); break;
      default: shrink_tile<T, 4>(xr, pages, rpp, it.c0, P.in, lda, hr); break;
    }
  });
}

// out[tokens[position]] += h[position] B_slot, each projection's columns from its own rank rows only.
template <typename T>
void expand(const Problem& P, const std::vector<int64_t>& widths, const float* h, T* out, int64_t ldo) {
  std::vector<Item> items;
  for (int64_t s = 0; s < P.num_segments; ++s)
    for (int64_t t0 = P.starts[s]; t0 < P.starts[s + 1]; t0 += kTokenBlock)
      for (int64_t p = 0, start = 0, row = 0; p < static_cast<int64_t>(widths.size()); start += widths[p++])
        for (int64_t c0 = start, r = P.rank_of(s, p); r > 0 && c0 < start + widths[p]; c0 += kColumns, row += r)
          items.push_back({s, t0, std::min(t0 + kTokenBlock, P.starts[s + 1]), c0,
                           std::min(c0 + kColumns, start + widths[p]), P.offset(s, p), r, row});
  const std::vector<float> zeros(P.W, 0.0f);
  run_items(items, [&](const Item& it) {
    T dummy[kColumns];
    const T* bs[kMaxRank];
    const int64_t* pages = P.b_table(it.seg);
    for (int64_t r = 0, i = it.row; r < it.rank; ++r, ++i)
      bs[r] = reinterpret_cast<const T*>(pages[i / P.rpp_b()]) + (i % P.rpp_b()) * kColumns;
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
        case 1: expand_tile<T, 1>(outr, hr, bs, it.rank); break;
        case 2: expand_tile<T, 2>(outr, hr, bs, it.rank); break;
        case 3: expand_tile<T, 3>(outr, hr, bs, it.rank); break;
        default: expand_tile<T, 4>(outr, hr, bs, it.rank); break;
      }
      if (tail) {
        for (int t = 0; t < kExpandTokens; ++t) outr[t] += whole * 16;
        expand_tail<T>(outr, hr, bs, it.rank, whole * 16, tail);
      }
    }
  });
}

}  // namespace

void lora_sgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& a_pages, const at::Tensor& b_pages,
               const at::Tensor& tokens, const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& ranks,
               int64_t rank, const std::vector<int64_t>& widths, int64_t W, int64_t page_bytes) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_sgmv: x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dtype, "lora_sgmv: out and x must share a dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_sgmv: x [T, in] and out [T, out] with contiguous rows");
  for (const at::Tensor* t : {&a_pages, &b_pages})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 2 && t->is_contiguous() && t->size(0) == a_pages.size(0),
                "lora_sgmv: page tables int64 [slots, pages]");
  const int64_t n = static_cast<int64_t>(widths.size());
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  TORCH_CHECK(W % 16 == 0 && n > 0 && n * rank <= W && total == out.size(1) && rank <= kMaxRank,
              "lora_sgmv: W must be a multiple of 16 holding the projections' ranks, widths must sum to out's");
  const int64_t page_elems = page_bytes / static_cast<int64_t>(x.element_size());
  TORCH_CHECK(page_elems >= std::max<int64_t>(W, kColumns), "lora_sgmv: a page must hold a row");
  for (const at::Tensor* t : {&tokens, &starts, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "lora_sgmv: int64 indices");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous(), "lora_sgmv: int64 ranks");
  const int64_t S = slots.size(0), N = tokens.size(0);
  TORCH_CHECK(ranks.numel() == a_pages.size(0) * n, "lora_sgmv: ranks must be [slots, projections]");
  for (int64_t i = 0; i < ranks.numel(); ++i)
    TORCH_CHECK(ranks.data_ptr<int64_t>()[i] >= 0 && ranks.data_ptr<int64_t>()[i] <= rank, "lora_sgmv: bad rank");
  TORCH_CHECK(starts.size(0) == S + 1, "lora_sgmv: starts must have one more entry than slots");
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(S == 0 || (st[0] == 0 && st[S] == N), "lora_sgmv: segments must cover the sorted tokens");
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(st[s] <= st[s + 1] && slots.data_ptr<int64_t>()[s] >= 0 &&
                    slots.data_ptr<int64_t>()[s] < a_pages.size(0),
                "lora_sgmv: bad segment or slot");
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(tok[i] >= 0 && tok[i] < x.size(0), "lora_sgmv: token out of range");
  if (N == 0) return;
  Problem P{x.size(1), out.size(1), W, rank, S, n, a_pages.data_ptr<int64_t>(), b_pages.data_ptr<int64_t>(),
            a_pages.size(1), b_pages.size(1), page_elems, tok, st, slots.data_ptr<int64_t>(),
            ranks.data_ptr<int64_t>()};
  // every page a segment reads must be in its table (the caller filled the tables when it wrote the pages)
  for (int64_t s = 0; s < S; ++s) {
    int64_t rows = 0;
    for (int64_t p = 0; p < n; ++p) rows += (widths[p] + kColumns - 1) / kColumns * P.rank_of(s, p);
    const int64_t* ta = P.a_table(s);
    const int64_t* tb = P.b_table(s);
    const int64_t need_a = P.columns(s) > 0 ? (P.in + P.rpp_a(s) - 1) / P.rpp_a(s) : 0;
    const int64_t need_b = (rows + P.rpp_b() - 1) / P.rpp_b();
    TORCH_CHECK(need_a <= P.pages_a && need_b <= P.pages_b, "lora_sgmv: page table too small");
    for (int64_t i = 0; i < need_a; ++i) TORCH_CHECK(ta[i] != 0, "lora_sgmv: a slot's page of A is missing");
    for (int64_t i = 0; i < need_b; ++i) TORCH_CHECK(tb[i] != 0, "lora_sgmv: a slot's page of B is missing");
  }
  std::vector<float> h(static_cast<size_t>(N * W));
  if (dtype == at::kFloat) {
    shrink<float>(P, x.data_ptr<float>(), x.stride(0), h.data());
    expand<float>(P, widths, h.data(), out.data_ptr<float>(), out.stride(0));
  } else {
    shrink<at::BFloat16>(P, x.data_ptr<at::BFloat16>(), x.stride(0), h.data());
    expand<at::BFloat16>(P, widths, h.data(), out.data_ptr<at::BFloat16>(), out.stride(0));
  }
}
