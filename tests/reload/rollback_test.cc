// Rollback (FERRY_ROLLBACK=host): a failed update is undone in place from host snapshots, every
// registered byte (runtime tensors included) back to the last complete version, identities
// unchanged; a complete update drops the snapshots. Also the lent-piece path, which processes
// straight into storage at completion and so leaves incomplete layers untouched.
#include <cstring>
#include <memory>
#include <set>

#include <fmt/format.h>

#include "core/region_copy.h"
#include "reload/checkpoint_loader.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::contents;
using testing::identities;
using testing::make_rank;

struct Piece {
  uint32_t param = 0;
  uint32_t input = 0;
  TensorView src;
  Region src_region;
  Region dst;
};

// Every piece of `layer`, slice by slice (whole checkpoint tensors for quantized reload).
std::vector<Piece> pieces_of(const ReloadEngine& e, const Checkpoint& ck, const std::string& layer) {
  std::vector<Piece> out;
  for (uint32_t i = 0; i < e.spec().params.size(); ++i) {
    const auto& p = e.spec().params[i];
    if (p.layer != layer) continue;
    const auto inputs = e.input_layout(i);
    if (inputs.size() == 1) {
      for (const auto& s : p.slices) out.push_back({i, 0, ck.at(s.source), s.src, sharding::slice_dst_region(s, p)});
    } else {
      for (uint32_t k = 0; k < inputs.size(); ++k) {
        const Region whole = Region::whole(inputs[k].shape);
        out.push_back({i, k, ck.at(storage_name(p.name, inputs[k].suffix)), whole, whole});
      }
    }
  }
  return out;
}

// Feeds `pieces`; lent pieces are packed into buffers the engine keeps alive through `owner`.
Status feed(ReloadEngine& e, const std::vector<Piece>& pieces, bool lend) {
  for (const Piece& p : pieces) {
    auto buf = std::make_shared<std::vector<uint8_t>>(dtype_bytes(p.src.dtype(), p.src_region.numel()));
    FERRY_RETURN_IF_ERROR(pack_region(p.src, p.src_region, buf->data(), buf->size()));
    FERRY_RETURN_IF_ERROR(lend ? e.lend_piece(p.param, p.input, p.dst, p.src.dtype(), buf, buf->data(), buf->size())
                               : e.apply_input_piece(p.param, p.input, p.dst, p.src.dtype(), buf->data(), buf->size()));
  }
  return ok_status();
}

// Begins `version`, feeds the layers `complete` whole and layer `partial` without its last piece;
// finalize() then fails. Returns the names of the layers left complete.
std::set<std::string> partial_update(ReloadEngine& e, const Checkpoint& ck, uint64_t version,
                                     const std::vector<size_t>& complete, size_t partial, bool lend) {
  std::set<std::string> done;
  EXPECT_TRUE(e.begin(version).ok());
  const auto layers = e.registry().layers();
  for (size_t l : complete) {
    EXPECT_TRUE(feed(e, pieces_of(e, ck, layers.at(l)), lend).ok()) << layers.at(l);
    done.insert(layers.at(l));
  }
  auto pieces = pieces_of(e, ck, layers.at(partial));
  EXPECT_GT(pieces.size(), 1u) << layers.at(partial);
  pieces.pop_back();
  EXPECT_TRUE(feed(e, pieces, lend).ok());
  auto r = e.finalize();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().to_string();
  return done;
}

// Layers 0 (embedding) and 1 (decoder layer 0) complete; layer 2 (decoder layer 1) one piece short.
std::set<std::string> first_layers_only(ReloadEngine& e, const Checkpoint& ck, uint64_t version, bool lend) {
  return partial_update(e, ck, version, {0, 1}, 2, lend);
}

std::map<std::string, std::vector<uint8_t>> layer_bytes(const ReloadEngine& e, const ModelStorage& s,
                                                        const std::string& layer) {
  std::map<std::string, std::vector<uint8_t>> out;
  const auto all = contents(s);
  for (size_t i : e.registry().layer_tensors(layer)) out[e.registry().tensors()[i].name] = all.at(e.registry().tensors()[i].name);
  return out;
}

EngineOptions with_rollback(RollbackMode m) {
  EngineOptions o;
  o.rollback = m;
  return o;
}

class RollbackTest : public ::testing::TestWithParam<Scheme> {};

TEST_P(RollbackTest, FailedPartialUpdateIsRestoredToTheLastCompleteVersion) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, GetParam(), with_rollback(RollbackMode::kHost));
  auto cold_b = make_rank(cfg, GetParam());
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  ASSERT_OK(load_checkpoint(*cold_b->engine, b->checkpoint(), 2).status());
  EXPECT_EQ(rank->engine->snapshot_bytes(), 0u) << "a complete update drops its snapshots";
  const auto state_a = contents(rank->storage);
  const auto ids = identities(rank->storage);
  ASSERT_NE(state_a, contents(cold_b->storage));

  const auto done = first_layers_only(*rank->engine, b->checkpoint(), 2, /*lend=*/false);
  // Before the rollback the complete layers hold B: the update really wrote storage.
  for (const auto& l : done) EXPECT_EQ(layer_bytes(*rank->engine, rank->storage, l), layer_bytes(*cold_b->engine, cold_b->storage, l)) << l;
  // A snapshot of every layer storage was written for: the complete ones, and the incomplete one
  // where rows went into storage on arrival.
  EXPECT_GE(rank->engine->snapshot_layers(), done.size());
  EXPECT_LE(rank->engine->snapshot_layers(), done.size() + 1);
  EXPECT_GT(rank->engine->snapshot_bytes(), 0u);

  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(contents(rank->storage), state_a) << "every registered byte is back to A";
  EXPECT_EQ(identities(rank->storage), ids) << "restored in place";
  const Census c = rank->engine->census();
  EXPECT_EQ(c.moved, 0u);
  EXPECT_EQ(c.registered, rank->engine->registry().size());
  EXPECT_FALSE(rank->engine->in_update());
  EXPECT_EQ(rank->engine->version(), 1u);
  EXPECT_EQ(rank->engine->snapshot_bytes(), 0u);
  // The engine serves the next update normally.
  ASSERT_OK(load_checkpoint(*rank->engine, b->checkpoint(), 3).status());
  EXPECT_EQ(contents(rank->storage), contents(cold_b->storage));
}

TEST_P(RollbackTest, WithoutRollbackTheCompleteLayersHoldTheNewWeights) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, GetParam(), with_rollback(RollbackMode::kOff));
  auto cold_b = make_rank(cfg, GetParam());
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  ASSERT_OK(load_checkpoint(*cold_b->engine, b->checkpoint(), 2).status());
  const auto done = first_layers_only(*rank->engine, b->checkpoint(), 2, false);
  const Status st = rank->engine->rollback();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_EQ(rank->engine->snapshot_bytes(), 0u);
  // The incomplete layer may hold rows that arrived (processed on arrival, straight into storage):
  // the rank stays inconsistent until a complete update lands.
  for (const auto& l : done) {
    EXPECT_EQ(layer_bytes(*rank->engine, rank->storage, l), layer_bytes(*cold_b->engine, cold_b->storage, l)) << l;
  }
  ASSERT_OK(load_checkpoint(*rank->engine, b->checkpoint(), 3).status());
  EXPECT_EQ(contents(rank->storage), contents(cold_b->storage));
}

TEST_P(RollbackTest, SnapshotsSpanFailedUpdatesUntilACompleteOne) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, GetParam(), with_rollback(RollbackMode::kHost));
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  auto c = tiny::Weights::random(cfg, rank->spec, 3);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  const auto state_a = contents(rank->storage);
  const size_t n = rank->engine->registry().layers().size();
  ASSERT_GE(n, 4u);
  // B fails having written the first layers; C fails having written an overlapping one and the
  // last ones (lent pieces, processed straight into storage).
  first_layers_only(*rank->engine, b->checkpoint(), 2, false);
  std::vector<size_t> later{1};
  for (size_t l = 3; l < n; ++l) later.push_back(l);
  partial_update(*rank->engine, c->checkpoint(), 3, later, 2, true);
  ASSERT_NE(contents(rank->storage), state_a);
  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(contents(rank->storage), state_a);
  EXPECT_EQ(rank->engine->version(), 1u);
  // After a complete update there is nothing to go back to: rollback keeps the new version.
  ASSERT_OK(load_checkpoint(*rank->engine, b->checkpoint(), 4).status());
  const auto state_b = contents(rank->storage);
  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(contents(rank->storage), state_b);
  EXPECT_EQ(rank->engine->version(), 4u);
}

INSTANTIATE_TEST_SUITE_P(EveryScheme, RollbackTest, ::testing::ValuesIn(kAllSchemes),
                         [](const auto& info) { return std::string(scheme_name(info.param)); });

enum class Inject { kScribbleAndFail, kFailOnce };

// The scheme's kernels, except that model.layers.1.mlp.down_proj.weight fails while `*fail` is set
// (whole parameters only: no piece-by-piece processing). kScribbleAndFail first writes garbage over
// its storage; kFailOnce clears `*fail`, so the next attempt processes normally.
KernelFactory failing_down_proj(bool* fail, Inject how) {
  return [fail, how](const sharding::ParamSpec& p) -> Result<std::unique_ptr<ProcessingKernel>> {
    FERRY_ASSIGN_OR_RETURN(auto k, scheme_kernel(p));
    if (p.name != "model.layers.1.mlp.down_proj.weight") return k;
    struct Failing final : ProcessingKernel {
      Failing(std::unique_ptr<ProcessingKernel> k, bool* f, Inject h) : ok(std::move(k)), fail(f), how(h) {}
      std::string name() const override { return ok->name(); }
      std::vector<kernels::StorageTensor> inputs() const override { return ok->inputs(); }
      Status process(std::span<const TensorView> in, std::span<const TensorView> out, ScratchArena& s,
                     const kernels::Exec& e) override {
        if (!*fail) return ok->process(in, out, s, e);
        if (how == Inject::kScribbleAndFail) {
          for (const TensorView& t : out) std::memset(t.data(), 0x5a, t.nbytes());
        } else {
          *fail = false;
        }
        return Status::internal("injected processing failure");
      }
      std::unique_ptr<ProcessingKernel> ok;
      bool* fail;
      Inject how;
    };
    return std::unique_ptr<ProcessingKernel>(new Failing(std::move(k), fail, how));
  };
}

TEST(Rollback, LayerHalfWrittenByAFailingKernelIsRestored) {
  const tiny::Config cfg;
  bool fail = false;
  EngineOptions o = with_rollback(RollbackMode::kHost);
  // The layer's last parameter, once `fail` is set, writes garbage over its storage and fails
  // after the earlier parameters of the layer were written.
  o.kernel_factory = failing_down_proj(&fail, Inject::kScribbleAndFail);
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor, std::move(o));
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  const auto state_a = contents(rank->storage);
  fail = true;
  auto r = load_checkpoint(*rank->engine, b->checkpoint(), 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().to_string().find("injected"), std::string::npos) << r.status().to_string();
  ASSERT_NE(contents(rank->storage), state_a);
  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(contents(rank->storage), state_a);
  EXPECT_EQ(rank->engine->census().moved, 0u);
}

// A layer whose processing fails is refused and keeps none of its pieces: its borrowed bytes are
// not read again after release_borrowed() (finalize() used to process the complete layer again,
// from the released bucket, and report success).
TEST(Borrowed, ALayerThatFailsIsRefusedAndItsBorrowedBytesAreNotReadAgain) {
  const tiny::Config cfg;
  bool fail = false;
  EngineOptions o;
  o.kernel_factory = failing_down_proj(&fail, Inject::kFailOnce);
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor, std::move(o));
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  const auto layer1 = layer_bytes(*rank->engine, rank->storage, "model.layers.1");

  // Every piece of update 2 borrowed from one bucket.
  std::vector<Piece> pieces;
  for (const auto& l : rank->engine->registry().layers()) {
    for (auto& p : pieces_of(*rank->engine, b->checkpoint(), l)) pieces.push_back(p);
  }
  size_t total = 0;
  for (const Piece& p : pieces) total += dtype_bytes(p.src.dtype(), p.src_region.numel());
  std::vector<uint8_t> bucket(total);
  fail = true;
  ASSERT_OK(rank->engine->begin(2));
  Status first;
  size_t at = 0;
  for (const Piece& p : pieces) {
    const size_t n = dtype_bytes(p.src.dtype(), p.src_region.numel());
    ASSERT_OK(pack_region(p.src, p.src_region, bucket.data() + at, n));
    Status st = rank->engine->borrow_piece(p.param, p.input, p.dst, p.src.dtype(), bucket.data() + at, n);
    if (first.ok()) first = st;
    at += n;
  }
  EXPECT_NE(first.to_string().find("injected"), std::string::npos) << first.to_string();
  EXPECT_FALSE(fail) << "the failure was injected";
  (void)rank->engine->release_borrowed();
  std::memset(bucket.data(), 0xff, bucket.size());  // the transport reuses its buffer
  auto r = rank->engine->finalize();
  ASSERT_FALSE(r.ok()) << "a refused layer fails the update";
  EXPECT_NE(r.status().to_string().find("model.layers.1"), std::string::npos) << r.status().to_string();
  // The parameters before the failing one were written (rollback restores those); the failing one
  // wrote nothing, and nothing wrote it afterwards.
  const std::string down = "model.layers.1.mlp.down_proj.weight";
  EXPECT_EQ(layer_bytes(*rank->engine, rank->storage, "model.layers.1").at(down), layer1.at(down));
}

TEST(LentPieces, SameStorageAsCopiedPiecesAndOwnersAreReleased) {
  const tiny::Config cfg;
  for (const Scheme scheme : kAllSchemes) {
    auto lent = make_rank(cfg, scheme);
    auto copied = make_rank(cfg, scheme);
    auto a = tiny::Weights::random(cfg, lent->spec, 1);
    ASSERT_OK(load_checkpoint(*copied->engine, a->checkpoint(), 1).status());
    ASSERT_OK(lent->engine->begin(1));
    std::vector<std::weak_ptr<const void>> owners;
    for (const auto& l : lent->engine->registry().layers()) {
      for (const Piece& p : pieces_of(*lent->engine, a->checkpoint(), l)) {
        auto buf = std::make_shared<std::vector<uint8_t>>(dtype_bytes(p.src.dtype(), p.src_region.numel()));
        ASSERT_OK(pack_region(p.src, p.src_region, buf->data(), buf->size()));
        owners.push_back(buf);
        ASSERT_OK(lent->engine->lend_piece(p.param, p.input, p.dst, p.src.dtype(), buf, buf->data(), buf->size()));
      }
    }
    auto r = lent->engine->finalize();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->census.moved, 0u);
    if (scheme == Scheme::kNone || scheme == Scheme::kFp8PerChannel || scheme == Scheme::kInt8PerChannel) {
      EXPECT_GT(r->direct_pieces, 0u) << scheme_name(scheme);
    }
    EXPECT_EQ(contents(lent->storage), contents(copied->storage)) << scheme_name(scheme);
    for (const auto& w : owners) EXPECT_TRUE(w.expired()) << scheme_name(scheme) << ": a lent buffer outlived its layer";
  }
}

TEST(LentPieces, IncompleteLayerKeepsItsWeights) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kNone);
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  const auto state_a = contents(rank->storage);
  const auto done = first_layers_only(*rank->engine, b->checkpoint(), 2, /*lend=*/true);
  for (const auto& l : rank->engine->registry().layers()) {
    if (done.count(l)) continue;
    for (const auto& [name, bytes] : layer_bytes(*rank->engine, rank->storage, l)) {
      EXPECT_EQ(bytes, state_a.at(name)) << name;
    }
  }
  EXPECT_EQ(rank->engine->staging_bytes(), 0u);
}

TEST(Staging, PoolKeepsAtMostOneLayerBetweenUpdates) {
  const tiny::Config cfg;
  for (const Scheme scheme : {Scheme::kNone, Scheme::kFp8PerTensor, Scheme::kFp8Block, Scheme::kGptqInt4}) {
    auto rank = make_rank(cfg, scheme);
    auto a = tiny::Weights::random(cfg, rank->spec, 1);
    uint64_t largest = 0;
    for (const auto& l : rank->engine->registry().layers()) {
      uint64_t held = 0;
      for (uint32_t i = 0; i < rank->spec.params.size(); ++i) {
        if (rank->spec.params[i].layer != l) continue;
        for (const auto& in : rank->engine->input_layout(i)) held += dtype_bytes(in.dtype, shape_numel(in.shape));
      }
      for (size_t i : rank->engine->registry().layer_tensors(l)) held += rank->engine->registry().tensors()[i].view.nbytes();
      largest = std::max(largest, held);
    }
    for (uint64_t v = 1; v <= 3; ++v) {
      ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), v).status());
      EXPECT_LE(rank->engine->pooled_bytes(), largest) << scheme_name(scheme);
    }
    // Staged inputs are pooled; rows a kernel takes alone go straight into storage and hold nothing.
    if (scheme == Scheme::kFp8Block || scheme == Scheme::kGptqInt4) {
      EXPECT_GT(rank->engine->pooled_bytes(), 0u) << scheme_name(scheme);
    }
  }
}

}  // namespace
}  // namespace ferry::reload
