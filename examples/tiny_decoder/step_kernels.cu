#include "examples/tiny_decoder/step_kernels.h"

#include <cuda_runtime.h>

#include <cfloat>

#include "core/cuda_check.h"

namespace tiny::cuda {
namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

__device__ __forceinline__ float bf16(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

// Sum of `v` over the block (kThreads threads); every thread gets it.
__device__ float block_sum(float v) {
  __shared__ float part[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) s += part[i];
  __syncthreads();
  return s;
}

__global__ void embed_kernel(const int32_t* token, const uint16_t* table, int64_t rows, int64_t h, float* x) {
  const int32_t t = *token;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) x[i] = (t >= 0 && t < rows) ? bf16(table[t * h + i]) : 0.0f;
}

__global__ void rmsnorm_kernel(const float* x, const uint16_t* w, float* out, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * r * bf16(w[i]);
}

__device__ void rope(float* x, int d, int pos, float theta) {
  for (int i = threadIdx.x; i < d / 2; i += blockDim.x) {
    const float freq = powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(d));
    const float a = static_cast<float>(pos) * freq, c = cosf(a), s = sinf(a);
    const float x1 = x[i], x2 = x[i + d / 2];
    x[i] = x1 * c - x2 * s;
    x[i + d / 2] = x2 * c + x1 * s;
  }
}

// Block b < heads rotates q head b; block heads + j rotates k head j and writes k, v to the caches.
__global__ void rope_cache_kernel(float* qkv, const int32_t* pos, float* kc, float* vc, int heads, int kv_heads, int hd,
                                  int max_seq, float theta) {
  const int p = *pos;
  if (p < 0 || p >= max_seq) return;
  const int nq = heads * hd, nkv = kv_heads * hd;
  const int b = blockIdx.x;
  float* head = b < heads ? qkv + b * hd : qkv + nq + (b - heads) * hd;
  rope(head, hd, p, theta);
  if (b < heads) return;
  __syncthreads();
  const int j = b - heads;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    kc[static_cast<int64_t>(p) * nkv + j * hd + i] = head[i];
    vc[static_cast<int64_t>(p) * nkv + j * hd + i] = qkv[nq + nkv + j * hd + i];
  }
}

// One block per query head; scores in shared memory (max_seq floats).
__global__ void attention_kernel(const float* qkv, const int32_t* pos, const float* kc, const float* vc, float* att,
                                 int heads, int kv_heads, int hd, int max_seq) {
  extern __shared__ float score[];
  const int p = *pos;
  if (p < 0 || p >= max_seq) return;
  const int head = blockIdx.x, kvh = head / (heads / kv_heads), nkv = kv_heads * hd;
  const float* q = qkv + head * hd;
  const float inv = rsqrtf(static_cast<float>(hd));
  for (int t = threadIdx.x; t <= p; t += blockDim.x) {
    float dot = 0.0f;
    for (int i = 0; i < hd; ++i) dot += q[i] * kc[static_cast<int64_t>(t) * nkv + kvh * hd + i];
    score[t] = dot * inv;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mx = -FLT_MAX, sum = 0.0f;
    for (int t = 0; t <= p; ++t) mx = fmaxf(mx, score[t]);
    for (int t = 0; t <= p; ++t) sum += (score[t] = expf(score[t] - mx));
    for (int t = 0; t <= p; ++t) score[t] /= sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float acc = 0.0f;
    for (int t = 0; t <= p; ++t) acc += score[t] * vc[static_cast<int64_t>(t) * nkv + kvh * hd + i];
    att[head * hd + i] = acc;
  }
}

__global__ void residual_kernel(float* acc, const float* add, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) acc[i] += add[i];
}

__global__ void swiglu_kernel(const float* gu, float* act, int64_t inter) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < inter) {
    const float g = gu[i];
    act[i] = g / (1.0f + expf(-g)) * gu[inter + i];
  }
}

__global__ void argmax_kernel(const float* logits, int64_t vocab, int32_t* next) {
  __shared__ float best_v[kThreads];
  __shared__ int32_t best_i[kThreads];
  float v = -FLT_MAX;
  int32_t idx = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (logits[i] > v) v = logits[i], idx = static_cast<int32_t>(i);
  }
  best_v[threadIdx.x] = v;
  best_i[threadIdx.x] = idx;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int32_t oi = best_i[threadIdx.x + s];
      // Ties go to the lower index, as the CPU's first-max scan.
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *next = best_i[0];
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

ferry::Status embed(const int32_t* token, const uint16_t* table, int64_t rows, int64_t h, float* x, void* stream) {
  embed_kernel<<<1, kThreads, 0, as_stream(stream)>>>(token, table, rows, h, x);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

ferry::Status rmsnorm(const float* x, const uint16_t* w, float* out, int64_t n, float eps, void* stream) {
  rmsnorm_kernel<<<1, kThreads, 0, as_stream(stream)>>>(x, w, out, n, eps);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

ferry::Status attention(float* qkv, const int32_t* pos, float* kcache, float* vcache, float* att, int heads,
                        int kv_heads, int head_dim, int max_seq, float theta, void* stream) {
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0) {
    return ferry::Status::invalid_argument("attention: heads must be a multiple of kv_heads");
  }
  rope_cache_kernel<<<static_cast<unsigned>(heads + kv_heads), 64, 0, as_stream(stream)>>>(
      qkv, pos, kcache, vcache, heads, kv_heads, head_dim, max_seq, theta);
  FERRY_CUDA_CHECK(cudaGetLastError());
  attention_kernel<<<static_cast<unsigned>(heads), 64, static_cast<size_t>(max_seq) * sizeof(float),
                     as_stream(stream)>>>(qkv, pos, kcache, vcache, att, heads, kv_heads, head_dim, max_seq);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

ferry::Status residual(float* acc, const float* add, int64_t n, void* stream) {
  residual_kernel<<<blocks(n), kThreads, 0, as_stream(stream)>>>(acc, add, n);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

ferry::Status swiglu(const float* gu, float* act, int64_t inter, void* stream) {
  swiglu_kernel<<<blocks(inter), kThreads, 0, as_stream(stream)>>>(gu, act, inter);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

ferry::Status argmax(const float* logits, int64_t vocab, int32_t* next, void* stream) {
  argmax_kernel<<<1, kThreads, 0, as_stream(stream)>>>(logits, vocab, next);
  FERRY_CUDA_CHECK(cudaGetLastError());
  return ferry::ok_status();
}

}  // namespace tiny::cuda
