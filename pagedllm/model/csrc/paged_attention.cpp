// Paged attention on the CPU: a flat batch of queries (decodes and prompt chunks mixed) attends over a
// paged KV cache laid out [num_blocks, block_size, num_kv_heads, head_dim].
//
// Two kernels, both with online softmax and fp32 accumulation, both reading keys in chunks of consecutive
// positions that may span blocks (so any block size, down to 1, costs the same):
//  - attend_rows: decodes and very short chunks. Memory bound: each K/V row is read once for all query heads
//    of its kv group, scores are dot products. Over a bf16 cache its own version, attend_rows_bf16, scores 8 keys x
//    3 query heads per pass over the stored rows (bf16 queries: vdpbf16ps, on AVX512-BF16; fp32 queries: fp32 FMA
//    over K rows widened in registers, on AVX-512 or AVX2) and converts V rows in registers: no row is copied to fp32
//    first. Few long decodes are split into context partitions (flash-decoding), merged exactly.
//  - attend_tile: prompt chunks. Compute bound: a tile of queries x (one kv head's query heads) is held
//    transposed, so scores for a chunk of keys come out as S^T[key][row] with rows in vector lanes; the
//    softmax then needs no horizontal reductions and no [T, T] matrix is ever formed. Over a bf16 cache with
//    bf16 queries (AVX512-BF16) both products run on vdpbf16ps (tile_bf16.h).
// The cache holds float32, bfloat16, or int8 rows (uint8 records: head_dim values, then an fp16 scale and min per
// group of kKvGroup, value = q * scale + min; quantised by write_kv, kv_write.cpp), converted to fp32 as they are read.
// Vectors are GCC vector extensions (16 floats); with -march=native they compile to AVX-512 where present
// and to narrower registers elsewhere. Work items go to threads dynamically, largest first.
// The kernels are in the headers included below (attention_common.h, rows_bf16.h, rows_steps.h, attend_rows.h,
// attend_tile.h); this file splits a call into work items and runs them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "exp2_poly.h"
#include "tile_bf16.h"
#include "tile_f16.h"

namespace {

#include "attention_common.h"
#include "rows_bf16.h"
#include "rows_steps.h"
#include "attend_rows.h"
#include "tile_shared.h"
#include "attend_tile.h"

// The items over the threads, after the chunks their tiles share (share_chunks; `tiles`: query tiles per sequence).
template <typename kv_t>
void run(Problem<kv_t> P, const std::vector<WorkItem>& items, const std::vector<int64_t>& tiles,
         size_t scratch_floats, size_t tile_rows) {
  thread_local SharedStore store;
  P.shared = share_chunks(P, tiles, store);
  std::atomic<size_t> next{0};
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    Scratch sc;
    sc.buf.resize(scratch_floats);
    sc.pos.resize(tile_rows);
    sc.krow.resize(std::max(kRowsChunk, kTileChunk));
    sc.vrow.resize(std::max(kRowsChunk, kTileChunk));
    for (size_t i = next.fetch_add(1); i < items.size();) {
      Claim claim{&next, &items};
      if (items[i].tiled)
        attend_tile(P, items[i], sc);
      else
        attend_decode(P, items[i], sc, claim);
      i = claim.taken ? claim.index : next.fetch_add(1);
    }
  });
}

}  // namespace

bool tile_pairs_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool tile_f16_supported() {
#if defined(__AVX512FP16__)
  return true;
#else
  return false;
#endif
}

// See pagedllm/attention.py:paged_attention for the contract. tile_min_rows: sequences with at least this many
// query rows (queries x query heads per kv head) use the tiled (prefill) kernel, the others the row kernel; in a
// step of fewer than 4 sequences per thread (where the row kernel splits contexts over threads) few_tile_min_rows.
// tile_pairs: bf16 queries over a bf16 cache may take the vdpbf16ps forms (bf16_tile; the decode's scores,
// attend_decode), else their fp32 ones; tile_f16: fp32 queries over a bf16 cache the tiles' fp16 products (f16_tile).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                              const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                              int64_t tile_min_rows, int64_t few_tile_min_rows, bool tile_pairs,
                              bool tile_f16) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be 3-d, caches 4-d");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 || int8_cache,
              "caches must be float32, bfloat16 or uint8 (int8 records)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, context_lens, query_start_loc must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "block_tables [S, max_blocks], context_lens [S], query_start_loc [S+1] must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t S = block_tables.size(0), MB = block_tables.size(1);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(NB * BS <= std::numeric_limits<int32_t>::max(), "too many cache slots for int32 slot numbers");
  if (int8_cache) {
    TORCH_CHECK(D % kKvGroup == 0, "int8 cache: head_dim must be a multiple of ", kKvGroup);
    TORCH_CHECK(k_cache.size(3) == row_len<uint8_t>(D), "int8 cache: rows must be head_dim + 4 * head_dim / ",
                kKvGroup, " bytes");
  } else {
    TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and cache differ");
  }
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(context_lens.numel() == S && query_start_loc.numel() == S + 1, "batch sizes disagree");
  TORCH_CHECK(tile_min_rows >= 1 && few_tile_min_rows >= 1, "tile_min_rows must be >= 1");

  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t G = H / KVH;
  TORCH_CHECK(S == 0 || (qsl[0] >= 0 && qsl[S] <= T), "query_start_loc out of range");
  std::vector<WorkItem> items;
  std::vector<int64_t> seq_tiles(S, 0);  // query tiles per sequence (0: the row kernel)
  std::vector<int32_t> row_items;  // indices of decode-like items, split over kv heads when work is scarce
  size_t rows_max_R = 0, tile_max_M = 0;
  const int64_t nthreads = at::get_num_threads();
  int64_t active = 0;
  for (int64_t s = 0; s < S; ++s) active += qsl[s + 1] > qsl[s];
  const int64_t min_tile_rows = active < 4 * nthreads ? few_tile_min_rows : tile_min_rows;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], L = ctx[s];
    TORCH_CHECK(n >= 0 && n <= max_query_len, "sequence ", s, ": bad query count ", n);
    if (n == 0) continue;
    TORCH_CHECK(L >= n, "sequence ", s, ": context_len ", L, " < its query count ", n);
    const int64_t nblocks = (L + BS - 1) / BS;
    TORCH_CHECK(nblocks <= MB, "sequence ", s, ": block table too short for context ", L);
    for (int64_t b = 0; b < nblocks; ++b)
      TORCH_CHECK(bt[s * MB + b] >= 0 && bt[s * MB + b] < NB, "sequence ", s, ": block id out of range");
    if (n * G >= min_tile_rows) {
      const int64_t most = std::max<int64_t>(1, kTileRows / G), tiles = (n + most - 1) / most;
      const int64_t qt = (n + tiles - 1) / tiles;  // tiles of equal size: no last tile of a few padded rows
      seq_tiles[s] = tiles;
      for (int64_t i0 = 0; i0 < n; i0 += qt) {
        const int64_t i1 = std::min(n, i0 + qt);
        tile_max_M = std::max<size_t>(tile_max_M, (i1 - i0) * G);
        for (int64_t g = 0; g < KVH; ++g) {
          const double cost = double((i1 - i0) * G) * double(L - n + i1);
          items.push_back({int32_t(s), int32_t(i0), int32_t(i1), int32_t(g), int32_t(g + 1), true, cost});
        }
      }
    } else {
      rows_max_R = std::max<size_t>(rows_max_R, n);
      row_items.push_back(int32_t(items.size()));
      items.push_back({int32_t(s), 0, int32_t(n), 0, int32_t(KVH), false, double(n * H) * double(L)});
    }
  }
  // Too few tasks to keep every thread busy (the tail of a run: a few long decodes): split the contexts of the
  // decodes into partitions (flash-decoding) of about equal cost, kSplitPerThread per thread over all items, each
  // at least kMinPartKeys keys and starting on a chunk boundary; merged by the last partition to finish.
  std::vector<WorkItem> parts;
  std::vector<std::pair<int32_t, int32_t>> groups;  // per split decode: first slot, partitions
  if (nthreads > 1 && !row_items.empty() && int64_t(items.size()) < 4 * nthreads) {
    double total = 0.0;
    for (const WorkItem& x : items) total += x.cost;
    const double target = total / double(kSplitPerThread * nthreads);
    for (int32_t idx : row_items) {
      WorkItem& x = items[idx];
      const int64_t keys = ctx[x.seq], chunks = (keys + kRowsChunk - 1) / kRowsChunk;
      const int64_t np = std::min<int64_t>({std::llround(x.cost / target), keys / kMinPartKeys, chunks});
      if (np < 2) continue;
      x.cost = -1.0;  // replaced by its partitions
      groups.push_back({int32_t(parts.size()), int32_t(np)});
      for (int64_t p = 0; p < np; ++p) {
        WorkItem y = items[idx];
        y.k_begin = int32_t(p * chunks / np * kRowsChunk);
        y.k_end = int32_t(std::min(keys, (p + 1) * chunks / np * kRowsChunk));
        y.cost = double(y.q_end - y.q_begin) * double(H) * double(y.k_end - y.k_begin);
        y.part = int32_t(parts.size());
        y.group = int32_t(groups.size() - 1);
        parts.push_back(y);
      }
    }
    if (!parts.empty()) {
      std::vector<int32_t> kept;
      std::vector<WorkItem> rest;
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].cost < 0.0) continue;
        if (!items[i].tiled) kept.push_back(int32_t(rest.size()));
        rest.push_back(items[i]);
      }
      rest.insert(rest.end(), parts.begin(), parts.end());
      items.swap(rest);
      row_items.swap(kept);
    }
  }
  // Still too few: give each kv head of an unsplit decode its own task.
  if (KVH > 1 && !row_items.empty() && int64_t(items.size()) < 4 * nthreads) {
    for (int32_t idx : row_items) {
      items[idx].kv_end = 1;
      items[idx].cost /= KVH;
      const WorkItem head0 = items[idx];  // a copy: push_back below may reallocate
      for (int64_t g = 1; g < KVH; ++g) {
        WorkItem x = head0;
        x.kv_begin = int32_t(g);
        x.kv_end = int32_t(g + 1);
        items.push_back(x);
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const size_t pad = 16;
  const size_t NR = rows_max_R * H;
  const size_t span = KVH * D;
  // attend_rows: q (2 * NR * D in attend_rows_bf16 over fp32 queries) and acc, ..., two chunks' scores
  // (attend_rows_bf16), ...
  const size_t rows_floats = 3 * (NR * D + pad) + 4 * (NR + pad) + 2 * (NR * kRowsChunk + pad) + (span + D + pad) +
                             (kRowsChunk * span + pad);
  const size_t Mp = (tile_max_M + 15) / 16 * 16;
  const size_t tile_floats = 2 * (Mp * D + pad) + 3 * (Mp + pad) + (kTileChunk * Mp + pad) +
                             2 * (kTileChunk * D + pad) + (D + pad) + (kTileChunk / 2 * Mp + pad);
  const size_t scratch_floats = std::max(rows_floats, tile_floats);

  auto out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (S == 0) return out.zero_();
  if (qsl[0] > 0) out.narrow(0, 0, qsl[0]).zero_();
  if (qsl[S] < T) out.narrow(0, qsl[S], T - qsl[S]).zero_();
  if (items.empty()) return out;

  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const bool half_q = q.scalar_type() == at::kBFloat16;
  Splits split;
  std::vector<float> partial;
  std::unique_ptr<SplitGroup[]> split_groups;
  if (!parts.empty()) {
    split.slot_floats = int64_t(NR * D + 2 * NR);
    partial.resize(parts.size() * split.slot_floats);
    split.partial = partial.data();
    split_groups.reset(new SplitGroup[groups.size()]);
    for (size_t i = 0; i < groups.size(); ++i) {
      split_groups[i].first_slot = groups[i].first;
      split_groups[i].parts = groups[i].second;
      split_groups[i].left.store(groups[i].second, std::memory_order_relaxed);
    }
    split.groups = split_groups.get();
  }
  if (k_cache.scalar_type() == at::kFloat) {
    const Problem<float> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, ctx, qsl,
                           H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs, tile_f16};
    run(P, items, seq_tiles, scratch_floats, Mp);
  } else if (int8_cache) {
    const Problem<uint8_t> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                             k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), bt, ctx, qsl,
                             H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs, tile_f16};
    run(P, items, seq_tiles, scratch_floats, Mp);
  } else {
    const Problem<at::BFloat16> P{q.data_ptr(), half_q, q.stride(0), q.stride(1), out.data_ptr(),
                                  k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), bt, ctx,
                                  qsl, H, KVH, G, D, BS, MB, scale_log2, split, tile_pairs, tile_f16};
    run(P, items, seq_tiles, scratch_floats, Mp);
  }
  return out;
}
