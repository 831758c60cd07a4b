// What the standalone GPU probes (copy_probe.cu, quant_probe.cu) share: a CUDA call that ends the
// probe when it fails, and the median time of a launch sequence between two events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                      \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

// Milliseconds of `f()` (work queued on the legacy default stream): the median of 15 runs after one
// warm-up run.
template <typename F>
double time_ms(F f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();
  CK(cudaDeviceSynchronize());
  std::vector<float> s;
  for (int i = 0; i < 15; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    s.push_back(ms);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

// `n` bf16 values of random sign, mantissa and exponent (2^-12 .. 2^2), the probes' input.
inline std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed = 42) {
  std::vector<uint16_t> h(static_cast<size_t>(n));
  std::mt19937_64 rng(seed);
  for (auto& v : h) {
    const uint64_t x = rng();
    const uint32_t exp = 115 + (x >> 8) % 14;
    v = static_cast<uint16_t>(((x & 1) << 15) | (exp << 7) | ((x >> 20) & 0x7F));
  }
  return h;
}
