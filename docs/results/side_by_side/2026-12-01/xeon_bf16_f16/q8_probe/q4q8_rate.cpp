// How fast could a Q4 x Q8 (per group of 32) kernel on vpdpbusd run on one core, against int4_linear_f16? A probe:
// the inner loop only (R = 6 rows x V = 4 vectors of 16 columns, per group: 8 k-quads of unpacked nibbles, int32 sums
// scaled into fp32 partials in L1 with the weight's d and m and the row's activation scale and sum), random data, no
// outliers, one thread. g++ -O3 -march=native q4q8_rate.cpp -o q4q8_rate && ./q4q8_rate M N K
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int R = 6, V = 4, G = 32;

// The weights, per (64-column tile, group of 32): V vectors x 4 loads of 64 bytes, each 2 k-quads (low and high
// nibbles) of 16 columns x 4 k.
void block(const uint8_t* w, const int8_t* xq, const float* dx, const float* sx, const float* dw, const float* mw,
           int K, int N, float* out) {
  alignas(64) float acc[R][V][16] = {};
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < K / G; ++g) {
    __m512i s[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) s[r][v] = _mm512_setzero_si512();
    const uint8_t* wg = w + (size_t)g * V * 4 * 64;
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {  // 2 quads per load
      __m512i wl[V], wh[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        const __m512i b = _mm512_loadu_si512(wg + (v * 4 + l) * 64);
        wl[v] = _mm512_and_si512(b, lo4);
        wh[v] = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4);
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int32_t q0, q1;
        std::memcpy(&q0, xq + (size_t)r * K + g * G + l * 8, 4);
        std::memcpy(&q1, xq + (size_t)r * K + g * G + l * 8 + 4, 4);
        const __m512i b0 = _mm512_set1_epi32(q0), b1 = _mm512_set1_epi32(q1);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          asm("vpdpbusd %2, %1, %0" : "+v"(s[r][v]) : "v"(wl[v]), "v"(b0));
          asm("vpdpbusd %2, %1, %0" : "+v"(s[r][v]) : "v"(wh[v]), "v"(b1));
        }
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m512 d = _mm512_loadu_ps(dw + (size_t)g * N + v * 16), m = _mm512_loadu_ps(mw + (size_t)g * N + v * 16);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        __m512 a = _mm512_load_ps(acc[r][v]);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * (K / G) + g])), a);
        a = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * (K / G) + g]), a);
        _mm512_store_ps(acc[r][v], a);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (size_t)r * N + v * 16, _mm512_load_ps(acc[r][v]));
}

int main(int argc, char** argv) {
  const int M = argc > 1 ? atoi(argv[1]) : 64, N = argc > 2 ? atoi(argv[2]) : 3072, K = argc > 3 ? atoi(argv[3]) : 576;
  std::vector<uint8_t> w((size_t)N / 64 * K / G * V * 4 * 64);
  for (auto& b : w) b = rand();
  std::vector<int8_t> xq((size_t)M * K);
  for (auto& b : xq) b = rand() % 255 - 127;
  std::vector<float> dx(M * K / G, 0.01f), sx(M * K / G, 0.1f), dw((size_t)K / G * N, 0.02f), mw((size_t)K / G * N, -0.1f);
  std::vector<float> out((size_t)M * N);
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < N / 64; ++t)
      for (int r = 0; r + R <= M; r += R)
        block(w.data() + (size_t)t * K / G * V * 4 * 64, xq.data() + (size_t)r * K, dx.data() + r * (K / G),
              sx.data() + r * (K / G), dw.data() + t * 64, mw.data() + t * 64, K, N, out.data() + (size_t)r * N + t * 64);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const int Mr = M / R * R;
  printf("M %d (%d run) N %d K %d: %.3f ms, %.1f G multiply-adds/s (one core)\n", M, Mr, N, K, best * 1e3,
         (double)Mr * N * K / best / 1e9);
}
