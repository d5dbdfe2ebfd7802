// The row (decode) kernel's steps: dot products and value sums (AVX-512, or attention_avx2.h's on AVX2), a chunk's
// scores over fp32 rows or int8 records, the online softmax over a chunk, and an item's rows to the output
// (merging split partitions). Included by paged_attention.cpp inside its anonymous namespace.
#pragma once

#include "rows_int8.h"  // scores_8_int8 and pv_int8_rows, on AVX-512

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "attention_avx2.h"  // dot_rows, pv_rows and softmax_chunk in 8-float vectors
#else
// q . k over D values (D % 16 == 0).
inline float dot_rows(const float* q, const float* k, int64_t D) {
  v16 a = vload(q) * vload(k);
  for (int64_t d = 16; d < D; d += 16) a += vload(q + d) * vload(k + d);
  return hsum(a);
}

// 16 fp32 values of a V row, from fp32 or (converted in registers) bf16.
inline v16 load16(const float* p) { return vload(p); }
inline v16 load16(const at::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  return (v16)(__builtin_convertvector(h, vi16) << 16);
}

// O[rb][d0..d0+16W) = O * alpha[rb] + sum_t P[t * ts + rb * rs] * V[t][d0..) for RB rows rb (row stride D).
template <int RB, int W, typename row_t>
inline void pv_micro(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                     const row_t* const* vrow, int64_t d0, int64_t cn) {
  v16 acc[RB][W];
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = vload(O + r * D + 16 * w) * alpha[r];
  for (int64_t t = 0; t < cn; ++t) {
    v16 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = load16(vrow[t] + d0 + 16 * w);
    for (int r = 0; r < RB; ++r) {
      const float pt = P[t * ts + r * rs];
      for (int w = 0; w < W; ++w) acc[r][w] += pt * vv[w];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int w = 0; w < W; ++w) vstore(O + r * D + 16 * w, acc[r][w]);
}

// pv_micro over `rows` rows (any count) and the whole head_dim.
template <typename row_t>
inline void pv_rows(float* O, int64_t D, const float* alpha, const float* P, int64_t ts, int64_t rs,
                    const row_t* const* vrow, int64_t cn, int64_t rows) {
  for (int64_t r = 0; r < rows; r += 4) {
    const int64_t rb = std::min<int64_t>(4, rows - r);
    float* o = O + r * D;
    const float* a = alpha + r;
    const float* p = P + r * rs;
    for (int64_t d0 = 0; d0 < D;) {
      if (D - d0 >= 64) {
        switch (rb) {
          case 4: pv_micro<4, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 3: pv_micro<3, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 2: pv_micro<2, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          default: pv_micro<1, 4>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        }
        d0 += 64;
      } else {
        switch (rb) {
          case 4: pv_micro<4, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 3: pv_micro<3, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          case 2: pv_micro<2, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
          default: pv_micro<1, 1>(o + d0, D, a, p, ts, rs, vrow, d0, cn); break;
        }
        d0 += 16;
      }
    }
  }
}
#endif

// Scores S[row][t] of one chunk, token-major over fp32 rows: each token's K rows (all kv heads of the item) are
// converted once and dotted with every query row of their group. Rows whose query precedes key t get -inf.
template <typename kv_t, typename F>
void chunk_scores_f32(const Problem<kv_t>& P, const WorkItem& w, const float* q, const int64_t* base, int64_t cn,
                      int64_t c0, int64_t first_pos, float* kbuf, float* S, F&& prefetch) {
  const int64_t D = P.D, G = P.G, R = w.q_end - w.q_begin, ng = w.kv_end - w.kv_begin;
  const int64_t head_off = w.kv_begin * P.RL;
  for (int64_t t = 0; t < cn; ++t) {
    prefetch(t);
    const float* kt;
    if constexpr (std::is_same_v<kv_t, float>) {
      kt = P.k + base[t] + head_off;
    } else {
      rows_to_f32(P.k + base[t] + head_off, kbuf, D, ng);
      kt = kbuf;
    }
    for (int64_t gi = 0; gi < ng; ++gi) {
      const float* kr = kt + gi * D;
      for (int64_t ii = 0; ii < R; ++ii) {
        const bool visible = c0 + t <= first_pos + ii;
        for (int64_t j = 0; j < G; ++j) {
          const int64_t row = (gi * R + ii) * G + j;
          S[row * kRowsChunk + t] = visible ? dot_rows(q + row * D, kr, D) : kNegInf;
        }
      }
    }
  }
}

#if !defined(PAGEDLLM_ATTENTION_AVX2)  // attention_avx2.h has its own two steps of softmax_chunk
// One row of a chunk: its scores sr[0 .. kRowsChunk) to probabilities against the new running max (returned), the
// first `valid` of them seen (the rest exact zeros); *sum: their sum.
inline float row_softmax(float* sr, int64_t valid, float m_old, float* sum) {
  constexpr int64_t C = kRowsChunk;
  const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 mxv = vset(m_old);
  v16 s = {};
  if (valid == C) {  // every key visible: no masking
    for (int64_t t = 0; t < C; t += 16) mxv = vmax(mxv, vload(sr + t));
    const v16 mx = vset(hmax(mxv));
    for (int64_t t = 0; t < C; t += 16) {
      const v16 e = vexp2(vload(sr + t) - mx);
      vstore(sr + t, e);
      s += e;
    }
    *sum = hsum(s);
    return mx[0];
  }
  const vi16 lim = viset(static_cast<int32_t>(valid));
  for (int64_t t = 0; t < C; t += 16)
    mxv = vmax(mxv, (iota + static_cast<int32_t>(t)) < lim ? vload(sr + t) : vset(kNegInf));
  const v16 mx = vset(hmax(mxv));
  for (int64_t t = 0; t < C; t += 16) {
    const v16 e = (iota + static_cast<int32_t>(t)) < lim ? vexp2(vload(sr + t) - mx) : v16{};
    vstore(sr + t, e);
    s += e;
  }
  *sum = hsum(s);
  return mx[0];
}

// For up to 16 rows: alpha = 2^(old max - new max) (0 where the old max is -inf), l = l * alpha + sums.
constexpr int64_t kAlphaRows = 16;
inline void alpha_rows(float* alpha, const float* m, float* l, const float* sums) {
  const v16 mo = vload(alpha);
  const v16 a = mo == vset(kNegInf) ? v16{} : vexp2(mo - vload(m));
  vstore(alpha, a);
  vstore(l, vload(l) * a + vload(sums));
}
#endif

// Online softmax over one chunk's scores S[row][0 .. kRowsChunk) of the rows row = (gi * R + ii) * G + j: query ii
// (position first_pos + ii) sees the keys c0 .. first_pos + ii of the chunk's cn; the others, and padding, become
// exact zeros. alpha[row]: the factor that brings the row's earlier sums to the new running max m[row], computed
// for all rows at once after the loop (a scalar exp2 per row and chunk cost as much as the rest). `sums`: NR floats.
inline void softmax_chunk(float* S, float* m, float* l, float* alpha, float* sums, int64_t NR, int64_t R, int64_t G,
                          int64_t cn, int64_t c0, int64_t first_pos) {
  for (int64_t row = 0; row < NR; ++row) {
    const int64_t ii = (row / G) % R;
    const int64_t valid = std::min(cn, first_pos + ii + 1 - c0);
    float* sr = S + row * kRowsChunk;
    alpha[row] = m[row];  // the old max, for the pass below
    sums[row] = 0.0f;
    if (valid <= 0) {
      std::fill(sr, sr + kRowsChunk, 0.0f);
      continue;
    }
    m[row] = row_softmax(sr, valid, m[row], sums + row);
  }
  // alpha = 2^(old max - new max): 0 for a row that saw no key before (old max -inf), 1 for one with none now. The
  // last rows through buffers padded with zeros.
  int64_t r0 = 0;
  for (; r0 + kAlphaRows <= NR; r0 += kAlphaRows) alpha_rows(alpha + r0, m + r0, l + r0, sums + r0);
  if (r0 < NR) {
    const size_t bytes = (NR - r0) * sizeof(float);
    float a[kAlphaRows] = {}, mn[kAlphaRows] = {}, lo[kAlphaRows] = {}, su[kAlphaRows] = {};
    std::memcpy(a, alpha + r0, bytes), std::memcpy(mn, m + r0, bytes), std::memcpy(lo, l + r0, bytes);
    std::memcpy(su, sums + r0, bytes);
    alpha_rows(a, mn, lo, su);
    std::memcpy(alpha + r0, a, bytes), std::memcpy(l + r0, lo, bytes);
  }
}

// An item's rows (row = (gi * R + ii) * G + j, unnormalised sums acc, running max m in log2 units, sum l) to the
// output. A partition of a split decode leaves them in its slot instead, and the last partition of its group to
// finish merges them all: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p with M = max_p m_p, the same
// result as one pass up to fp32 rounding. `tmp`: D floats.
template <typename kv_t>
void finish_rows(const Problem<kv_t>& P, const WorkItem& w, const float* acc, const float* m, const float* l,
                 float* tmp) {
  const int64_t D = P.D, G = P.G, R = w.q_end - w.q_begin, NR = R * G * (w.kv_end - w.kv_begin);
  const int64_t tok0 = P.query_start_loc[w.seq] + w.q_begin;
  const auto tok = [&](int64_t row) { return tok0 + (row / G) % R; };
  const auto head = [&](int64_t row) { return (w.kv_begin + row / (R * G)) * G + row % G; };
  if (w.part < 0) {
    for (int64_t row = 0; row < NR; ++row) store_out(P, tok(row), head(row), acc + row * D, 1.0f / l[row]);
    return;
  }
  float* slot = P.split.partial + w.part * P.split.slot_floats;
  std::memcpy(slot, acc, NR * D * sizeof(float));
  std::memcpy(slot + NR * D, m, NR * sizeof(float));
  std::memcpy(slot + NR * D + NR, l, NR * sizeof(float));
  SplitGroup& g = P.split.groups[w.group];
  if (g.left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;  // other partitions still running
  const float* first = P.split.partial + g.first_slot * P.split.slot_floats;
  for (int64_t row = 0; row < NR; ++row) {
    float M = kNegInf;
    for (int32_t p = 0; p < g.parts; ++p) M = std::max(M, first[p * P.split.slot_floats + NR * D + row]);
    float sum = 0.0f;
    std::fill(tmp, tmp + D, 0.0f);
    for (int32_t p = 0; p < g.parts; ++p) {
      const float* sp = first + p * P.split.slot_floats;
      if (sp[NR * D + row] == kNegInf) continue;  // no key of this partition is visible to the row
      const float a = std::exp2(sp[NR * D + row] - M);
      sum += a * sp[NR * D + NR + row];
      for (int64_t d = 0; d < D; ++d) tmp[d] += a * sp[row * D + d];
    }
    store_out(P, tok(row), head(row), tmp, 1.0f / sum);
  }
}

#if defined(__AVX512F__)
// Scores S[row][t] of one chunk over an int8 cache, 8 keys at a time, each record's groups widened in registers once
// for the RG query rows of its kv head (rows gi * RG ..). Keys past cn score against zero_rec; softmax_chunk reads
// only the keys each row sees.
template <typename kv_t, typename F>
void chunk_scores_int8(const Problem<kv_t>& P, const float* q, const int64_t* base, int64_t cn, int64_t head_off,
                       int64_t ng, int64_t RG, const uint8_t* zero_rec, float* S, F&& prefetch) {
  const int64_t D = P.D;
  for (int64_t t0 = 0; t0 < cn; t0 += 8) {
    for (int64_t t = t0; t < std::min<int64_t>(t0 + 8, cn); ++t) prefetch(t);
    for (int64_t gi = 0; gi < ng; ++gi) {
      const uint8_t* krec[8];
      for (int64_t t = 0; t < 8; ++t)
        krec[t] = t0 + t < cn ? reinterpret_cast<const uint8_t*>(P.k + base[t0 + t] + head_off + gi * P.RL) : zero_rec;
      scores_8_int8_rows(q + gi * RG * D, krec, D, S + gi * RG * kRowsChunk + t0, kRowsChunk, RG);
    }
  }
}
#endif
