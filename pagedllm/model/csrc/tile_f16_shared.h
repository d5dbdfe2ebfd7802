// The fp16 tiles' shared chunks (SharedF16): a prompt's tiles each read every chunk of keys before their rows, and
// each packed each chunk itself (the largest |value|, the scaling and the fp16 rows: 12% of the fp16 tile's time at
// 1,900 tokens); the full chunks of sequences read by several tiles are packed once per call, before the tiles run.
// Included by paged_attention.cpp inside its anonymous namespace, after attention_common.h.
#pragma once

// Whether attend_tile runs with fp16 products (tile_f16.h): fp32 queries over a bf16 cache where the caller allows
// it (`--dtype auto`'s fp32, where the measured dispatch found it faster), on AVX512-FP16.
template <typename kv_t>
inline bool f16_tile(const Problem<kv_t>& P) {
#if defined(__AVX512FP16__)
  return std::is_same_v<kv_t, at::BFloat16> && !P.half_q && P.tile_f16;
#else
  (void)P;
  return false;
#endif
}

// A chunk's keys and values as the fp16 tile reads them, with their 2^-e; keys nullptr: not packed yet.
struct F16Chunk {
  const uint16_t* keys = nullptr;
  const uint32_t* values = nullptr;
  float kinv = 1.0f, vinv = 1.0f;
};

// Chunk c0 / kTileChunk of sequence s's kv head g as pack_shared_f16 packed it, if it did (a full chunk).
template <typename kv_t>
inline F16Chunk shared_f16_chunk(const Problem<kv_t>& P, int64_t s, int64_t g, int64_t c0, int64_t cn) {
  const SharedF16& sh = P.shared_f16;
  const int64_t c = c0 / kTileChunk;
  if (sh.count == nullptr || cn != kTileChunk || c >= sh.count[s]) return {};
  const int64_t slot = sh.first[s] + g * sh.count[s] + c;
  return {sh.keys + slot * kTileChunk * P.D, sh.values + slot * kTileChunk / 2 * P.D, sh.inv[2 * slot],
          sh.inv[2 * slot + 1]};
}

// Buffers for SharedF16, kept by the calling thread across calls (fresh ones would fault their pages each call).
struct SharedF16Store {
  std::vector<uint16_t> keys;
  std::vector<uint32_t> values;
  std::vector<float> inv;
  std::vector<int64_t> first, count, seq;  // seq: each slot's sequence
};

constexpr int64_t kSharedF16Bytes = int64_t{64} << 20;  // at most this much packed per call; the rest per tile

// Packs chunk c of sequence s's kv head g into slot j of st (f16_tile(P) over a bf16 cache only).
template <typename kv_t>
inline void pack_shared_chunk_f16(const Problem<kv_t>& P, int64_t s, int64_t g, int64_t c, int64_t j,
                                  SharedF16Store& st) {
#if defined(__AVX512FP16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    int64_t base[kTileChunk];
    chunk_offsets(P, s, c * kTileChunk, kTileChunk, base);
    const uint16_t* krow[kTileChunk];
    const uint16_t* vrow[kTileChunk];
    for (int64_t t = 0; t < kTileChunk; ++t) {
      krow[t] = reinterpret_cast<const uint16_t*>(P.k + base[t] + g * P.RL);
      vrow[t] = reinterpret_cast<const uint16_t*>(P.v + base[t] + g * P.RL);
    }
    const int64_t D = P.D;
    st.inv[2 * j] = pack_keys_f16(krow, kTileChunk, kTileChunk, D, st.keys.data() + j * kTileChunk * D);
    st.inv[2 * j + 1] = pack_value_pairs_f16(vrow, kTileChunk, D, st.values.data() + j * kTileChunk / 2 * D);
    return;
  }
#endif
  (void)P, (void)s, (void)g, (void)c, (void)j, (void)st;
}

// The full chunks of each sequence with tiles[s] >= 2 query tiles, packed into st over the threads (up to
// kSharedF16Bytes); empty where f16_tile(P) is false or nothing is shared.
template <typename kv_t>
SharedF16 pack_shared_f16(const Problem<kv_t>& P, const std::vector<int64_t>& tiles, SharedF16Store& st) {
  if (!f16_tile(P)) return {};
  const int64_t S = static_cast<int64_t>(tiles.size()), D = P.D;
  const int64_t budget = kSharedF16Bytes / (kTileChunk * D * 4);  // slots: 2 bytes of keys and 2 of values a value
  st.first.assign(S, 0);
  st.count.assign(S, 0);
  st.seq.clear();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t used = static_cast<int64_t>(st.seq.size()), room = (budget - used) / P.KVH;
    const int64_t full = tiles[s] < 2 ? 0 : std::min<int64_t>(P.context_lens[s] / kTileChunk, room);
    if (full <= 0) continue;
    st.first[s] = used;
    st.count[s] = full;
    st.seq.resize(used + full * P.KVH, s);
  }
  const int64_t slots = static_cast<int64_t>(st.seq.size());
  if (slots == 0) return {};
  const auto grow = [](auto& v, int64_t n) {
    if (v.size() < static_cast<size_t>(n)) v.resize(n);
  };
  grow(st.keys, slots * kTileChunk * D);
  grow(st.values, slots * kTileChunk / 2 * D);
  grow(st.inv, 2 * slots);
  at::parallel_for(0, slots, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t s = st.seq[j], k = j - st.first[s];
      pack_shared_chunk_f16(P, s, k / st.count[s], k % st.count[s], j, st);
    }
  });
  return {st.keys.data(), st.values.data(), st.inv.data(), st.first.data(), st.count.data()};
}
