// Copies between host test tensors and device buffers. GPU tests call skip_without_gpu() first.
#pragma once

#include <gtest/gtest.h>

#include <span>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "kernels/quantize.h"
#include "tests/kernels/test_util.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry::kernels::testing {

#define FERRY_SKIP_WITHOUT_GPU()                                                  \
  do {                                                                            \
    if (!::ferry::cuda_device_available()) GTEST_SKIP() << "no CUDA device here"; \
  } while (0)

struct DeviceTensor {
  Buffer buffer;
  TensorView view;
};

// A device copy of `bytes` viewed as dtype[shape], starting `offset_bytes` into its buffer (to
// test unaligned views).
inline DeviceTensor to_device(const std::vector<uint8_t>& bytes, DType dtype, const Shape& shape,
                              size_t offset_bytes = 0) {
  DeviceTensor t;
#if defined(FERRY_HAVE_CUDA)
  auto alloc = cuda_allocator(0);
  EXPECT_TRUE(alloc.ok()) << alloc.status().to_string();
  auto buf = Buffer::allocate(bytes.size() + offset_bytes + 16, **alloc);
  EXPECT_TRUE(buf.ok()) << buf.status().to_string();
  t.buffer = std::move(*buf);
  char* base = t.buffer.data_as<char>() + offset_bytes;
  EXPECT_EQ(cudaMemset(t.buffer.data(), 0xA5, t.buffer.size()), cudaSuccess);
  if (!bytes.empty()) {
    EXPECT_EQ(cudaMemcpy(base, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  t.view = TensorView(base, dtype, shape, Device::cuda(0));
#else
  (void)bytes, (void)dtype, (void)shape, (void)offset_bytes;
#endif
  return t;
}

// A device output of dtype[shape] that starts as garbage, never zeros: a kernel that leaves an
// element unwritten (a zero it skips, say) must show up. The bytes are 0x5A, not the 0xA5 of the
// host outputs (empty_like), so an element that both the CPU and the CUDA kernel leave alone
// differs too.
inline DeviceTensor device_output(DType dtype, const Shape& shape, size_t offset_bytes = 0) {
  return to_device(std::vector<uint8_t>(dtype_bytes(dtype, shape_numel(shape)), 0x5A), dtype, shape, offset_bytes);
}

inline std::vector<uint8_t> to_host(const TensorView& v) {
  std::vector<uint8_t> out(v.nbytes());
#if defined(FERRY_HAVE_CUDA)
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (!out.empty()) {
    EXPECT_EQ(cudaMemcpy(out.data(), v.data(), out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
#endif
  return out;
}

// quantize() of host `in` into fresh storage of `layout` (an engine layout's, with `shards`), on the
// CPU or, with `cuda`, on a CUDA device; the outputs' bytes. Failures are test failures.
inline std::vector<std::vector<uint8_t>> quantize_bytes(Scheme scheme, EngineLayout engine, HostTensor& in,
                                                        std::span<const int64_t> shards,
                                                        const std::vector<StorageTensor>& layout, bool cuda) {
  if (!cuda) {
    Outputs o = make_outputs(layout);
    const Status st = quantize(scheme, engine, in.view(), shards, o.views);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return o.bytes();
  }
  DeviceTensor din = to_device(in.bytes, in.dtype, in.shape);
  std::vector<DeviceTensor> outs;
  std::vector<TensorView> views;
  for (const auto& t : layout) outs.push_back(device_output(t.dtype, t.shape));
  for (auto& t : outs) views.push_back(t.view);
  const Status st = quantize(scheme, engine, din.view, shards, views);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<std::vector<uint8_t>> got;
  for (auto& t : outs) got.push_back(to_host(t.view));
  return got;
}

}  // namespace ferry::kernels::testing
