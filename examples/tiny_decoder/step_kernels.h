// The tiny decoder's non-GEMM kernels on a CUDA device: each only enqueues on `stream` (no
// synchronization, no host copies), so a decode step made of them and kernels::gemm_async can be
// captured into a CUDA graph. All pointers are device memory; the token and the position are read
// from device memory when the kernel runs, so a replay picks up what the host wrote before it.
#pragma once

#include <cstdint>

#include "core/status.h"

namespace tiny::cuda {

// x[0:h] = f32(table[token]) (a token outside [0, rows) gives zeros; the host checks tokens).
ferry::Status embed(const int32_t* token, const uint16_t* table, int64_t rows, int64_t h, float* x, void* stream);
// out = x / rms(x) * w (w bf16).
ferry::Status rmsnorm(const float* x, const uint16_t* w, float* out, int64_t n, float eps, void* stream);
// RoPE on q and k of `qkv` at position *pos, k and v into the caches at *pos, and causal GQA
// attention of every head over positions [0, *pos] into `att`.
ferry::Status attention(float* qkv, const int32_t* pos, float* kcache, float* vcache, float* att, int heads,
                        int kv_heads, int head_dim, int max_seq, float theta, void* stream);
// acc += add.
ferry::Status residual(float* acc, const float* add, int64_t n, void* stream);
// act[i] = silu(gu[i]) * gu[inter + i].
ferry::Status swiglu(const float* gu, float* act, int64_t inter, void* stream);
// *next = the first index of the largest of logits[0:vocab].
ferry::Status argmax(const float* logits, int64_t vocab, int32_t* next, void* stream);

}  // namespace tiny::cuda
