// A call's shared key chunks (SharedChunks): a prompt's tiles each read every chunk of keys before their rows, and
// each converted or packed each chunk itself (the fp32 tile: bf16 rows to fp32, 12% of its time at 1,900 tokens, and
// int8 rows likewise; the fp16 tile: the largest |value|, the scaling and the fp16 rows, 13%). The full chunks of
// sequences that several tiles read are prepared once per call, before the tiles run, the same bits a tile gets
// preparing them itself.
// Included by paged_attention.cpp inside its anonymous namespace, after attention_common.h and before attend_tile.h.
#pragma once

// Whether attend_tile runs on vdpbf16ps (tile_bf16.h): bf16 queries over a bf16 cache, head_dim a multiple of 16,
// on AVX512-BF16. Its scores are exact sums of the bf16 products; the probabilities are rounded to bf16 for the
// values' sums, as flash attention does on GPUs (fp32 queries keep the fp32 kernel, and fp32's exact output).
template <typename kv_t>
inline bool bf16_tile(const Problem<kv_t>& P) {
#if defined(__AVX512BF16__)
  return std::is_same_v<kv_t, at::BFloat16> && P.half_q && P.D % 16 == 0 && P.tile_pairs;
#else
  (void)P;
  return false;
#endif
}

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

// The form attend_tile's chunks take for P: fp16 (f16_tile), fp32 rows (the fp32 tile over a bf16 or int8 cache),
// or none to share (an fp32 cache is read in place; the vdpbf16ps form reads its keys in place).
enum class ChunkForm { kNone, kF16, kF32 };

template <typename kv_t>
inline ChunkForm chunk_form(const Problem<kv_t>& P) {
  if (f16_tile(P)) return ChunkForm::kF16;
  if (std::is_same_v<kv_t, float> || bf16_tile(P)) return ChunkForm::kNone;
  return ChunkForm::kF32;
}

// Slot of chunk c0 / kTileChunk of sequence s's kv head g, where the call shares it (a full chunk), else -1.
template <typename kv_t>
inline int64_t shared_slot(const Problem<kv_t>& P, int64_t s, int64_t g, int64_t c0, int64_t cn) {
  const SharedChunks& sh = P.shared;
  const int64_t c = c0 / kTileChunk;
  return sh.count == nullptr || cn != kTileChunk || c >= sh.count[s] ? -1 : sh.first[s] + g * sh.count[s] + c;
}

// A chunk's keys and values as the fp16 tile reads them, with their 2^-e; keys nullptr: not packed yet.
struct F16Chunk {
  const uint16_t* keys = nullptr;
  const uint32_t* values = nullptr;
  float kinv = 1.0f, vinv = 1.0f;
};

// Slot j's fp16 keys and values (shared_slot; -1 or another form's call: none).
template <typename kv_t>
inline F16Chunk shared_f16_chunk(const Problem<kv_t>& P, int64_t j) {
  const SharedChunks& sh = P.shared;
  if (j < 0 || sh.keys == nullptr) return {};
  return {sh.keys + j * kTileChunk * P.D, sh.values + j * kTileChunk / 2 * P.D, sh.inv[2 * j], sh.inv[2 * j + 1]};
}

// Slot j's fp32 rows for the fp32 tile, keys then values (-1 or another form's call: nullptr).
template <typename kv_t>
inline const float* shared_f32_rows(const Problem<kv_t>& P, int64_t j) {
  return j < 0 || P.shared.rows == nullptr ? nullptr : P.shared.rows + j * 2 * kTileChunk * P.D;
}

// Buffers for SharedChunks, kept by the calling thread across calls (fresh ones would fault their pages each call).
struct SharedStore {
  std::vector<uint16_t> keys;
  std::vector<uint32_t> values;
  std::vector<float> inv, rows;
  std::vector<int64_t> first, count, seq;  // seq: each slot's sequence
};

constexpr int64_t kSharedBytes = int64_t{64} << 20;  // at most this much prepared per call; the rest per tile

// Prepares chunk c of sequence s's kv head g in slot j of st, in `form`.
template <typename kv_t>
inline void prepare_chunk(const Problem<kv_t>& P, ChunkForm form, int64_t s, int64_t g, int64_t c, int64_t j,
                          SharedStore& st) {
  int64_t base[kTileChunk];
  chunk_offsets(P, s, c * kTileChunk, kTileChunk, base);
  const int64_t D = P.D;
  if (form == ChunkForm::kF32) {
    float* rows = st.rows.data() + j * 2 * kTileChunk * D;
    for (int64_t t = 0; t < kTileChunk; ++t) {
      rows_to_f32(P.k + base[t] + g * P.RL, rows + t * D, D, 1);
      rows_to_f32(P.v + base[t] + g * P.RL, rows + (kTileChunk + t) * D, D, 1);
    }
    return;
  }
#if defined(__AVX512FP16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint16_t* krow[kTileChunk];
    const uint16_t* vrow[kTileChunk];
    for (int64_t t = 0; t < kTileChunk; ++t) {
      krow[t] = reinterpret_cast<const uint16_t*>(P.k + base[t] + g * P.RL);
      vrow[t] = reinterpret_cast<const uint16_t*>(P.v + base[t] + g * P.RL);
    }
    st.inv[2 * j] = pack_keys_f16(krow, kTileChunk, kTileChunk, D, st.keys.data() + j * kTileChunk * D);
    st.inv[2 * j + 1] = pack_value_pairs_f16(vrow, kTileChunk, D, st.values.data() + j * kTileChunk / 2 * D);
  }
#endif
}

// The full chunks of each sequence with tiles[s] >= 2 query tiles, prepared in st over the threads (up to
// kSharedBytes); empty where chunk_form(P) has nothing to share or no sequence has them.
template <typename kv_t>
SharedChunks share_chunks(const Problem<kv_t>& P, const std::vector<int64_t>& tiles, SharedStore& st) {
  const ChunkForm form = chunk_form(P);
  if (form == ChunkForm::kNone) return {};
  const int64_t S = static_cast<int64_t>(tiles.size()), D = P.D;
  // a slot's bytes per key and head_dim value: fp16 keys and value pairs 4, fp32 keys and values 8
  const int64_t budget = kSharedBytes / (kTileChunk * D * (form == ChunkForm::kF16 ? 4 : 8));
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
  if (form == ChunkForm::kF32) {
    grow(st.rows, slots * 2 * kTileChunk * D);
  } else {
    grow(st.keys, slots * kTileChunk * D);
    grow(st.values, slots * kTileChunk / 2 * D);
    grow(st.inv, 2 * slots);
  }
  at::parallel_for(0, slots, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t s = st.seq[j], k = j - st.first[s];
      prepare_chunk(P, form, s, k / st.count[s], k % st.count[s], j, st);
    }
  });
  SharedChunks sh{nullptr, nullptr, nullptr, nullptr, st.first.data(), st.count.data()};
  if (form == ChunkForm::kF32) {
    sh.rows = st.rows.data();
  } else {
    sh.keys = st.keys.data(), sh.values = st.values.data(), sh.inv = st.inv.data();
  }
  return sh;
}
