// The instrument is proven: a kernel that reallocates its workspace on every processing call (the
// bug class of the post-mortem: an unregistered rebinding) is caught by the census and by the
// audit of a program captured before the update, while the correct kernel passes both.
#include <fmt/format.h>

#include "examples/tiny_decoder/decoder.h"
#include "reload/checkpoint_loader.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

// Processes like gptq_int4, then swaps the live workspace for a fresh zeroed buffer, the way a
// post-load step that assigns `self.workspace = new_workspace()` would.
class ReallocatingKernel final : public ProcessingKernel {
 public:
  ReallocatingKernel(std::unique_ptr<ProcessingKernel> inner, ModelStorage* storage, std::string workspace)
      : inner_(std::move(inner)), storage_(storage), workspace_(std::move(workspace)) {}
  std::string name() const override { return "reallocating " + inner_->name(); }
  std::vector<kernels::StorageTensor> inputs() const override { return inner_->inputs(); }
  Status process(std::span<const TensorView> in, std::span<const TensorView> out, ScratchArena& scratch,
                 const kernels::Exec& exec) override {
    FERRY_RETURN_IF_ERROR(inner_->process(in, out, scratch, exec));
    FERRY_ASSIGN_OR_RETURN(TensorView live, storage_->get(workspace_));
    FERRY_ASSIGN_OR_RETURN(Buffer fresh, Buffer::allocate(live.nbytes()));
    FERRY_RETURN_IF_ERROR(fresh.zero());
    return storage_->replace(workspace_, std::move(fresh));
  }

 private:
  std::unique_ptr<ProcessingKernel> inner_;
  ModelStorage* storage_;
  std::string workspace_;
};

struct Harness {
  tiny::Config cfg;
  sharding::RankSpec spec;
  std::unique_ptr<ModelStorage> storage;
  std::unique_ptr<ReloadEngine> engine;
};

Harness make(bool broken) {
  Harness s;
  s.spec = *tiny::rank_spec(s.cfg, Scheme::kGptqInt4);
  auto storage_r = ModelStorage::allocate(s.spec, Device::cpu());
  s.storage = std::make_unique<ModelStorage>(std::move(*storage_r));
  EngineOptions o;
  ModelStorage* storage = s.storage.get();
  o.kernel_factory = [broken, storage](const sharding::ParamSpec& p) -> Result<std::unique_ptr<ProcessingKernel>> {
    FERRY_ASSIGN_OR_RETURN(auto k, scheme_kernel(p));
    if (!broken || p.scheme != Scheme::kGptqInt4) return k;
    return std::unique_ptr<ProcessingKernel>(
        new ReallocatingKernel(std::move(k), storage, storage_name(p.name, "workspace")));
  };
  auto e = ReloadEngine::create(s.spec, *s.storage, std::move(o));
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  s.engine = std::move(*e);
  return s;
}

size_t gptq_params(const sharding::RankSpec& spec) {
  size_t n = 0;
  for (const auto& p : spec.params) n += p.scheme == Scheme::kGptqInt4;
  return n;
}

TEST(Instrument, ReallocatingWorkspaceIsCaughtByCensusAndAudit) {
  Harness s = make(/*broken=*/true);
  auto decoder = tiny::Decoder::create(s.cfg, s.spec, s.engine->registry());
  ASSERT_TRUE(decoder.ok()) << decoder.status().to_string();
  // Captured against live storage: clean before any update.
  EXPECT_TRUE(audit((*decoder)->program(), s.engine->registry(), s.storage->tensors()).clean());
  auto w = tiny::Weights::random(s.cfg, s.spec, 5);
  ASSERT_TRUE(w.ok());
  auto r = load_checkpoint(*s.engine, w->checkpoint(), 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status().to_string();
  EXPECT_NE(r.status().to_string().find("moved"), std::string::npos) << r.status().to_string();

  const size_t n = gptq_params(s.spec);
  ASSERT_GT(n, 0u);
  const Census c = s.engine->census();
  EXPECT_EQ(c.moved, n);
  for (const auto& name : c.moved_names) EXPECT_NE(name.find(".workspace"), std::string::npos) << name;

  // The program still bakes the freed workspaces: exactly those pointers are stale. (It must not
  // be replayed: that memory is gone.)
  const AuditReport a = audit((*decoder)->program(), s.engine->registry(), s.storage->tensors());
  EXPECT_EQ(a.stale.size(), n) << a.to_string();
  for (const auto& st : a.stale) EXPECT_NE(st.find(".workspace"), std::string::npos) << st;
  EXPECT_FALSE(audit_status((*decoder)->program(), s.engine->registry(), s.storage->tensors()).ok());
}

TEST(Instrument, CorrectKernelPassesCensusAndAuditOverUpdates) {
  Harness s = make(/*broken=*/false);
  auto decoder = tiny::Decoder::create(s.cfg, s.spec, s.engine->registry());
  ASSERT_TRUE(decoder.ok());
  for (uint64_t v = 1; v <= 3; ++v) {
    auto w = tiny::Weights::random(s.cfg, s.spec, v);
    ASSERT_TRUE(w.ok());
    auto r = load_checkpoint(*s.engine, w->checkpoint(), v);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->census.moved, 0u);
    const AuditReport a = audit((*decoder)->program(), s.engine->registry(), s.storage->tensors());
    EXPECT_TRUE(a.clean()) << a.to_string();
    EXPECT_EQ(a.registered + a.owned, a.pointers);
    EXPECT_GT(a.registered, 0u);
    ASSERT_TRUE((*decoder)->generate({3, 4, 5}, 4).ok());
  }
}

// A live table entry swapped for memory the registry never saw shows up in the census by name.
TEST(Instrument, CensusNamesAReplacedParameter) {
  Harness s = make(false);
  const std::string name = "model.layers.1.mlp.down_proj.qweight";
  auto live = s.storage->get(name);
  ASSERT_TRUE(live.ok());
  auto fresh = Buffer::allocate(live->nbytes());
  ASSERT_TRUE(fresh.ok());
  ASSERT_OK(s.storage->replace(name, std::move(*fresh)));
  const Census c = s.engine->census();
  EXPECT_EQ(c.moved, 1u);
  ASSERT_EQ(c.moved_names.size(), 1u);
  EXPECT_EQ(c.moved_names[0], name);
  EXPECT_EQ(c.to_string(), fmt::format("moved=1/{}", s.engine->registry().size()));
}

}  // namespace
}  // namespace ferry::reload
