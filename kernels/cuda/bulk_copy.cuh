// Hopper's one-dimensional bulk copies (TMA) from global into shared memory, completed on an
// mbarrier, and the grid barrier of a cooperative kernel. Used by the one-kernel fp8_per_tensor
// quantization (quantize_tensor.cu); sm_90 and later.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ferry::kernels::detail::cuda {

// Declared for the host pass and sm_90+ device passes (older device passes cannot assemble them).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier that one thread arrives on per phase (with the bytes it expects).
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`;
// the phase of `bar` completes when they have landed. `policy`: an L2 cache policy.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

// Asks L2 to fetch `bytes` (a multiple of 16) at `src` (16-byte aligned), with cache policy `policy`.
__device__ __forceinline__ void l2_prefetch(const void* src, uint32_t bytes, uint64_t policy) {
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src), "r"(bytes), "l"(policy)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

// Shared memory read by the threads (generic proxy) is next written by a bulk copy (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block of a cooperative grid waits here for the others; `round` counts the barriers of this
// launch from 1. counter[0] only grows during a launch; the kernel resets it (see its caller).
__device__ __forceinline__ void grid_barrier(uint32_t* counter, uint32_t round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (load_acquire(counter) < round * gridDim.x) {
    }
  }
  __syncthreads();
}

#endif

}  // namespace ferry::kernels::detail::cuda
