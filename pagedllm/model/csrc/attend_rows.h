// The row (decode) kernel: attend_rows over any cache, attend_rows_bf16 over a bf16 one, and attend_decode, which
// picks between them. Included by paged_attention.cpp inside its anonymous namespace, after rows_steps.h.
#pragma once

// Decodes and short chunks: rows = (query, head) pairs, scores as dot products over head_dim. Keys and
// values are read token-major (a token's rows for all kv heads of the item are adjacent in the cache);
// the next chunk's keys and this chunk's values are prefetched while the scores are computed.
template <typename kv_t>
void attend_rows(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc) {
  const int64_t D = P.D, G = P.G, s = w.seq;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin, NR = R * G * ng, RG = R * G;
  const int64_t first_pos = L - n + w.q_begin, k_end = std::min<int64_t>(w.k_end, L - n + w.q_end);
  const int64_t span = ng * D;  // fp32 elements of one token's rows for this item's kv heads
  const int64_t span_bytes = ng * P.RL * static_cast<int64_t>(sizeof(kv_t));  // the same rows in the cache
  constexpr int64_t C = kRowsChunk;

  size_t off = 0;
  float* q = sc.take(NR * D, off);  // fp32 rows scaled to log2 units
  float* acc = sc.take(NR * D, off);
  float* m = sc.take(NR, off);
  float* l = sc.take(NR, off);
  float* alpha = sc.take(NR, off);
  float* sums = sc.take(NR, off);
  float* S = sc.take(NR * C, off);  // S[row][t]: scores, then probabilities
  float* kbuf = sc.take(span, off);
  float* vbuf = sc.take(C * span, off);
  int64_t base_buf[2][C];
  const float** vrow = sc.vrow.data();

  // row = (gi * R + ii) * G + j  <->  query tok0 + ii, head (kv_begin + gi) * G + j
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j, head = (w.kv_begin + gi) * G + j;
        for (int64_t d = 0; d < D; ++d) q[row * D + d] = q_at(P, tok0 + ii, head, d) * P.scale_log2;
      }
  std::fill(acc, acc + NR * D, 0.0f);
  std::fill(m, m + NR, kNegInf);
  std::fill(l, l + NR, 0.0f);
  const int64_t head_off = w.kv_begin * P.RL;
#if defined(__AVX512F__)
  const bool int8_in_registers = std::is_same_v<kv_t, uint8_t> && D <= kMaxInt8Dim;
#else
  const bool int8_in_registers = false;
#endif
  const uint8_t* zero_rec = reinterpret_cast<const uint8_t*>(vbuf);  // a record of zeros: keys past a chunk's end
  if (int8_in_registers) std::memset(vbuf, 0, P.RL);

  chunk_offsets(P, s, w.k_begin, std::min<int64_t>(C, k_end - w.k_begin), base_buf[0]);
  for (int64_t c0 = w.k_begin, ci = 0; c0 < k_end; c0 += C, ci ^= 1) {
    const int64_t cn = std::min(C, k_end - c0);
    const int64_t* base = base_buf[ci];
    const int64_t next_cn = std::max<int64_t>(0, std::min(C, k_end - c0 - C));
    if (next_cn > 0) chunk_offsets(P, s, c0 + C, next_cn, base_buf[ci ^ 1]);
    // This chunk's values and the next chunk's keys, fetched while the scores are computed.
    const auto prefetch = [&](int64_t t) __attribute__((always_inline)) {
      prefetch_l2(P.v + base[t] + head_off, span_bytes);
      if (t < next_cn) prefetch_l2(P.k + base_buf[ci ^ 1][t] + head_off, span_bytes);
    };
    if (int8_in_registers) {
#if defined(__AVX512F__)
      chunk_scores_int8(P, q, base, cn, head_off, ng, RG, zero_rec, S, prefetch);
#endif
    } else {
      chunk_scores_f32(P, w, q, base, cn, c0, first_pos, kbuf, S, prefetch);
    }
    softmax_chunk(S, m, l, alpha, sums, NR, R, G, cn, c0, first_pos);

    // Values: acc = acc * alpha + P V, one kv head at a time, accumulators in registers; fp32 and bf16 rows are
    // read in place, int8 records widened in registers (on AVX-512; elsewhere converted first).
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t r0 = gi * RG, off_g = head_off + gi * P.RL;
      if (int8_in_registers) {
#if defined(__AVX512F__)
        const uint8_t* recs[C];
        for (int64_t t = 0; t < cn; ++t) recs[t] = reinterpret_cast<const uint8_t*>(P.v + base[t] + off_g);
        pv_int8_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, C, recs, cn, RG);
#endif
      } else if constexpr (std::is_same_v<kv_t, uint8_t>) {
        if (gi == 0)
          for (int64_t t = 0; t < cn; ++t) rows_to_f32(P.v + base[t] + head_off, vbuf + t * span, D, ng);
        for (int64_t t = 0; t < cn; ++t) vrow[t] = vbuf + t * span + gi * D;
        pv_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, 1, C, vrow, cn, RG);
      } else {
        const kv_t* rows[C];
        for (int64_t t = 0; t < cn; ++t) rows[t] = P.v + base[t] + off_g;
        pv_rows(acc + r0 * D, D, alpha + r0, S + r0 * C, 1, C, rows, cn, RG);
      }
    }
  }
  finish_rows(P, w, acc, m, l, kbuf);
}

#if defined(__AVX512F__) || defined(PAGEDLLM_ATTENTION_AVX2)
// attend_rows over a bf16 cache (D = 32 * DW, or any multiple of 32 for DW = 0), reading the cache rows in place:
// the scores by scores_8 (each key row loaded once for the R x G query rows of its kv head; q_t = uint16_t: bf16
// queries by vdpbf16ps, q_t = float: fp32 queries by FMA over the keys widened in registers), the values by
// pv_bf16. Memory, not arithmetic, bounds it on two threads over a cache bigger than the last-level cache: with the
// arithmetic taken out (the same reads and prefetches) it takes ~85% of its time. So the order of
// the reads matters: keys and values are read 8 keys at a time with the kv heads inner (windows of adjacent memory
// rather than one pass per head over a chunk: ~8% faster), and the rows kPrefetchKeys keys ahead are prefetched one
// row at a time along the way (in bursts, or 8-16 keys ahead: slower), on into the first keys of the thread's next
// item, which it claims as the current one ends. Where kPipelinedChunks, one chunk's value sums run between the next
// chunk's scores, so that key and value reads overlap.
template <int DW, typename q_t>
void attend_rows_bf16(const Problem<at::BFloat16>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
  constexpr bool f32q = std::is_same_v<q_t, float>;
  const int64_t D = DW > 0 ? 32 * DW : P.D, G = P.G, s = w.seq;
  const int64_t L = P.context_lens[s], n = P.query_start_loc[s + 1] - P.query_start_loc[s];
  const int64_t tok0 = P.query_start_loc[s] + w.q_begin;
  const int64_t R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin, RG = R * G, NR = RG * ng;
  const int64_t first_pos = L - n + w.q_begin, k_end = std::min<int64_t>(w.k_end, L - n + w.q_end);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t C = kRowsChunk;

  size_t off = 0;
  // The query rows: raw bf16, or fp32 scaled to log2 units, kF32QueryWidth * D floats in the order of the widened
  // keys (layout_f32_query).
  const int64_t QD = f32q ? kF32QueryWidth * D : D;
  q_t* qh = reinterpret_cast<q_t*>(sc.take(NR * QD * sizeof(q_t) / sizeof(float), off));
  float* acc = sc.take(NR * D, off);  // per row and kPairBlock values: the even ones, then the odd (see pv_bf16)
  float* m = sc.take(NR, off);
  float* l = sc.take(NR, off);
  float* alpha = sc.take(NR, off);
  float* sums = sc.take(NR, off);
  float* S = sc.take(NR * C, off);  // S[row][t]: scores, then probabilities
  float* tmp = sc.take(D, off);  // zeros: the key row read past a chunk's end
  const uint16_t* zero = reinterpret_cast<const uint16_t*>(tmp);
  const uint16_t* K = reinterpret_cast<const uint16_t*>(P.k);
  const uint16_t* V = reinterpret_cast<const uint16_t*>(P.v);

  // row = (gi * R + ii) * G + j  <->  query tok0 + ii, head (kv_begin + gi) * G + j
  for (int64_t gi = 0; gi < ng; ++gi)
    for (int64_t ii = 0; ii < R; ++ii)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = (gi * R + ii) * G + j, head = (w.kv_begin + gi) * G + j;
        const int64_t qi = (tok0 + ii) * P.q_stride0 + head * P.q_stride1;
        if constexpr (f32q) {
          const float* src = static_cast<const float*>(P.q) + qi;
          if (P.half_q) {  // bf16 queries in the fp32 form: widened (exactly) into tmp first
            const at::BFloat16* src16 = static_cast<const at::BFloat16*>(P.q) + qi;
            for (int64_t d = 0; d < D; ++d) tmp[d] = static_cast<float>(src16[d]);
            src = tmp;
          }
          layout_f32_query(src, P.scale_log2, D, qh + row * QD);
        } else {
          std::memcpy(qh + row * D, static_cast<const uint16_t*>(P.q) + qi, row_bytes);
        }
      }
  std::fill(tmp, tmp + D, 0.0f);
  std::fill(acc, acc + NR * D, 0.0f);
  std::fill(m, m + NR, kNegInf);
  std::fill(l, l + NR, 0.0f);

  constexpr int64_t PT = kPrefetchKeys;
  // Cache slots (block * block_size + offset) of the item's keys, then of the first PT keys of the item this
  // thread runs next (when it reads the same kv heads), so that prefetching runs on across the items.
  const int64_t nk = k_end - w.k_begin;
  sc.slots.resize(nk + PT);
  int32_t* slot = sc.slots.data();
  slot_range(P, s, w.k_begin, nk, slot);
  int64_t nk_pf = nk;
  const int64_t slot_len = P.KVH * P.RL;  // cache elements per slot

  float* S2 = sc.take(NR * C, off);  // the next chunk's scores, computed while this chunk's values are summed
  // Scores of keys c0 + t0 .. + 8 of the chunk at c0 (cn keys) into Sx, the kv heads inner.
  const auto scores8 = [&](int64_t c0, int64_t cn, int64_t t0, float* Sx) __attribute__((always_inline)) {
    const int32_t* cs = slot + c0;
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t off_g = (w.kv_begin + gi) * P.RL;
      const uint16_t* krow[8];
      for (int64_t t = 0; t < 8; ++t) krow[t] = t0 + t < cn ? K + cs[t0 + t] * slot_len + off_g : zero;
      for (int64_t u = c0 + t0 + PT; u < std::min(c0 + t0 + 8 + PT, nk_pf); ++u)
        prefetch_l2(K + slot[u] * slot_len + off_g, row_bytes);
      const q_t* qg = qh + gi * RG * QD;
      float* Sg = Sx + gi * RG * C + t0;
      int64_t r = 0;
      if constexpr (f32q) {
        for (; r + 3 <= RG; r += 3) scores_8<DW, 3>(qg + r * QD, krow, D, Sg + r * C, C);
        if (RG - r == 2) scores_8<DW, 2>(qg + r * QD, krow, D, Sg + r * C, C);
        if (RG - r == 1) scores_8<DW, 1>(qg + r * QD, krow, D, Sg + r * C, C);
      } else {
        for (; r + 3 <= RG; r += 3) scores_8<DW, 3>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
        if (RG - r == 2) scores_8<DW, 2>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
        if (RG - r == 1) scores_8<DW, 1>(qg + r * D, krow, D, P.scale_log2, Sg + r * C, C);
      }
    }
  };
  // Values of keys c0 + s0 .. + sn (sn <= C) of the chunk at c0 with its probabilities Sx: acc = acc * alpha (at
  // s0 = 0) + P V, the kv heads inner: the accumulators go through memory at every call (~2% more work in cache),
  // the reads move through the cache in windows of adjacent rows.
  const auto values = [&](int64_t c0, int64_t s0, int64_t sn, const float* Sx) __attribute__((always_inline)) {
    const int32_t* cs = slot + c0;
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t off_g = (w.kv_begin + gi) * P.RL;
      const uint16_t* vrow[C];
      const uint16_t* vpf[C];
      for (int64_t t = 0; t < sn; ++t) vrow[t] = V + cs[s0 + t] * slot_len + off_g;
      int64_t pfn = std::max<int64_t>(0, std::min(sn, nk_pf - (c0 + s0 + PT)));
      for (int64_t t = 0; t < pfn; ++t) vpf[t] = V + slot[c0 + s0 + t + PT] * slot_len + off_g;
      for (int64_t r = gi * RG; r < (gi + 1) * RG; r += 3) {
        const int64_t rb = std::min<int64_t>(3, (gi + 1) * RG - r);
        float* o = acc + r * D;
        const float* a = s0 == 0 ? alpha + r : nullptr;
        const float* p = Sx + r * C + s0;
        for (int64_t d0 = 0; d0 < D; pfn = 0) {
          if (D - d0 >= 64) {
            if (rb == 3) pv_bf16<2, 3>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            if (rb == 2) pv_bf16<2, 2>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            if (rb == 1) pv_bf16<2, 1>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            d0 += 64;
          } else {
            if (rb == 3) pv_bf16<1, 3>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            if (rb == 2) pv_bf16<1, 2>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            if (rb == 1) pv_bf16<1, 1>(o, D, a, p, C, vrow, d0, sn, vpf, pfn, row_bytes);
            d0 += 32;
          }
        }
      }
    }
  };
  // Prefetching reaches the item's end: claim the next item and run the prefetches on into it.
  const auto claim_next = [&](int64_t c0) {
    if (claim.taken || c0 + C + PT < nk) return;
    const WorkItem* after = claim.take();
    if (after && !after->tiled && after->kv_begin == w.kv_begin && after->kv_end == w.kv_end) {
      const int64_t as = after->seq, an = P.query_start_loc[as + 1] - P.query_start_loc[as];
      const int64_t a_end = std::min<int64_t>(after->k_end, P.context_lens[as] - an + after->q_end);
      const int64_t extra = std::min<int64_t>(PT, a_end - after->k_begin);
      slot_range(P, as, after->k_begin, extra, slot + nk);
      nk_pf += extra;
    }
  };
  if constexpr (kPipelinedChunks) {
    // The next chunk's keys are read (its scores) while this chunk's values are summed, 8 keys of each at a time:
    // two streams of reads in flight. On Zen 3 the decode took 7-12% less time than with the loop below.
    if (nk > 0) {
      claim_next(0);
      for (int64_t t0 = 0; t0 < std::min(C, nk); t0 += 8) scores8(0, std::min(C, nk), t0, S);
      softmax_chunk(S, m, l, alpha, sums, NR, R, G, std::min(C, nk), w.k_begin, first_pos);
    }
    for (int64_t c0 = 0; c0 < nk; c0 += C) {  // c0: key index within the item
      const int64_t cn = std::min(C, nk - c0), nc0 = c0 + C, ncn = std::max<int64_t>(0, std::min(C, nk - nc0));
      if (ncn > 0) claim_next(nc0);
      for (int64_t t0 = 0; t0 < std::max(cn, ncn); t0 += 8) {
        if (t0 < ncn) scores8(nc0, ncn, t0, S2);
        if (t0 < cn) values(c0, t0, std::min<int64_t>(8, cn - t0), S);
      }
      if (ncn > 0) softmax_chunk(S2, m, l, alpha, sums, NR, R, G, ncn, w.k_begin + nc0, first_pos);
      std::swap(S, S2);
    }
  } else {
    // fp32 queries: a whole chunk per pass over the values (~3% faster on the Xeon without AVX512-BF16 than 8 keys).
    constexpr int64_t PS = f32q ? kRowsChunk : kValueKeys;
    for (int64_t c0 = 0; c0 < nk; c0 += C) {  // c0: key index within the item
      const int64_t cn = std::min(C, nk - c0);
      claim_next(c0);
      for (int64_t t0 = 0; t0 < cn; t0 += 8) scores8(c0, cn, t0, S);
      softmax_chunk(S, m, l, alpha, sums, NR, R, G, cn, w.k_begin + c0, first_pos);
      for (int64_t s0 = 0; s0 < cn; s0 += PS) values(c0, s0, std::min(PS, cn - s0), S);
    }
  }
  // Back to the natural order of the values: per block of kPairBlock, even values first, then odd ones.
  constexpr int64_t B = kPairBlock, H = kPairBlock / 2;
  for (int64_t row = 0; row < NR; ++row) {
    float* a = acc + row * D;
    for (int64_t j = 0; j < D; j += B)
      for (int64_t i = 0; i < H; ++i) tmp[j + 2 * i] = a[j + i], tmp[j + 2 * i + 1] = a[j + H + i];
    std::memcpy(a, tmp, D * sizeof(float));
  }
  finish_rows(P, w, acc, m, l, tmp);
}
#endif

#if defined(__AVX512F__) || defined(PAGEDLLM_ATTENTION_AVX2)
// attend_rows_bf16 compiled for the common head_dims.
template <typename q_t>
void attend_rows_bf16_any(const Problem<at::BFloat16>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
  switch (P.D) {
    case 32: return attend_rows_bf16<1, q_t>(P, w, sc, claim);
    case 64: return attend_rows_bf16<2, q_t>(P, w, sc, claim);
    case 128: return attend_rows_bf16<4, q_t>(P, w, sc, claim);
    default: return attend_rows_bf16<0, q_t>(P, w, sc, claim);
  }
}
#endif

// The decode kernel for this problem: over a bf16 cache with head_dim a multiple of 32, attend_rows_bf16, its scores
// on vdpbf16ps for bf16 queries where the route takes that form (tile_pairs: measured, as for the tiles), else in
// fp32 on the queries widened (on the Intel Xeon model 207, where vdpbf16ps runs at 0.72x the fp32 FMAs' rate, a
// 64 x 300-token decode's attention over 30 layers in 24.2 ms against 27.9); attend_rows over other caches.
template <typename kv_t>
void attend_decode(const Problem<kv_t>& P, const WorkItem& w, Scratch& sc, Claim& claim) {
#if defined(__AVX512F__) || defined(PAGEDLLM_ATTENTION_AVX2)
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
#if defined(__AVX512BF16__)
    if (P.D % 32 == 0 && P.half_q && P.tile_pairs) return attend_rows_bf16_any<uint16_t>(P, w, sc, claim);
#endif
    if (P.D % 32 == 0) return attend_rows_bf16_any<float>(P, w, sc, claim);
  }
#endif
  (void)claim;
  attend_rows(P, w, sc);
}
