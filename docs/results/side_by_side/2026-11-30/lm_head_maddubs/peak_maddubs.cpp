// One core: 12 independent chains of vpmaddubsw -> vpmaddwd -> vpaddd (32 products each), of vpmaddwd -> vpaddd (16),
// of two vpmaddubsw -> vpaddw -> vpaddd (64), and 10 of 8-float FMAs (8). g++ -O2 -march=native peak_maddubs.cpp -o peak && ./peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m256i acc[12]; for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
  const long N = 100000000;
  for (int mode = 0; mode < 3; ++mode) {
    auto t = std::chrono::steady_clock::now();
    for (long n = 0; n < N; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) {
        __m256i p;
        if (mode == 0) p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // 32 MAC
        else if (mode == 1) p = _mm256_madd_epi16(w, x);                          // 16 MAC
        else p = _mm256_add_epi16(_mm256_maddubs_epi16(w, x), _mm256_maddubs_epi16(x, w));  // 64 MAC (no widen)
        acc[i] = _mm256_add_epi32(acc[i], p);
        asm volatile("" : "+x"(acc[i]));
        asm volatile("" : "+x"(w));
      }
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    int mac = mode == 0 ? 32 : mode == 1 ? 16 : 64;
    printf("mode %d: %.2f G iters/s -> %.1f G MAC/s\n", mode, N * 12 / s / 1e9, N * 12.0 * mac / s / 1e9);
  }
  __m256 f[10]; for (int i = 0; i < 10; ++i) f[i] = _mm256_set1_ps(i);
  __m256 fa = _mm256_set1_ps(1.0001f), fb = _mm256_set1_ps(0.9999f);
  auto t = std::chrono::steady_clock::now();
  for (long n = 0; n < N; ++n) {
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) { f[i] = _mm256_fmadd_ps(fa, f[i], fb); asm volatile("" : "+x"(f[i])); }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("fma: %.2f G/s -> %.1f G MAC/s\n", N * 10 / s / 1e9, N * 10.0 * 8 / s / 1e9);
  int sum = 0; alignas(32) int o[8]; for (int i = 0; i < 12; ++i) { _mm256_store_si256((__m256i*)o, acc[i]); sum += o[0]; }
  alignas(32) float p[8]; _mm256_store_ps(p, f[0]);
  printf("%d %f\n", sum, p[0]);
}
