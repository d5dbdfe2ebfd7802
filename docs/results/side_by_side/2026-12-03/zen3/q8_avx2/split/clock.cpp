#include <chrono>
#include <cstdio>
int main() {
  for (int rep = 0; rep < 3; ++rep) {
    long x = 0, n = 1000000000;
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    auto t1 = std::chrono::steady_clock::now();
    std::printf("%.3f GHz (dependent adds)\n", 4.0 * n / std::chrono::duration<double>(t1 - t0).count() / 1e9);
  }
}
