// On a CUDA device: the engine processes into device storage bit-identically to the CPU, and a
// real CUDA graph captured over registered device storage reads the live values after an update
// (audit clean, census 0/N); the tiny decoder's decode step as a CUDA graph. Skips without a device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include <fmt/format.h>

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
  auto spec = *tiny::rank_spec(cfg, Scheme::kGptqInt4);
  auto dev_storage = ModelStorage::allocate(spec, Device::cuda(0));
  ASSERT_TRUE(dev_storage.ok()) << dev_storage.status().to_string();
  auto dev = ReloadEngine::create(spec, *dev_storage);
  ASSERT_TRUE(dev.ok());
  auto cpu = testing::make_rank(cfg, Scheme::kGptqInt4);
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

DeviceRank device_rank(const tiny::Config& cfg, Scheme scheme, EngineLayout layout = EngineLayout::kFerry) {
  DeviceRank r;
  r.spec = *tiny::rank_spec(cfg, scheme);
  r.spec.layout = layout;
  auto s = ModelStorage::allocate(r.spec, Device::cuda(0));
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  r.storage = std::make_unique<ModelStorage>(std::move(*s));
  auto e = ReloadEngine::create(r.spec, *r.storage);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  r.engine = std::move(*e);
  return r;
}

// A colocated trainer's pieces lent in device memory: the kernels read them in place, straight
// into device storage, bit-identical to the CPU engine given the same checkpoint as host pieces;
// twice, with storage identity kept; in every scheme of ferry's layout and in the engine layouts
// (kernels/quantize.h). Pieces that no kernel takes alone (rows cut from a per-tensor shard, parts
// of the one per-tensor scale of a whole fused parameter, fp8_block shards not 128-row aligned) are
// staged on the device, never through the host, and still land exactly.
TEST(Gpu, LentDevicePiecesAreReadInPlace) {
  SKIP_WITHOUT_GPU();
  const tiny::Config cfg;
  std::vector<std::pair<EngineLayout, Scheme>> cases;
  for (const Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kFp8PerTensor, Scheme::kFp8Block, Scheme::kInt8PerChannel,
                              Scheme::kInt4Group, Scheme::kGptqInt4, Scheme::kNone}) {
    cases.emplace_back(EngineLayout::kFerry, scheme);
  }
  cases.insert(cases.end(), {{EngineLayout::kVllm, Scheme::kFp8PerTensor},
                             {EngineLayout::kVllm, Scheme::kFp8PerChannel},
                             {EngineLayout::kVllm, Scheme::kFp8Block},
                             {EngineLayout::kSglang, Scheme::kFp8PerChannel},
                             {EngineLayout::kSglang, Scheme::kInt8PerChannel}});
  for (const auto& [layout, scheme] : cases) {
    const std::string what = fmt::format("{} {}", engine_layout_name(layout), scheme_name(scheme));
    for (const int64_t chunk : {int64_t{0}, int64_t{24}}) {
      auto dev = device_rank(cfg, scheme, layout);
      auto cpu = testing::make_rank(cfg, scheme, {}, layout);
      LoadOptions lend;
      lend.lend_from = Device::cuda(0);
      lend.chunk_rows = chunk;
      for (uint64_t v = 1; v <= 2; ++v) {
        auto w = tiny::Weights::random(cfg, dev.spec, 10 + v);
        auto r = load_checkpoint(*dev.engine, w->checkpoint(), v, lend);
        ASSERT_TRUE(r.ok()) << what << ": " << r.status().to_string();
        EXPECT_EQ(r->census.moved, 0u) << what;
        if (layout == EngineLayout::kFerry) {
          EXPECT_GT(r->direct_pieces, 0u) << what << " chunk " << chunk;
        }
        EXPECT_EQ(r->device_staged_pieces, 0u) << what << " chunk " << chunk << ": staged through the host";
        if (layout == EngineLayout::kVllm && scheme == Scheme::kFp8PerTensor) {  // one scale over q, k and v
          EXPECT_GT(r->staged_on_device_pieces, 0u) << what << " chunk " << chunk;
        }
        ASSERT_TRUE(load_checkpoint(*cpu->engine, w->checkpoint(), v).ok());
        for (const auto& [n, t] : dev.storage->tensors()) {
          EXPECT_EQ(to_host(t), testing::bytes_of(cpu->storage.tensors().at(n))) << what << " " << n << " v" << v;
        }
      }
    }
  }
}

// A device piece must be lent, on the storage's device: anything else is refused by name.
TEST(Gpu, DevicePiecesMustBeLentOnTheStorageDevice) {
  SKIP_WITHOUT_GPU();
  const tiny::Config cfg;
  auto cpu = testing::make_rank(cfg, Scheme::kFp8PerChannel);
  ASSERT_OK(cpu->engine->begin(1));
  const auto& p = cpu->spec.params[0];
  auto buf = Buffer::allocate(64, Device::cuda(0));
  ASSERT_TRUE(buf.ok());
  const Region dst{Shape(p.shape.size(), 0), Shape(p.shape.size(), 1)};
  Status st = cpu->engine->lend_piece(0, 0, dst, p.source_dtype, nullptr, buf->data(), 2, Device::cuda(0));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.message();
  cpu->engine->abort();
}

// The tiny decoder's decode step as a real CUDA graph over device storage: it agrees with the CPU
// decoder, and after an update in place it reads the new weights, bit-identical to a graph over a
// cold load of them (audit clean, census 0/N).
TEST(Gpu, DecoderStepIsACudaGraphThatFollowsUpdates) {
  SKIP_WITHOUT_GPU();
  const tiny::Config cfg;
  const std::vector<int32_t> prompt{1, 17, 42, 7};
  for (const Scheme scheme : {Scheme::kGptqInt4, Scheme::kFp8PerTensor, Scheme::kNone}) {
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
    EXPECT_EQ(*ta, *tc) << scheme_name(scheme);
    for (size_t i = 0; i < (*host)->last_logits().size(); ++i) {
      const float g = (*graph)->last_logits()[i], c = (*host)->last_logits()[i];
      ASSERT_LE(std::fabs(g - c), 1e-2f + 1e-2f * std::fabs(c)) << scheme_name(scheme) << " logit " << i;
    }
    EXPECT_TRUE(audit((*graph)->program(), dev.engine->registry(), dev.storage->tensors()).clean()) << scheme_name(scheme);

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
    EXPECT_EQ(*updated, *fresh) << scheme_name(scheme) << ": the graph does not read the updated storage";
    EXPECT_TRUE(audit((*graph)->program(), dev.engine->registry(), dev.storage->tensors()).clean()) << scheme_name(scheme);
  }
}

// The streams complete layers are processed on keep the engine's ordering with the legacy default
// stream: fork() makes them wait for work queued there before, join() makes work queued there
// afterwards wait for theirs. Each side is held back 100 ms by a host function on its stream, so
// without the ordering the other side reads the old bytes.
void CUDART_CB hold_back(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }

// `bytes` of cuda:0 memory, every byte `value`.
Result<Buffer> device_bytes(size_t bytes, int value) {
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(bytes, Device::cuda(0)));
  if (cudaMemset(b.data(), value, bytes) != cudaSuccess) return Status::internal("cudaMemset failed");
  return b;
}

TEST(Gpu, ProcessStreamsForkAfterAndJoinBeforeTheLegacyStream) {
  SKIP_WITHOUT_GPU();
  auto streams = ProcessStreams::create(0, 3);
  ASSERT_TRUE(streams.ok()) << streams.status().to_string();
  constexpr size_t kBytes = 1 << 20;
  auto a_buf = device_bytes(kBytes, 0), b_buf = device_bytes(kBytes, 0);
  ASSERT_TRUE(a_buf.ok() && b_buf.ok());
  void* a = a_buf->data();
  void* b = b_buf->data();
  // Fork: legacy work (late) writes a; a process stream copies a to b after the fork.
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold_back, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(a, 0x5A, kBytes, cudaStreamLegacy), cudaSuccess);
  ASSERT_TRUE((*streams)->fork().ok());
  auto s1 = static_cast<cudaStream_t>((*streams)->stream(1));
  ASSERT_EQ(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, s1), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s1), cudaSuccess);
  std::vector<uint8_t> host(kBytes);
  ASSERT_EQ(cudaMemcpy(host.data(), b, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::count(host.begin(), host.end(), 0x5A), static_cast<long>(kBytes)) << "the fork did not wait";
  // Join: a process stream (late) writes a; legacy work queued after the join reads it.
  auto s2 = static_cast<cudaStream_t>((*streams)->stream(2));
  ASSERT_EQ(cudaLaunchHostFunc(s2, hold_back, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(a, 0x3C, kBytes, s2), cudaSuccess);
  ASSERT_TRUE((*streams)->join(2).ok());
  ASSERT_EQ(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, cudaStreamLegacy), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(host.data(), b, kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::count(host.begin(), host.end(), 0x3C), static_cast<long>(kBytes)) << "the join did not order";
}

// copy_bytes into device memory is complete when it returns, not only ordered before later work on
// the legacy stream: a stream of its own (the engine's) reads the bytes at once. The legacy stream
// is held back 100 ms first, so a copy left queued there would be read before it ran.
TEST(Gpu, CopyBytesIntoDeviceMemoryIsCompleteOnReturn) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = 1 << 20;
  auto src = device_bytes(kBytes, 0x77), dst = device_bytes(kBytes, 0);
  ASSERT_TRUE(src.ok() && dst.ok());
  cudaStream_t own = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold_back, nullptr), cudaSuccess);
  ASSERT_TRUE(copy_bytes(dst->data(), Device::cuda(0), src->data(), Device::cuda(0), kBytes).ok());
  std::vector<uint8_t> host(kBytes);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), dst->data(), kBytes, cudaMemcpyDeviceToHost, own), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(own), cudaSuccess);
  EXPECT_EQ(std::count(host.begin(), host.end(), 0x77), static_cast<long>(kBytes));
  cudaStreamDestroy(own);
}

}  // namespace
}  // namespace ferry::reload
