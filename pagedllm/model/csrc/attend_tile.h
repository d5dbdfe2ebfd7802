// The tiled (prompt) kernel, attend_tile: a tile of query rows held transposed against chunks of keys, in fp32
// or on vdpbf16ps (tile_bf16.h). Included by paged_attention.cpp inside its anonymous namespace.
#pragma once

// ST[t][rows] = sum_d K[t][d] * Qt[d][rows] for kTB keys and RW vectors of 16 rows.
template <int RW>
inline void qk_micro(const float* const* krow, const float* Qt, int64_t Mp, int64_t D, float* ST) {
  v16 acc[kTB][RW] = {};
  for (int64_t d = 0; d < D; ++d) {
    v16 qv[RW];
    for (int r = 0; r < RW; ++r) qv[r] = vload(Qt + d * Mp + 16 * r);
    for (int t = 0; t < kTB; ++t) {
      const float kv = krow[t][d];
      for (int r = 0; r < RW; ++r) acc[t][r] += kv * qv[r];
    }
  }
  for (int t = 0; t < kTB; ++t)
    for (int r = 0; r < RW; ++r) vstore(ST + t * Mp + 16 * r, acc[t][r]);
}

#if defined(PAGEDLLM_ATTENTION_AVX2)
// qk_micro for one vector of 16 rows in 8-float AVX2 vectors, for CPUs without AVX-512: there GCC kept qk_micro's
// 16-float accumulators (two registers each, kTB x RW of them) on the stack, and a tile of 24-48 rows ran 4-9x
// slower than the row kernel (docs/performance.md). Here kTB x 2 accumulators stay in registers, the same
// products and sums per lane.
inline void qk_micro_avx2(const float* const* krow, const float* Qt, int64_t Mp, int64_t D, float* ST) {
  __m256 acc[kTB][2];
  for (int t = 0; t < kTB; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_loadu_ps(Qt + d * Mp), q1 = _mm256_loadu_ps(Qt + d * Mp + 8);
    for (int t = 0; t < kTB; ++t) {
      const __m256 kv = _mm256_broadcast_ss(krow[t] + d);
      acc[t][0] = _mm256_fmadd_ps(kv, q0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(kv, q1, acc[t][1]);
    }
  }
  for (int t = 0; t < kTB; ++t) {
    _mm256_storeu_ps(ST + t * Mp, acc[t][0]);
    _mm256_storeu_ps(ST + t * Mp + 8, acc[t][1]);
  }
}
#endif

template <typename V>
inline V max4(V a, V b, V c, V d) {
  const auto mx = [](V x, V y) { return x > y ? x : y; };
  return mx(mx(a, b), mx(c, d));
}

// The running max `start` of 16 rows folded with `fold(t, x)` over the chunk's keys t < cn, in four chains: one chain
// waited on each vmaxps (4 cycles a key; 7% of the fp16 tile's time at 1,900 tokens).
template <typename V, typename Fold>
inline V chunk_max(V start, int64_t cn, Fold&& fold) {
  V a = start, b = start, c = start, d = start;
  int64_t t = 0;
  for (; t + 4 <= cn; t += 4) a = fold(t, a), b = fold(t + 1, b), c = fold(t + 2, c), d = fold(t + 3, d);
  for (; t < cn; ++t) a = fold(t, a);
  return max4(a, b, c, d);
}

// The online softmax of one chunk's scores ST[t][r0 .. r0 + 16) (keys c0 .. c0 + cn): row r sees the keys up to
// pos[r] (`masked`: some do not see them all); the others become -inf scores and zero probabilities. The running max
// m, sum l and the factor alpha for the row's earlier sums are updated in place.
#if defined(PAGEDLLM_ATTENTION_AVX2)
// In two 8-float halves: the 16-float version's selects and maxima ran element by element through the stack here.
inline void tile_softmax(float* ST, int64_t Mp, int64_t r0, int64_t cn, int64_t c0, const int32_t* pos, bool masked,
                         float* m, float* l, float* alpha) {
  const __m256 ninf = _mm256_set1_ps(kNegInf), zero = _mm256_setzero_ps();
  for (int64_t r = r0; r < r0 + 16; r += 8) {
    const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + r));
    const __m256 m_old = _mm256_loadu_ps(m + r);
    // lanes whose row does not see key c0 + t
    auto hidden = [&](int64_t t) {
      return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(c0 + t)), pv));
    };
    __m256 mx = m_old;
    for (int64_t t = 0; t < cn; ++t) {
      __m256 sv = _mm256_loadu_ps(ST + t * Mp + r);
      if (masked) {
        sv = _mm256_blendv_ps(sv, ninf, hidden(t));
        _mm256_storeu_ps(ST + t * Mp + r, sv);
      }
      mx = _mm256_max_ps(mx, sv);
    }
    __m256 sum = zero;
    for (int64_t t = 0; t < cn; ++t) {
      __m256 e = vexp2_8(_mm256_sub_ps(_mm256_loadu_ps(ST + t * Mp + r), mx));
      if (masked) e = _mm256_blendv_ps(e, zero, hidden(t));
      _mm256_storeu_ps(ST + t * Mp + r, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 a = vexp2_8(_mm256_sub_ps(m_old, mx));
    _mm256_storeu_ps(alpha + r, a);
    _mm256_storeu_ps(l + r, _mm256_fmadd_ps(_mm256_loadu_ps(l + r), a, sum));
    _mm256_storeu_ps(m + r, mx);
  }
}
#else
inline void tile_softmax(float* ST, int64_t Mp, int64_t r0, int64_t cn, int64_t c0, const int32_t* pos, bool masked,
                         float* m, float* l, float* alpha) {
  const vi16 pv = [&] { vi16 x; std::memcpy(&x, pos + r0, sizeof(x)); return x; }();
  const v16 m_old = vload(m + r0);
  v16 mx = m_old;
  if (masked) {
    for (int64_t t = 0; t < cn; ++t) {
      const v16 sv = viset(static_cast<int32_t>(c0 + t)) <= pv ? vload(ST + t * Mp + r0) : vset(kNegInf);
      vstore(ST + t * Mp + r0, sv);
      mx = vmax(mx, sv);
    }
  } else {
    mx = chunk_max(m_old, cn, [&](int64_t t, v16 x) { return vmax(x, vload(ST + t * Mp + r0)); });
  }
  v16 sum = {};
  for (int64_t t = 0; t < cn; ++t) {
    v16 e = vexp2(vload(ST + t * Mp + r0) - mx);
    if (masked) e = viset(static_cast<int32_t>(c0 + t)) <= pv ? e : v16{};
    vstore(ST + t * Mp + r0, e);
    sum += e;
  }
  const v16 a = vexp2(m_old - mx);
  vstore(alpha + r0, a);
  vstore(l + r0, vload(l + r0) * a + sum);
  vstore(m + r0, mx);
}
#endif

#if defined(__AVX512BF16__) || defined(__AVX512FP16__)
// tile_softmax for the bf16 and fp16 tiles: the same running max, sums and alpha, the probabilities going straight to
// 16-bit key pairs PP[i * Mp + r] = (key 2i, key 2i + 1) of row r (to_pairs(a, b): keys 2i and 2i + 1 of 16 rows
// rounded to nearest even, a's in the low half; then one interleave) instead of back to ST and through a second pass;
// their exp to ~3e-6 (exp2_poly4), far below bf16's or fp16's rounding. A missing last key of a pair counts as zero.
template <typename ToPairs>
inline void tile_softmax_pairs(const float* ST, int64_t Mp, int64_t r0, int64_t cn, int64_t c0, const int32_t* pos,
                               bool masked, float* m, float* l, float* alpha, uint32_t* PP, ToPairs&& to_pairs) {
  const __m512i pv = _mm512_loadu_si512(pos + r0), order = _mm512_loadu_si512(kPairOrder);
  const auto seen = [&](int64_t t) -> __mmask16 {  // lanes whose row sees key c0 + t
    return masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(c0 + t)), pv) : 0xFFFF;
  };
  const __m512 m_old = _mm512_loadu_ps(m + r0);
  const __m512 mx = chunk_max(m_old, cn, [&](int64_t t, __m512 x) {
    return _mm512_mask_max_ps(x, seen(t), x, _mm512_loadu_ps(ST + t * Mp + r0));
  });
  const auto prob = [&](int64_t t) {
    const __m512 e = vexp2_512(_mm512_loadu_ps(ST + t * Mp + r0) - mx, [](__m512 f) { return exp2_poly4(f); });
    return _mm512_maskz_mov_ps(seen(t), e);
  };
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < cn; t += 2) {
    const __m512 a = prob(t);
    sum += a;
    __m512 b = _mm512_setzero_ps();
    if (t + 1 < cn) sum += b = prob(t + 1);
    _mm512_storeu_si512(PP + t / 2 * Mp + r0, _mm512_permutexvar_epi16(order, to_pairs(a, b)));
  }
  const __m512 al = vexp2_512(m_old - mx, [](__m512 f) { return exp2_poly(f); });
  _mm512_storeu_ps(alpha + r0, al);
  _mm512_storeu_ps(l + r0, _mm512_fmadd_ps(_mm512_loadu_ps(l + r0), al, sum));
  _mm512_storeu_ps(m + r0, mx);
}
#endif

// VP: the value pairs (pack_value_pairs) of kv head g's V rows of the chunk's keys (bf16_tile(P) only).
template <typename kv_t>
inline void tile_value_pairs(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t g, uint32_t* VP) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint16_t* vrow[kTileChunk];
    for (int64_t t = 0; t < cn; ++t) vrow[t] = reinterpret_cast<const uint16_t*>(P.v + base[t] + g * P.RL);
    pack_value_pairs(vrow, cn, P.D, VP);
    return;
  }
#endif
  (void)P, (void)base, (void)cn, (void)g, (void)VP;
}

// The chunk's softmax for the row vectors rv0 .. RV (tile_softmax_pairs: its probabilities as bf16 pairs in PP),
// then O[r] = O[r] * alpha[r] + sum_t P[r][t] V[t] for their rows over the value pairs VP (bf16_tile(P) only).
inline void tile_probs_values_bf16(float* O, int64_t D, const float* ST, int64_t Mp, int64_t rv0, int64_t RV,
                                   int64_t cn, int64_t c0, const int32_t* pos, bool masked, float* m, float* l,
                                   float* alpha, uint32_t* PP, const uint32_t* VP) {
#if defined(__AVX512BF16__)
  const auto to_pairs = [](__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); };
  for (int64_t rv = rv0; rv < RV; ++rv)
    tile_softmax_pairs(ST, Mp, rv * 16, cn, c0, pos, masked, m, l, alpha, PP, to_pairs);
  const int64_t r0 = rv0 * 16;
  pv_rows_bf16(O, D, alpha + r0, PP + r0, Mp, VP, (cn + 1) / 2, Mp - r0);
#else
  (void)O, (void)D, (void)ST, (void)Mp, (void)rv0, (void)RV, (void)cn, (void)c0, (void)pos, (void)masked, (void)m;
  (void)l, (void)alpha, (void)PP, (void)VP;
#endif
}

// ST[t][r] for the chunk's keys t < cn_padded (those from cn on score against `zero`) and row vectors rv0 .. RV,
// by qk_micro_bf16 over the bf16 keys in place (bf16_tile(P) only).
template <typename kv_t>
inline void tile_scores_bf16(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t cn_padded, int64_t g,
                             int64_t rv0, int64_t RV, int64_t Mp, const uint32_t* Q2, const float* zero, float* ST) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint16_t* krow[kTileChunk];
    for (int64_t t = 0; t < cn_padded; ++t)
      krow[t] = t < cn ? reinterpret_cast<const uint16_t*>(P.k + base[t] + g * P.RL)
                       : reinterpret_cast<const uint16_t*>(zero);
    const int64_t D = P.D;
    const float mul = P.scale_log2;
    for (int64_t t0 = 0; t0 < cn_padded; t0 += kTB) {
      int64_t rv = rv0;
      for (; rv + 4 <= RV; rv += 4) qk_micro_bf16<kTB, 4>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16);
      switch (RV - rv) {
        case 3: qk_micro_bf16<kTB, 3>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        case 2: qk_micro_bf16<kTB, 2>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        case 1: qk_micro_bf16<kTB, 1>(krow + t0, Q2 + rv * 16, Mp, D, mul, ST + t0 * Mp + rv * 16); break;
        default: break;
      }
    }
    return;
  }
#endif
  (void)P, (void)base, (void)cn, (void)cn_padded, (void)g, (void)rv0, (void)RV, (void)Mp, (void)Q2, (void)zero;
  (void)ST;
}

// ST[t][r] for the chunk's keys t < cn_padded and row vectors rv0 .. RV with fp16 products (f16_tile(P) only): the
// keys packed as scaled fp16 rows (`shared`'s, else packed here into Kh), then qk_micro_f16 per kF16Pairs of head_dim
// pairs.
template <typename kv_t>
inline void tile_scores_f16(const Problem<kv_t>& P, const int64_t* base, int64_t cn, int64_t cn_padded, int64_t g,
                            int64_t rv0, int64_t RV, int64_t Mp, const uint32_t* Q2, const float* qinv,
                            const F16Chunk& shared, uint16_t* Kh, float* ST) {
#if defined(__AVX512FP16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const int64_t D = P.D;
    const uint16_t* keys = shared.keys;
    float ki = shared.kinv;
    if (keys == nullptr) {
      const uint16_t* krow[kTileChunk];
      for (int64_t t = 0; t < cn; ++t) krow[t] = reinterpret_cast<const uint16_t*>(P.k + base[t] + g * P.RL);
      ki = pack_keys_f16(krow, cn, cn_padded, D, Kh);
      keys = Kh;
    }
    for (int64_t i0 = 0; i0 < D / 2; i0 += kF16Pairs) {
      const int64_t np = std::min(kF16Pairs, D / 2 - i0);
      for (int64_t t0 = 0; t0 < cn_padded; t0 += kTB)
        qk_rows_f16<kTB>(keys + t0 * D, D, Q2 + rv0 * 16, Mp, i0, np, ki, qinv + rv0 * 16, RV - rv0,
                         ST + t0 * Mp + rv0 * 16);
    }
    return;
  }
#endif
  (void)P, (void)base, (void)cn, (void)cn_padded, (void)g, (void)rv0, (void)RV, (void)Mp, (void)Q2, (void)qinv;
  (void)shared, (void)Kh, (void)ST;
}

// The chunk's softmax for the row vectors rv0 .. RV (its probabilities as fp16 pairs in PP), then O[r] = O[r] *
// alpha[r] + sum_t P[r][t] V[t] for their rows over the chunk's values as scaled fp16 pairs (`shared`'s, else read
// from the cache into VP here) (f16_tile(P) only).
template <typename kv_t>
inline void tile_probs_values_f16(const Problem<kv_t>& P, const int64_t* base, int64_t g, const F16Chunk& shared,
                                  float* O, const float* ST, int64_t Mp, int64_t rv0, int64_t RV, int64_t cn,
                                  int64_t c0, const int32_t* pos, bool masked, float* m, float* l, float* alpha,
                                  uint32_t* PP, uint32_t* VP) {
#if defined(__AVX512FP16__)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
    const uint32_t* values = shared.values;
    float vinv = shared.vinv;
    if (values == nullptr) {
      const uint16_t* vrow[kTileChunk];
      for (int64_t t = 0; t < cn; ++t) vrow[t] = reinterpret_cast<const uint16_t*>(P.v + base[t] + g * P.RL);
      vinv = pack_value_pairs_f16(vrow, cn, P.D, VP);
      values = VP;
    }
    const auto to_pairs = [](__m512 a, __m512 b) {
      return _mm512_inserti64x4(_mm512_castsi256_si512(to_f16(a)), to_f16(b), 1);
    };
    for (int64_t rv = rv0; rv < RV; ++rv)
      tile_softmax_pairs(ST, Mp, rv * 16, cn, c0, pos, masked, m, l, alpha, PP, to_pairs);
    const int64_t r0 = rv0 * 16;
    pv_rows_f16(O + r0 * P.D, P.D, alpha + r0, PP + r0, Mp, values, (cn + 1) / 2, Mp - r0, vinv);
    return;
  }
#endif
  (void)P, (void)base, (void)g, (void)shared, (void)O, (void)ST, (void)Mp, (void)rv0, (void)RV, (void)cn, (void)c0;
  (void)pos, (void)masked, (void)m, (void)l, (void)alpha, (void)PP, (void)VP;
}

// Prompt chunks: a tile of queries [q_begin, q_end) x the G query heads of one kv head.
template <typename kv_t>
void attend_tile(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc) {
  const int64_t D = P.D, G = P.G, s = w.seq, g = w.kv_begin;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, M = R * G, Mp = (M + 15) / 16 * 16, RV = Mp / 16;
  const int64_t first_pos = L - n + w.q_begin, last_pos = L - n + w.q_end - 1;

  size_t off = 0;
  float* Qt = sc.take(D * Mp, off);
  float* O = sc.take(Mp * D, off);
  float* m = sc.take(Mp, off);
  float* l = sc.take(Mp, off);
  float* alpha = sc.take(Mp, off);
  int32_t* pos = sc.pos.data();
  float* ST = sc.take(kTileChunk * Mp, off);
  float* kbuf = sc.take(kTileChunk * D, off);
  float* vbuf = sc.take(kTileChunk * D, off);
  float* zero = sc.take(D, off);
  uint32_t* PP = reinterpret_cast<uint32_t*>(sc.take(kTileChunk / 2 * Mp, off));  // bf16 path: probability pairs
  uint32_t* VP = reinterpret_cast<uint32_t*>(kbuf);  // bf16 path: value pairs
  int64_t base[kTileChunk];
  const float** krow = sc.krow.data();
  const float** vrow = sc.vrow.data();

  // row r = ii * G + j  <->  query tok0 + ii, head g * G + j. Padding rows: zero queries, never masked.
  const bool pairs = bf16_tile(P), f16 = f16_tile(P);
  float* qinv = Qt + D / 2 * Mp;  // f16: the query rows' scales, after their pairs
  if (pairs) {
#if defined(__AVX512BF16__)
    pack_query_pairs(static_cast<const uint16_t*>(P.q), P.q_stride0, P.q_stride1, tok0, g * G, R, G, D, Mp,
                     reinterpret_cast<uint32_t*>(Qt));
#endif
  } else if (f16) {
#if defined(__AVX512FP16__)
    pack_query_pairs_f16(static_cast<const float*>(P.q), P.q_stride0, P.q_stride1, tok0, g * G, R, G, D, Mp,
                         P.scale_log2, reinterpret_cast<uint32_t*>(Qt), qinv);
#endif
  } else {
    std::fill(Qt, Qt + D * Mp, 0.0f);
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j)
        for (int64_t d = 0; d < D; ++d) Qt[d * Mp + ii * G + j] = q_at(P, tok0 + ii, g * G + j, d) * P.scale_log2;
  }
  for (int64_t r = 0; r < Mp; ++r)
    pos[r] = r < M ? static_cast<int32_t>(first_pos + r / G) : std::numeric_limits<int32_t>::max();
  std::fill(O, O + Mp * D, 0.0f);
  std::fill(m, m + Mp, kNegInf);
  std::fill(l, l + Mp, 0.0f);
  std::fill(zero, zero + D, 0.0f);

  F16Chunk shared;
  for (int64_t c0 = 0; c0 <= last_pos; c0 += kTileChunk) {
    const int64_t cn = std::min(kTileChunk, last_pos + 1 - c0);
    const int64_t slot = shared_slot(P, s, g, c0, cn);  // prepared once for the call: no cache offsets read here
    if (slot < 0) chunk_offsets(P, s, c0, cn, base);
    const int64_t cn_padded = (cn + kTB - 1) / kTB * kTB;
    // Row vectors whose rows all sit before this chunk take no part in it.
    const int64_t rv0 = std::max<int64_t>(0, (c0 - first_pos) * G) / 16;
    const bool masked = c0 + cn - 1 > first_pos;
    if (pairs) {
      tile_scores_bf16(P, base, cn, cn_padded, g, rv0, RV, Mp, reinterpret_cast<const uint32_t*>(Qt), zero, ST);
      tile_value_pairs(P, base, cn, g, VP);
    } else if (f16) {
      shared = shared_f16_chunk(P, slot);
      tile_scores_f16(P, base, cn, cn_padded, g, rv0, RV, Mp, reinterpret_cast<const uint32_t*>(Qt), qinv, shared,
                      reinterpret_cast<uint16_t*>(kbuf), ST);
    } else {
      if (const float* rows = shared_f32_rows(P, slot)) {
        for (int64_t t = 0; t < cn; ++t) krow[t] = rows + t * D, vrow[t] = rows + (kTileChunk + t) * D;
      } else {
        gather_rows(P, base, cn, g, kbuf, vbuf, krow, vrow);
      }
      for (int64_t t = cn; t < cn_padded; ++t) krow[t] = zero;
      for (int64_t t0 = 0; t0 < cn_padded; t0 += kTB) {
        int64_t rv = rv0;
#if defined(PAGEDLLM_ATTENTION_AVX2)
        for (; rv < RV; ++rv) qk_micro_avx2(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16);
#endif
        for (; rv + 4 <= RV; rv += 4) qk_micro<4>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16);
        switch (RV - rv) {
          case 3: qk_micro<3>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
          case 2: qk_micro<2>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
          case 1: qk_micro<1>(krow + t0, Qt + rv * 16, Mp, D, ST + t0 * Mp + rv * 16); break;
          default: break;
        }
      }
    }

    const int64_t r0 = rv0 * 16;
    if (pairs) {
      tile_probs_values_bf16(O + r0 * D, D, ST, Mp, rv0, RV, cn, c0, pos, masked, m, l, alpha, PP, VP);
    } else if (f16) {
      tile_probs_values_f16(P, base, g, shared, O, ST, Mp, rv0, RV, cn, c0, pos, masked, m, l, alpha, PP,
                            reinterpret_cast<uint32_t*>(vbuf));
    } else {
      for (int64_t rv = rv0; rv < RV; ++rv) tile_softmax(ST, Mp, rv * 16, cn, c0, pos, masked, m, l, alpha);
      pv_rows(O + r0 * D, D, alpha + r0, ST + r0, Mp, 1, vrow, cn, Mp - r0);
    }
  }
  for (int64_t ii = 0; ii < R; ++ii)
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = ii * G + j;
      store_out(P, tok0 + ii, g * G + j, O + r * D, 1.0f / l[r]);
    }
}
