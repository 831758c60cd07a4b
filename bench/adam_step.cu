#include "bench/adam_step.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "core/buffer.h"

namespace ferry::bench {
namespace {

__device__ float unit(unsigned long long x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33, x *= 0xc4ceb9fe1a85ec53ull, x ^= x >> 33;
  return static_cast<float>(static_cast<double>(x >> 11) * 0x1.0p-52 - 1.0);
}

// A model some way into training: each master weight somewhere within its bf16 value's rounding
// interval, not on the grid where a fresh cast puts it.
__global__ void init_master(const __nv_bfloat16* w, float* master, __nv_bfloat16* m, __nv_bfloat16* v, size_t n,
                            unsigned long long tensor) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float on_grid = __bfloat162float(w[i]);
    const int e = max(static_cast<int>((__float_as_uint(on_grid) >> 23) & 0xff), 1);
    master[i] = on_grid + 0.499f * unit((tensor << 40) ^ i ^ 0x2545f491ull) * ldexpf(1.0f, e - 127 - 7);
    m[i] = __float2bfloat16(0.0f);
    v[i] = __float2bfloat16(0.0f);
  }
}

__global__ void adam(__nv_bfloat16* w, float* master, __nv_bfloat16* m, __nv_bfloat16* v, size_t n,
                     unsigned long long tensor, int t, float c1, float c2) {
  constexpr float kLr = 1e-6f, kB1 = 0.9f, kB2 = 0.999f, kEps = 1e-8f;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const unsigned long long id = (tensor << 40) ^ i;
    const float g = 0.5f * unit(id) + unit(id ^ (static_cast<unsigned long long>(t) << 56) ^ 0x5bd1e995ull);
    const float mi = kB1 * __bfloat162float(m[i]) + (1 - kB1) * g;
    const float vi = kB2 * __bfloat162float(v[i]) + (1 - kB2) * g * g;
    m[i] = __float2bfloat16(mi);
    v[i] = __float2bfloat16(vi);
    master[i] -= kLr * (mi / c1) / (sqrtf(vi / c2) + kEps);
    w[i] = __float2bfloat16_rn(master[i]);
  }
}

class DeviceAdamImpl final : public DeviceAdam {
 public:
  Status init(std::vector<TensorView> weights) {
    weights_ = std::move(weights);
    for (const TensorView& w : weights_) {
      if (w.dtype() != DType::kBF16 || !w.device().is_cuda()) {
        return Status::invalid_argument("Adam steps take bf16 device tensors, not " + w.describe());
      }
      const size_t n = static_cast<size_t>(w.numel());
      State s;
      FERRY_ASSIGN_OR_RETURN(s.master, Buffer::allocate(n * 4, w.device()));
      FERRY_ASSIGN_OR_RETURN(s.m, Buffer::allocate(n * 2, w.device()));
      FERRY_ASSIGN_OR_RETURN(s.v, Buffer::allocate(n * 2, w.device()));
      init_master<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(w.data()), s.master.data_as<float>(),
                                 s.m.data_as<__nv_bfloat16>(), s.v.data_as<__nv_bfloat16>(), n, states_.size() + 1);
      states_.push_back(std::move(s));
    }
    return sync();
  }

  Status step() override {
    ++t_;
    const float c1 = 1.0f - powf(0.9f, static_cast<float>(t_)), c2 = 1.0f - powf(0.999f, static_cast<float>(t_));
    for (size_t k = 0; k < weights_.size(); ++k) {
      State& s = states_[k];
      adam<<<1024, 256>>>(static_cast<__nv_bfloat16*>(weights_[k].data()), s.master.data_as<float>(),
                          s.m.data_as<__nv_bfloat16>(), s.v.data_as<__nv_bfloat16>(),
                          static_cast<size_t>(weights_[k].numel()), k + 1, t_, c1, c2);
    }
    return sync();
  }

 private:
  struct State {
    Buffer master, m, v;
  };
  static Status sync() {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return Status::internal(std::string("Adam step: ") + cudaGetErrorString(e));
    const cudaError_t l = cudaGetLastError();
    if (l != cudaSuccess) return Status::internal(std::string("Adam step: ") + cudaGetErrorString(l));
    return ok_status();
  }
  std::vector<TensorView> weights_;
  std::vector<State> states_;
  int t_ = 0;
};

}  // namespace

Result<std::unique_ptr<DeviceAdam>> DeviceAdam::create(std::vector<TensorView> weights) {
  auto a = std::make_unique<DeviceAdamImpl>();
  FERRY_RETURN_IF_ERROR(a->init(std::move(weights)));
  return std::unique_ptr<DeviceAdam>(std::move(a));
}

}  // namespace ferry::bench
