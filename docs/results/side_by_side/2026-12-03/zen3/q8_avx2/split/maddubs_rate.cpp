#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
template <int MODE>
double run(long iters) {
  __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5), x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+x"(w0), "+x"(w1), "+x"(x0), "+x"(x1));
    if (MODE == 0) {
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w0, x0));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w1, x0));
      s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(w0, x1));
      s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(w1, x1));
    } else if (MODE == 1) {
      s0 = _mm256_maddubs_epi16(w0, x0); s1 = _mm256_maddubs_epi16(w1, x0);
      s2 = _mm256_maddubs_epi16(w0, x1); s3 = _mm256_maddubs_epi16(w1, x1);
      __asm__ volatile("" : "+x"(s0), "+x"(s1), "+x"(s2), "+x"(s3));
    } else {
      __m256 a = _mm256_castsi256_ps(w0), b = _mm256_castsi256_ps(x0);
      s0 = _mm256_castps_si256(_mm256_fmadd_ps(a, b, _mm256_castsi256_ps(s0)));
      s1 = _mm256_castps_si256(_mm256_fmadd_ps(a, b, _mm256_castsi256_ps(s1)));
      s2 = _mm256_castps_si256(_mm256_fmadd_ps(a, b, _mm256_castsi256_ps(s2)));
      s3 = _mm256_castps_si256(_mm256_fmadd_ps(a, b, _mm256_castsi256_ps(s3)));
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  int64_t sink = _mm256_extract_epi64(s0, 0) + _mm256_extract_epi64(s1, 0) + _mm256_extract_epi64(s2, 0) + _mm256_extract_epi64(s3, 0);
  if (sink == 42) std::puts("");
  return std::chrono::duration<double>(t1 - t0).count() / iters * 1e9 * 3.0;  // cycles at 3.0 GHz
}
int main() {
  const long n = 300000000;
  for (int rep = 0; rep < 2; ++rep)
    std::printf("cycles per iteration of 4 ops (at 3.0 GHz): maddubs+add %.2f, maddubs only %.2f, fma chains %.2f\n", run<0>(n), run<1>(n), run<2>(n));
}
