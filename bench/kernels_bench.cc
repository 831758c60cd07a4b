#include "bench/kernels_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "core/buffer.h"
#include "core/float_convert.h"
#include "kernels/gptq.h"
#include "kernels/quantize.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry {
namespace {


constexpr int kRuns = 7;

struct Timed {
  double seconds = 0;
  Status status;
};

// Median over kRuns after one warm-up run. On a GPU each run is kCudaBatch calls back to back
// between two events, the time per call their mean: the device's time per call, as a rank's reload
// makes its calls one after another, without the host's launch latency of a lone call (about 10 µs,
// 15% of a 64 MiB quantization on an H200) in every figure.
constexpr int kCudaBatch = 10;

Timed time_runs(bool cuda, const std::function<Status()>& fn) {
  Timed t;
  t.status = fn();
  if (!t.status.ok()) return t;
  std::vector<double> s;
  for (int i = 0; i < kRuns; ++i) {
#if defined(FERRY_HAVE_CUDA)
    if (cuda) {
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      cudaEventRecord(a, nullptr);
      for (int k = 0; k < kCudaBatch && t.status.ok(); ++k) t.status = fn();
      cudaEventRecord(b, nullptr);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      s.push_back(ms / 1e3 / kCudaBatch);
      if (!t.status.ok()) return t;
      continue;
    }
#endif
    const auto a = std::chrono::steady_clock::now();
    t.status = fn();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    if (!t.status.ok()) return t;
  }
  std::sort(s.begin(), s.end());
  t.seconds = s[s.size() / 2];
  return t;
}

struct Tensors {
  std::vector<Buffer> buffers;
  std::vector<TensorView> views;
  size_t bytes = 0;
};

Result<Tensors> allocate(const std::vector<kernels::StorageTensor>& layout, Device dev) {
  Tensors t;
  for (const auto& s : layout) {
    const size_t n = dtype_bytes(s.dtype, shape_numel(s.shape));
    FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(std::max<size_t>(n, 64), dev));
    FERRY_RETURN_IF_ERROR(b.zero());
    t.views.emplace_back(b.data(), s.dtype, s.shape, dev);
    t.bytes += n;
    t.buffers.push_back(std::move(b));
  }
  return t;
}

Status upload(void* dst, const void* src, size_t n, Device dev) {
#if defined(FERRY_HAVE_CUDA)
  if (dev.is_cuda()) {
    return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) == cudaSuccess ? ok_status()
                                                                         : Status::internal("bench: upload failed");
  }
#endif
  std::memcpy(dst, src, n);
  return ok_status();
}

Status copy_baseline(void* dst, const void* src, size_t n, Device dev) {
#if defined(FERRY_HAVE_CUDA)
  if (dev.is_cuda()) {
    return cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, nullptr) == cudaSuccess
               ? ok_status()
               : Status::internal("bench: cudaMemcpy failed");
  }
#endif
  std::memcpy(dst, src, n);
  return ok_status();
}

void print(bool json, std::string_view scheme, const Device& dev, size_t bytes, double seconds, double base_gbps) {
  const double gbps = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
  const std::string d = dev.is_cuda() ? "cuda" : "cpu";
  if (json) {
    fmt::print(
        "{{\"bench\":\"kernels\",\"case\":\"{}\",\"device\":\"{}\",\"bytes\":{},\"seconds\":{:.9f},\"gbps\":{:.3f},"
        "\"baseline\":\"memcpy\",\"baseline_gbps\":{:.3f},\"ratio\":{:.3f}}}\n",
        scheme, d, bytes, seconds, gbps, base_gbps, base_gbps > 0 ? gbps / base_gbps : 0);
  } else {
    fmt::print("kernels {:<17} {:<4} {:>12} B {:>10.6f} s {:>9.2f} GB/s  memcpy {:>9.2f} GB/s  ratio {:.2f}\n", scheme,
               d, bytes, seconds, gbps, base_gbps, base_gbps > 0 ? gbps / base_gbps : 0);
  }
}

Status bench_device(bool json, Device dev, size_t rows, size_t cols) {
  const Shape shape{static_cast<int64_t>(rows), static_cast<int64_t>(cols)};
  const size_t n = rows * cols, in_bytes = n * 2;
  std::vector<uint16_t> host(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  for (auto& v : host) v = f32_to_bf16(dist(rng));
  FERRY_ASSIGN_OR_RETURN(Buffer in, Buffer::allocate(in_bytes, dev));
  FERRY_ASSIGN_OR_RETURN(Buffer copy, Buffer::allocate(in_bytes, dev));
  FERRY_RETURN_IF_ERROR(upload(in.data(), host.data(), in_bytes, dev));
  const TensorView input(in.data(), DType::kBF16, shape, dev);
  const kernels::Exec exec{};

  auto base = time_runs(dev.is_cuda(), [&] { return copy_baseline(copy.data(), in.data(), in_bytes, dev); });
  FERRY_RETURN_IF_ERROR(base.status);
  const double base_gbps = 2.0 * static_cast<double>(in_bytes) / base.seconds / 1e9;

  for (Scheme s : kAllSchemes) {
    if (s == Scheme::kGptqInt4) continue;
    if (s == Scheme::kInt4Group && cols % kGroupSize != 0) continue;
    FERRY_ASSIGN_OR_RETURN(auto layout, kernels::storage_layout(s, shape, {}, DType::kF16));
    FERRY_ASSIGN_OR_RETURN(Tensors out, allocate(layout, dev));
    auto t = time_runs(dev.is_cuda(), [&] { return kernels::quantize(s, input, {}, out.views, exec); });
    FERRY_RETURN_IF_ERROR(t.status.with_context(scheme_name(s)));
    print(json, scheme_name(s), dev, in_bytes + out.bytes, t.seconds, base_gbps);
  }

  // gptq_int4: the reload of a checkpoint with logical weight [rows, cols] ([N, K]).
  if (cols % kGroupSize == 0) {
    const Shape w{static_cast<int64_t>(rows), static_cast<int64_t>(cols)};
    FERRY_ASSIGN_OR_RETURN(auto ck_layout, kernels::gptq_checkpoint_layout(w));
    FERRY_ASSIGN_OR_RETURN(auto st_layout, kernels::gptq_storage_layout(w));
    FERRY_ASSIGN_OR_RETURN(Tensors ck, allocate(ck_layout, dev));
    FERRY_ASSIGN_OR_RETURN(Tensors out, allocate(st_layout, dev));
    std::vector<int32_t> g(cols);
    for (size_t k = 0; k < cols; ++k) g[k] = static_cast<int32_t>(k / kGroupSize);
    std::shuffle(g.begin(), g.end(), rng);
    FERRY_RETURN_IF_ERROR(upload(ck.views[2].data(), g.data(), g.size() * 4, dev));
    auto t = time_runs(dev.is_cuda(),
                       [&] { return kernels::gptq_reload(ck.views[0], ck.views[1], ck.views[2], out.views, exec); });
    FERRY_RETURN_IF_ERROR(t.status.with_context("gptq_int4"));
    print(json, "gptq_int4", dev, ck.bytes + out.bytes, t.seconds, base_gbps);
  }
  return ok_status();
}

}  // namespace

int run_kernels_bench(bool json, const std::string& device, size_t rows, size_t cols) {
  if (device != "cpu" && device != "cuda" && device != "all") {
    fmt::print(stderr, "bench kernels: device '{}' (expected cpu, cuda or all)\n", device);
    return 1;
  }
  if (rows == 0 || cols == 0) {
    fmt::print(stderr, "bench kernels: rows and cols must be positive\n");
    return 1;
  }
  std::vector<Device> devices;
  if (device != "cuda") devices.push_back(Device::cpu());
  if (device == "cuda" || (device == "all" && cuda_device_available())) devices.push_back(Device::cuda(0));
  for (const Device& d : devices) {
    Status st = bench_device(json, d, rows, cols);
    if (!st.ok()) {
      fmt::print(stderr, "bench kernels on {}: {}\n", d.to_string(), st.to_string());
      return 1;
    }
  }
  return 0;
}

}  // namespace ferry
