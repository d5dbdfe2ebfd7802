#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m256i acc[12]; for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  __m256 f[10]; for (int i = 0; i < 10; ++i) f[i] = _mm256_set1_ps(i);
  __m256 fa = _mm256_set1_ps(1.0001f), fb = _mm256_set1_ps(0.9999f);
  const long N = 200000000;
  auto t = std::chrono::steady_clock::now();
  for (long n = 0; n < N; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) { acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(a, b)); asm volatile("" : "+x"(acc[i])); }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("madd+add: %.2f G madd/s -> %.1f GOP/s (16 MAC each)\n", N * 12 / s / 1e9, N * 12 * 32 / s / 1e9);
  t = std::chrono::steady_clock::now();
  for (long n = 0; n < N; ++n) {
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) { f[i] = _mm256_fmadd_ps(fa, f[i], fb); asm volatile("" : "+x"(f[i])); }
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  printf("fma: %.2f G fma/s -> %.1f GFLOP/s\n", N * 10 / s / 1e9, N * 10 * 16 / s / 1e9);
  int sum = 0; alignas(32) int o[8]; for (int i = 0; i < 12; ++i) { _mm256_store_si256((__m256i*)o, acc[i]); sum += o[0]; }
  alignas(32) float p[8]; _mm256_store_ps(p, f[0]);
  printf("%d %f\n", sum, p[0]);
}
