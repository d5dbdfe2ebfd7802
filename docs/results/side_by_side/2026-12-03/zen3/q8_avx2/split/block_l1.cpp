// block_rows<3> of int4_q8_avx2.h, its sums and fold only, on data the L1 holds: cycles per group (1,536 products).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
constexpr int64_t kGroup = 32, kQuads = 8;
struct Rows { const int8_t* xq; const float* scale; const float* qsum; };

template <int R, int VARIANT>
void block_rows(const uint8_t* w, const float* dm, const Rows& x, int64_t r0, int64_t K, int64_t V, int64_t c0,
                float* out, int64_t N) {
  constexpr int C = 2;
  const int64_t G = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_si256();
    const uint8_t* wg = w + g * kQuads * V * 64 + c0 * 32;
    const int8_t* xg = x.xq + r0 * K + g * kGroup;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kQuads; ++j) {
      __m256i wj[C];
      for (int c = 0; c < C; ++c) wj[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * V * 64 + 32 * c));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xg + r * K + 4 * j, sizeof(quad));
        const __m256i xb = _mm256_set1_epi32(quad);
        for (int c = 0; c < C; ++c) sum[r][c] = _mm256_add_epi16(sum[r][c], _mm256_maddubs_epi16(wj[c], xb));
      }
    }
    if (VARIANT == 1) {  // no fold: keep the sums alive cheaply
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_or_ps(acc[r][c], _mm256_castsi256_ps(sum[r][c]));
      continue;
    }
    const float* dg = dm + g * 2 * V * 16 + 8 * c0;
    for (int c = 0; c < C; ++c) {
      const __m256 d = _mm256_loadu_ps(dg + 8 * c), m = _mm256_loadu_ps(dg + V * 16 + 8 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * G + g;
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[at]));
        const __m256i pairs = VARIANT == 2 ? _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(sum[r][c], 16), 16),
                                                               _mm256_srai_epi32(sum[r][c], 16))
                                           : _mm256_madd_epi16(sum[r][c], ones);
        const __m256 s = _mm256_cvtepi32_ps(pairs);
        acc[r][c] = _mm256_fmadd_ps(s, ds, acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.qsum[at]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + (r0 + r) * N + 8 * (c0 + c), acc[r][c]);
}

template <int R, int VARIANT>
double cycles_per_group(int64_t K, int64_t rows, int64_t V = 2) {
  const int64_t G = K / kGroup, N = 16 * V;
  std::vector<uint8_t> w(G * kQuads * V * 64, 7);
  std::vector<float> dm(G * 2 * V * 16, 0.5f), scale(rows * G, 0.1f), qsum(rows * G, 0.2f), out(rows * N);
  std::vector<int8_t> xq(rows * K, 3);
  Rows x{xq.data(), scale.data(), qsum.data()};
  const int reps = 20000 / rows + 1;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i)
    for (int64_t v = 0; v < 2 * V; v += 2)
      for (int64_t r = 0; r + R <= rows; r += R) block_rows<R, VARIANT>(w.data(), dm.data(), x, r, K, V, v, out.data(), N);
  auto t1 = std::chrono::steady_clock::now();
  const double groups = double(reps) * V * (rows / R) * G;
  return std::chrono::duration<double>(t1 - t0).count() * 3.0e9 / groups;
}

int main() {
  for (int rep = 0; rep < 2; ++rep)
    for (int64_t K : {576, 1536})
      for (int64_t rows : {48, 228})
        std::printf("K %ld rows %ld V 4: R3 fold %.1f, shifts %.1f, no fold %.1f cycles/group at 3.0 GHz\n", K, rows,
                    cycles_per_group<3, 0>(K, rows, 4), cycles_per_group<3, 2>(K, rows, 4), cycles_per_group<3, 1>(K, rows, 4));
}
