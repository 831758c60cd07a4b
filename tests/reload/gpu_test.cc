// On a CUDA device: the engine processes into device storage bit-identically to the CPU, and a
// real CUDA graph captured over registered device storage reads the live values after an update
// (audit clean, census 0/N). Skips without a device.
#include <cuda_runtime_api.h>

#include "reload/captured_program.h"
#include "reload/checkpoint_loader.h"
#include "reload/processing.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device here"

std::vector<uint8_t> to_host(const TensorView& v) {
  std::vector<uint8_t> out(v.nbytes());
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu(), v.data(), v.device(), out.size()).ok());
  return out;
}

TEST(Gpu, DeviceStorageMatchesCpuAndGraphReadsLiveStorage) {
  SKIP_WITHOUT_GPU();
  const tiny::Config cfg;
  auto spec = *tiny::rank_spec(cfg, "gptq_int4");
  auto dev_storage = ModelStorage::allocate(spec, Device::cuda(0));
  ASSERT_TRUE(dev_storage.ok()) << dev_storage.status().to_string();
  auto dev = ReloadEngine::create(spec, *dev_storage);
  ASSERT_TRUE(dev.ok());
  auto cpu = testing::make_rank(cfg, "gptq_int4");
  auto a = tiny::Weights::random(cfg, spec, 1);
  auto b = tiny::Weights::random(cfg, spec, 2);
  ASSERT_TRUE(load_checkpoint(**dev, a->checkpoint(), 1).ok());

  // A graph that copies a registered weight into program memory.
  const std::string name = "model.layers.0.self_attn.qkv_proj.perm";
  auto reg = (*dev)->registry().find(name);
  ASSERT_TRUE(reg.ok());
  const TensorView src = (*reg)->view;
  auto prog = CapturedProgram::create(Device::cuda(0));
  ASSERT_TRUE(prog.ok());
  auto dst = (*prog)->own(src.dtype(), src.shape());
  ASSERT_TRUE(dst.ok());
  const TensorView out = *dst;
  ASSERT_OK((*prog)->begin_capture());
  ASSERT_OK((*prog)->record("copy", {baked(src, name), baked(out, "out")}, [=](const kernels::Exec& e) -> Status {
    if (cudaMemcpyAsync(out.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice,
                        static_cast<cudaStream_t>(e.stream)) != cudaSuccess) {
      return Status::internal("cudaMemcpyAsync");
    }
    return ok_status();
  }));
  ASSERT_OK((*prog)->end_capture());
  EXPECT_TRUE((*prog)->is_cuda_graph());

  auto r = load_checkpoint(**dev, b->checkpoint(), 2);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->census.moved, 0u);
  ASSERT_TRUE(load_checkpoint(*cpu->engine, b->checkpoint(), 1).ok());
  for (const auto& [n, v] : dev_storage->tensors()) EXPECT_EQ(to_host(v), testing::bytes_of(cpu->storage.tensors().at(n))) << n;

  ASSERT_OK((*prog)->replay());
  EXPECT_EQ(to_host(out), testing::bytes_of(cpu->storage.tensors().at(name)));
  EXPECT_TRUE(audit(**prog, (*dev)->registry(), dev_storage->tensors()).clean());
}

}  // namespace
}  // namespace ferry::reload
