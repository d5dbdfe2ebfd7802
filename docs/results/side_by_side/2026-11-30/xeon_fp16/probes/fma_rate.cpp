// vfmadd231ps against vfmadd231ph throughput on one core: 12 independent chains each, multiply-adds (lanes) per
// second, three rounds. g++ -O2 -mavx512f -mavx512fp16 -mfma fma_rate.cpp -o fma_rate && ./fma_rate
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
  volatile float sink = ((float*)&a[0])[0]; (void)sink;
  for (int i=1;i<12;++i) { volatile float s2 = ((float*)&a[i])[0]; (void)s2; }
  return std::chrono::duration<double>(t1 - t0).count();
}
int main() {
  const long iters = 100000000;
  __m512 b = _mm512_set1_ps(1.0001f), c = _mm512_set1_ps(0.5f);
  __m512h bh = _mm512_set1_ph((_Float16)0.999f), ch = _mm512_set1_ph((_Float16)0.001f);
  for (int rep = 0; rep < 3; ++rep) {
    double t32 = run<__m512>([&](__m512 x){ return _mm512_fmadd_ps(x, b, c); }, iters);
    double t16 = run<__m512h>([&](__m512h x){ return _mm512_fmadd_ph(x, bh, ch); }, iters);
    printf("fp32: %.2f GFMA-lanes/s  fp16: %.2f GFMA-lanes/s\n", iters*12*16/t32/1e9, iters*12*32/t16/1e9);
  }
}
