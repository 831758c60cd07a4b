// On a CUDA device: the engine processes into device storage bit-identically to the CPU, and a
// real CUDA graph captured over registered device storage reads the live values after an update
// (audit clean, census 0/N); the tiny decoder's decode step as a CUDA graph. Skips without a device.
#include <cuda_runtime_api.h>

#include <cmath>

#include "examples/tiny_decoder/decoder.h"
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

struct DeviceRank {
  sharding::RankSpec spec;
  std::unique_ptr<ModelStorage> storage;
  std::unique_ptr<ReloadEngine> engine;
};

DeviceRank device_rank(const tiny::Config& cfg, const std::string& scheme) {
  DeviceRank r;
  r.spec = *tiny::rank_spec(cfg, scheme);
  auto s = ModelStorage::allocate(r.spec, Device::cuda(0));
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  r.storage = std::make_unique<ModelStorage>(std::move(*s));
  auto e = ReloadEngine::create(r.spec, *r.storage);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  r.engine = std::move(*e);
  return r;
}

// The tiny decoder's decode step as a real CUDA graph over device storage: it agrees with the CPU
// decoder, and after an update in place it reads the new weights, bit-identical to a graph over a
// cold load of them (audit clean, census 0/N).
TEST(Gpu, DecoderStepIsACudaGraphThatFollowsUpdates) {
  SKIP_WITHOUT_GPU();
  const tiny::Config cfg;
  const std::vector<int32_t> prompt{1, 17, 42, 7};
  for (const std::string scheme : {"gptq_int4", "fp8_per_tensor", "none"}) {
    auto dev = device_rank(cfg, scheme);
    auto cold = device_rank(cfg, scheme);
    auto cpu = testing::make_rank(cfg, scheme);
    auto a = tiny::Weights::random(cfg, dev.spec, 1);
    auto b = tiny::Weights::random(cfg, dev.spec, 2);
    ASSERT_TRUE(load_checkpoint(*dev.engine, a->checkpoint(), 1).ok());
    ASSERT_TRUE(load_checkpoint(*cpu->engine, a->checkpoint(), 1).ok());
    auto graph = tiny::Decoder::create(cfg, dev.spec, dev.engine->registry(), Device::cuda(0));
    ASSERT_TRUE(graph.ok()) << graph.status().to_string();
    EXPECT_TRUE((*graph)->program().is_cuda_graph());
    auto host = tiny::Decoder::create(cfg, cpu->spec, cpu->engine->registry());
    ASSERT_TRUE(host.ok());
    auto ta = (*graph)->generate(prompt, 8);
    ASSERT_TRUE(ta.ok()) << ta.status().to_string();
    auto tc = (*host)->generate(prompt, 8);
    ASSERT_TRUE(tc.ok());
    // The CUDA GEMMs sum in another order: equal within rounding, not bit for bit.
    EXPECT_EQ(*ta, *tc) << scheme;
    for (size_t i = 0; i < (*host)->last_logits().size(); ++i) {
      const float g = (*graph)->last_logits()[i], c = (*host)->last_logits()[i];
      ASSERT_LE(std::fabs(g - c), 1e-2f + 1e-2f * std::fabs(c)) << scheme << " logit " << i;
    }
    EXPECT_TRUE(audit((*graph)->program(), dev.engine->registry(), dev.storage->tensors()).clean()) << scheme;

    auto r = load_checkpoint(*dev.engine, b->checkpoint(), 2);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->census.moved, 0u);
    auto updated = (*graph)->outputs(prompt, 8);
    ASSERT_TRUE(updated.ok()) << updated.status().to_string();
    ASSERT_TRUE(load_checkpoint(*cold.engine, b->checkpoint(), 1).ok());
    auto cold_graph = tiny::Decoder::create(cfg, cold.spec, cold.engine->registry(), Device::cuda(0));
    ASSERT_TRUE(cold_graph.ok());
    auto fresh = (*cold_graph)->outputs(prompt, 8);
    ASSERT_TRUE(fresh.ok());
    EXPECT_EQ(*updated, *fresh) << scheme << ": the graph does not read the updated storage";
    EXPECT_TRUE(audit((*graph)->program(), dev.engine->registry(), dev.storage->tensors()).clean()) << scheme;
  }
}

}  // namespace
}  // namespace ferry::reload
