// AVX2 port (8-float loads; ld64 sums a line's two halves) of 2026-11-28/zen5_logits/attention_reads/kv_block_reads.cpp.
// Reads shuffled K/V blocks as the decode kernel would (pools [blocks, block_bytes] per layer, tables [layers, seqs,
// blocks]), with no arithmetic but a sum, to see what access order and prefetching reach. Probe for kv_block_reads.py.
#include <torch/extension.h>
#include <immintrin.h>
#include <thread>
#include <vector>
#include <atomic>

static inline __m256 ld64(const char* p) { return _mm256_add_ps(_mm256_loadu_ps((const float*)p), _mm256_loadu_ps((const float*)(p + 32))); }
static inline __m256 sum_range(const char* p, int64_t bytes, __m256 acc) {
  for (int64_t i = 0; i < bytes; i += 64) acc = _mm256_add_ps(acc, ld64(p + i));
  return acc;
}
template <int HINT>
static inline void pf(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, (_mm_hint)HINT);
}

// tables: [L][S][NB] block ids into pools k[L], v[L] (each [num_blocks, block_bytes]).
// mode 0: per seq, per block: K block then V block, sequential lines, software prefetch `dist` blocks ahead (0: none)
// mode 1: per seq, per block: K and V interleaved line by line
double run(std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs, torch::Tensor tables, int64_t block_bytes,
           int64_t mode, int64_t dist, int64_t hint, int64_t threads) {
  const int64_t L = tables.size(0), S = tables.size(1), NB = tables.size(2);
  const int32_t* tb = tables.data_ptr<int32_t>();
  std::vector<const char*> kp(L), vp(L);
  for (int64_t l = 0; l < L; ++l) kp[l] = (const char*)ks[l].data_ptr(), vp[l] = (const char*)vs[l].data_ptr();
  std::vector<float> out(threads);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t l = 0; l < L; ++l) {
    std::atomic<int64_t> next{0};
    auto work = [&](int th) {
      __m256 acc = _mm256_setzero_ps();
      for (;;) {
        int64_t s = next.fetch_add(1);
        if (s >= S) break;
        const int32_t* t = tb + (l * S + s) * NB;
        for (int64_t b = 0; b < NB; ++b) {
          const char* K = kp[l] + (int64_t)t[b] * block_bytes;
          const char* V = vp[l] + (int64_t)t[b] * block_bytes;
          if (mode < 2 && dist > 0 && b + dist < NB) {
            const char* K2 = kp[l] + (int64_t)t[b + dist] * block_bytes;
            const char* V2 = vp[l] + (int64_t)t[b + dist] * block_bytes;
            switch (hint) {
              case 0: pf<_MM_HINT_T0>(K2, block_bytes); pf<_MM_HINT_T0>(V2, block_bytes); break;
              case 1: pf<_MM_HINT_T1>(K2, block_bytes); pf<_MM_HINT_T1>(V2, block_bytes); break;
              case 2: pf<_MM_HINT_T2>(K2, block_bytes); pf<_MM_HINT_T2>(V2, block_bytes); break;
              default: pf<_MM_HINT_NTA>(K2, block_bytes); pf<_MM_HINT_NTA>(V2, block_bytes); break;
            }
          }
          if (mode == 5 || mode == 6) {  // 5: the decode kernel's order (per 8 tokens, head by head); 6: in order
            for (const char* B : {K, V})
              for (int64_t t0 = 0; t0 < 16; t0 += 8)
                for (int h = 0; h < 3; ++h)
                  for (int64_t t = t0; t < t0 + 8; ++t)
                    for (int64_t i = 0; i < 128; i += 64) {
                      const int64_t off = mode == 6 ? t0 * 384 + (h * 8 + t - t0) * 128 + i : t * 384 + h * 128 + i;
                      acc = _mm256_add_ps(acc, ld64(B + off));
                    }
            continue;
          }
          if (mode >= 2) {
            const bool ahead = b + dist < NB;
            const char* K2 = ahead ? kp[l] + (int64_t)t[b + dist] * block_bytes : K;
            const char* V2 = ahead ? vp[l] + (int64_t)t[b + dist] * block_bytes : V;
            for (int64_t i = 0; i < block_bytes; i += 64) {
              if (ahead && (mode == 2 || (mode == 3 && (i & 511) == 0) || (mode == 4 && ((i + (int64_t)K2) & 4095) < 64))) {
                _mm_prefetch(K2 + i, _MM_HINT_T1); _mm_prefetch(V2 + i, _MM_HINT_T1);
              }
              acc = _mm256_add_ps(acc, ld64(K + i));
              acc = _mm256_add_ps(acc, ld64(V + i));
            }
            continue;
          }
          if (mode == 0) { acc = sum_range(K, block_bytes, acc); acc = sum_range(V, block_bytes, acc); }
          else for (int64_t i = 0; i < block_bytes; i += 64) {
            acc = _mm256_add_ps(acc, ld64(K + i));
            acc = _mm256_add_ps(acc, ld64(V + i));
          }
        }
      }
      float tmp[8]; _mm256_storeu_ps(tmp, acc); for (float x : tmp) out[th] += x;
    };
    std::vector<std::thread> ts;
    for (int th = 1; th < threads; ++th) ts.emplace_back(work, th);
    work(0);
    for (auto& x : ts) x.join();
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
