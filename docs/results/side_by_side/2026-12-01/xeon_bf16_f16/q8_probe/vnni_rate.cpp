// vfmadd231ph against vpdpbusd throughput on one core: 12 independent chains each, multiply-adds per second
// (vpdpbusd: 4 u8 x s8 products per 32-bit lane), three rounds.
// g++ -O2 -march=native vnni_rate.cpp -o vnni_rate && ./vnni_rate
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <typename V, typename F> double run(F f, long iters) {
  V a[12]; for (int i=0;i<12;++i) { a[i] = V{}; ((char*)&a[i])[0] = (char)i; asm volatile("" : "+m"(a[i])); }
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = f(a[i]);
  }
  auto t1 = std::chrono::steady_clock::now();
  for (int i=0;i<12;++i) { volatile int s2 = ((int*)&a[i])[0]; (void)s2; }
  return std::chrono::duration<double>(t1 - t0).count();
}
int main() {
  const long iters = 100000000;
  __m512h bh = _mm512_set1_ph((_Float16)0.999f), ch = _mm512_set1_ph((_Float16)0.001f);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
  for (int rep = 0; rep < 3; ++rep) {
    double t16 = run<__m512h>([&](__m512h v){ return _mm512_fmadd_ph(v, bh, ch); }, iters);
    double t8 = run<__m512i>([&](__m512i acc){ asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); return acc; }, iters);
    printf("fp16 FMA: %.1f G multiply-adds/s  vpdpbusd: %.1f G multiply-adds/s\n", iters*12*32/t16/1e9, iters*12*64/t8/1e9);
  }
}
