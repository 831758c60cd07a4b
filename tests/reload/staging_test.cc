// Bounded staging: in plan order a rank holds at most one layer; out-of-order input is accounted;
// rows a kernel takes alone go straight into storage; past FERRY_MAX_STAGING_BYTES the update fails
// with ResourceExhausted and the refused layer keeps its previous weights.
#include <cstdlib>
#include <functional>

#include "core/region_copy.h"
#include "kernels/quantize.h"
#include "reload/checkpoint_loader.h"
#include "tests/common/warnings.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::make_rank;

// Full-precision bytes of the largest layer.
uint64_t largest_layer(const sharding::RankSpec& spec) {
  std::map<std::string, uint64_t> per;
  for (const auto& p : spec.params) per[p.layer] += dtype_bytes(p.source_dtype, shape_numel(p.shape));
  uint64_t m = 0;
  for (const auto& [l, b] : per) m = std::max(m, b);
  return m;
}

// `msg` names a refused layer, and none of that layer's registered tensors differs from `before`.
void expect_refused_layer_untouched(const testing::Rank& rank, const std::string& msg,
                                    const std::map<std::string, std::vector<uint8_t>>& before) {
  std::string refused;
  for (const auto& l : rank.engine->registry().layers()) {
    if (msg.find("layer " + l + " is refused") != std::string::npos) refused = l;
  }
  ASSERT_FALSE(refused.empty()) << msg;
  const auto now = testing::contents(rank.storage);
  for (size_t i : rank.engine->registry().layer_tensors(refused)) {
    const auto& name = rank.engine->registry().tensors()[i].name;
    EXPECT_EQ(now.at(name), before.at(name)) << name;
  }
}

TEST(Staging, PlanOrderHoldsAtMostOneLayer) {
  const tiny::Config cfg;
  for (const Scheme scheme : {Scheme::kFp8PerTensor, Scheme::kFp8PerChannel, Scheme::kGptqInt4}) {
    auto rank = make_rank(cfg, scheme);
    auto w = tiny::Weights::random(cfg, rank->spec, 1);
    auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    // gptq_int4's three inputs are staged; the others' rows and shards go straight into storage.
    if (scheme == Scheme::kGptqInt4) {
      EXPECT_GT(r->peak_staging_bytes, 0u);
    }
    EXPECT_LE(r->peak_staging_bytes, largest_layer(rank->spec)) << scheme_name(scheme);
    EXPECT_EQ(r->out_of_order_layers, 0u) << scheme_name(scheme);
    EXPECT_EQ(rank->engine->staging_bytes(), 0u);
  }
}

// fp8_per_tensor keeps one scale per logical shard, so a piece covering whole shards (q, k or v of a
// fused qkv; gate or up) is quantized on arrival instead of waiting in full-precision staging. The
// result equals the kernel run once over the whole fused tensor, assembled here from the checkpoint.
TEST(Staging, PerTensorShardsAreProcessedOnArrival) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor);
  auto w = tiny::Weights::random(cfg, rank->spec, 3);
  auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->piecewise_pieces + r->direct_pieces, 0u);
  int fused = 0;
  for (const auto& p : rank->spec.params) {
    if (p.scheme != Scheme::kFp8PerTensor || p.shard_rows.size() < 2) continue;
    ++fused;
    std::vector<uint8_t> whole(dtype_bytes(p.source_dtype, shape_numel(p.shape)));
    const TensorView full(whole.data(), p.source_dtype, p.shape);
    for (const auto& sl : p.slices) {
      const TensorView& src = w->checkpoint().at(sl.source);
      std::vector<uint8_t> packed(dtype_bytes(src.dtype(), sl.src.numel()));
      ASSERT_OK(pack_region(src, sl.src, packed.data(), packed.size()));
      ASSERT_OK(unpack_region(full, sharding::slice_dst_region(sl, p), packed.data(), packed.size()));
    }
    auto layout = param_layout(p, DType::kBF16);
    ASSERT_TRUE(layout.ok());
    std::vector<std::vector<uint8_t>> out;
    std::vector<TensorView> views;
    for (const auto& t : *layout) out.emplace_back(dtype_bytes(t.dtype, shape_numel(t.shape)));
    for (size_t i = 0; i < layout->size(); ++i) views.emplace_back(out[i].data(), (*layout)[i].dtype, (*layout)[i].shape);
    ASSERT_OK(kernels::quantize(Scheme::kFp8PerTensor, full, p.shard_rows, views, {}));
    for (size_t i = 0; i < layout->size(); ++i) {
      const std::string name = storage_name(p.name, (*layout)[i].suffix);
      EXPECT_EQ(testing::bytes_of(rank->storage.tensors().at(name)), out[i]) << name;
    }
  }
  EXPECT_GT(fused, 0);
}

// Pieces alternating between every layer, each a part of a shard: fp8_per_tensor must stage them in
// full precision.
LoadOptions interleaved() {
  LoadOptions o;
  o.interleave_layers = true;
  o.chunk_rows = 5;
  return o;
}

TEST(Staging, OutOfOrderInputIsAccounted) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1, interleaved());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->out_of_order_layers, 0u);
  EXPECT_GT(r->peak_staging_bytes, largest_layer(rank->spec));
  EXPECT_EQ(r->census.moved, 0u);
}

// A rank fed out of order on every update (a sharded trainer's buckets each span many layers) is
// warned once, not on every training step; every update still counts it.
TEST(Staging, OutOfOrderInputIsWarnedOnceAndCountedEveryUpdate) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  testutil::CaughtWarnings warnings;
  for (uint64_t v = 1; v <= 3; ++v) {
    auto r = load_checkpoint(*rank->engine, w->checkpoint(), v, interleaved());
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_GT(r->out_of_order_layers, 0u) << "v" << v;
  }
  EXPECT_EQ(warnings.count("out-of-order input"), 1u);
  EXPECT_EQ(warnings.count("update v1: out-of-order input"), 1u);
}

// Input that keeps several layers open at once (every trainer rank's buckets span many layers)
// holds more than the largest layer. The pool keeps what the last update held at its peak, so the
// next such update allocates (and faults in) no staging or scratch, and writes the same bytes as a
// rank loaded in plan order from fresh buffers.
TEST(Staging, TheNextOutOfOrderUpdateAllocatesNothing) {
  const tiny::Config cfg;
  for (const Scheme scheme : {Scheme::kFp8PerTensor, Scheme::kFp8Block}) {
    SCOPED_TRACE(scheme_name(scheme));
    auto rank = make_rank(cfg, scheme);
    auto a = tiny::Weights::random(cfg, rank->spec, 1);
    auto b = tiny::Weights::random(cfg, rank->spec, 2);
    auto first = load_checkpoint(*rank->engine, a->checkpoint(), 1, interleaved());
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    EXPECT_GT(first->peak_staging_bytes, largest_layer(rank->spec) / 2);
    EXPECT_GE(first->allocated_staging_bytes, first->peak_staging_bytes);
    auto second = load_checkpoint(*rank->engine, b->checkpoint(), 2, interleaved());
    ASSERT_TRUE(second.ok()) << second.status().to_string();
    EXPECT_EQ(second->allocated_staging_bytes, 0u);
    EXPECT_EQ(second->census.moved, 0u);
    EXPECT_GE(rank->engine->pooled_bytes(), second->peak_staging_bytes);
    auto fresh = make_rank(cfg, scheme);
    ASSERT_TRUE(load_checkpoint(*fresh->engine, b->checkpoint(), 2).ok());
    EXPECT_EQ(testing::contents(rank->storage), testing::contents(fresh->storage));
  }
}

// An update in plan order after out-of-order ones gives back what it no longer holds at once (six
// layers: out of order, the rank holds all of them at once).
TEST(Staging, AnUpdateInPlanOrderGivesTheOutOfOrderPeakBack) {
  tiny::Config cfg;
  cfg.layers = 6;
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  auto out_of_order = load_checkpoint(*rank->engine, w->checkpoint(), 1, interleaved());
  ASSERT_TRUE(out_of_order.ok()) << out_of_order.status().to_string();
  const uint64_t kept = rank->engine->pooled_bytes();
  EXPECT_GT(kept, 4 * largest_layer(rank->spec));
  auto in_order = load_checkpoint(*rank->engine, w->checkpoint(), 2);
  ASSERT_TRUE(in_order.ok()) << in_order.status().to_string();
  EXPECT_LT(rank->engine->pooled_bytes(), kept);
  // At most one layer's inputs and its fp8 storage (half their bytes), with a page of slack each.
  EXPECT_LE(rank->engine->pooled_bytes(), 1.5 * static_cast<double>(largest_layer(rank->spec)) + 64 * 4096);
}

// A staged update holds every layer's staging at once (it serves the old version meanwhile); that
// is not kept between updates: the pool comes back to one layer.
TEST(Staging, AStagedUpdateDoesNotKeepItsStaging) {
  tiny::Config cfg;
  cfg.layers = 6;
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  LoadOptions staged;
  staged.stage = true;
  auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1, staged);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->peak_staging_bytes, 3 * largest_layer(rank->spec));
  EXPECT_LE(rank->engine->pooled_bytes(), 1.5 * static_cast<double>(largest_layer(rank->spec)) + 64 * 4096);
}

// Loads two random versions of the tiny model under `scheme` with `o`, `check` seeing each report,
// then expects every byte of storage to equal a rank that loaded the second in plan order.
void expect_loads_equal_plan_order(Scheme scheme, const LoadOptions& o, uint64_t seed,
                                   const std::function<void(const EngineReport&)>& check) {
  SCOPED_TRACE(scheme_name(scheme));
  const tiny::Config cfg;
  auto rank = make_rank(cfg, scheme);
  // Other weights the second time: it writes every byte anew, over pooled buffers of the first.
  auto a = tiny::Weights::random(cfg, rank->spec, seed);
  auto b = tiny::Weights::random(cfg, rank->spec, seed + 1);
  uint64_t v = 0;
  for (const auto* w : {&a, &b}) {
    auto r = load_checkpoint(*rank->engine, (*w)->checkpoint(), ++v, o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    check(*r);
  }
  auto fresh = make_rank(cfg, scheme);
  ASSERT_TRUE(load_checkpoint(*fresh->engine, b->checkpoint(), 2).ok());
  EXPECT_EQ(testing::contents(rank->storage), testing::contents(fresh->storage));
}

// Borrowed buckets of pieces alternating between layers: at the end of each bucket the rows of
// layers it leaves incomplete go into storage, processed together on the work pool (row-local
// schemes and fp8_block's whole bands). Every byte equals a rank loaded in plan order.
TEST(Staging, RowsOfManyBorrowedPiecesProcessedTogetherEqualAPlanOrderLoad) {
  for (const Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kInt4Group, Scheme::kFp8Block}) {
    LoadOptions o = interleaved();
    o.chunk_rows = scheme == Scheme::kFp8Block ? 128 : 8;
    o.borrow_bucket_bytes = 256 << 10;
    expect_loads_equal_plan_order(scheme, o, 6, [](const EngineReport& r) { EXPECT_GT(r.piecewise_pieces, 0u); });
  }
}

// Rows a kernel takes on their own, out of order and borrowed (a shm ring's slot, valid during its
// callback: the rows of every layer the bucket leaves incomplete), go straight into storage: no
// scratch copy of the storage is held for them, and every byte equals a plan-order load.
TEST(Staging, BorrowedRowsOfIncompleteLayersGoStraightIntoStorage) {
  for (const Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kInt4Group}) {
    LoadOptions o = interleaved();
    o.chunk_rows = 8;
    o.borrow_bucket_bytes = 256 << 10;
    expect_loads_equal_plan_order(scheme, o, 9, [](const EngineReport& r) {
      EXPECT_GT(r.piecewise_pieces, 0u);
      EXPECT_EQ(r.peak_staging_bytes, 0u);
    });
  }
}

// An update staged while the rank serves writes nothing into storage before the apply, rows a
// kernel takes alone included (those go into a scratch copy of the storage, copied in at the apply).
TEST(Staging, AStagedUpdateWritesStorageOnlyAtTheApply) {
  // Every registered byte, read through the engine's registry.
  const auto registered = [](const ReloadEngine& e) {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& t : e.registry().tensors()) {
      const auto* at = static_cast<const uint8_t*>(t.view.data());
      out.emplace_back(at, at + t.view.nbytes());
    }
    return out;
  };
  for (const Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kInt4Group}) {
    LoadOptions o = interleaved();
    o.chunk_rows = 8;
    o.borrow_bucket_bytes = 256 << 10;
    o.stage = true;
    std::vector<std::vector<uint8_t>> at_begin;
    int applies = 0;
    o.after_begin = [&](ReloadEngine& e) { at_begin = registered(e); };
    o.before_apply = [&](ReloadEngine& e) {
      EXPECT_EQ(registered(e), at_begin) << "storage written while the rank serves";
      ++applies;
    };
    expect_loads_equal_plan_order(scheme, o, 10, [](const EngineReport& r) { EXPECT_GT(r.piecewise_pieces, 0u); });
    EXPECT_EQ(applies, 2) << scheme_name(scheme);
  }
}

// Lent pieces of whole rows (a rank that owns its received buckets) wait for their layer, then are
// processed straight into storage: many pieces of a few rows each, as several trainer ranks cut a
// slice, interleaved across layers. Every byte equals a plan-order load of the same weights.
TEST(Staging, ManyLentRowsOfEachSliceEqualAPlanOrderLoad) {
  for (const Scheme scheme : {Scheme::kFp8PerChannel, Scheme::kInt4Group, Scheme::kFp8Block, Scheme::kInt8PerChannel}) {
    LoadOptions o = interleaved();
    o.chunk_rows = scheme == Scheme::kFp8Block ? 128 : 8;
    o.lend = true;
    expect_loads_equal_plan_order(scheme, o, 8, [](const EngineReport& r) {
      EXPECT_GT(r.direct_pieces, r.layers) << "several lent pieces of a parameter, processed in place";
    });
  }
}

// The scheme's kernels, except that `name` fails its piece-by-piece processing while `*fail` is set.
KernelFactory failing_rows_of(std::string name, const bool* fail) {
  return [name, fail](const sharding::ParamSpec& p) -> Result<std::unique_ptr<ProcessingKernel>> {
    FERRY_ASSIGN_OR_RETURN(auto k, scheme_kernel(p));
    if (p.name != name) return k;
    struct Failing final : ProcessingKernel {
      Failing(std::unique_ptr<ProcessingKernel> k, const bool* f) : ok(std::move(k)), fail(f) {}
      std::string name() const override { return ok->name(); }
      std::vector<kernels::StorageTensor> inputs() const override { return ok->inputs(); }
      Status process(std::span<const TensorView> in, std::span<const TensorView> out, ScratchArena& s,
                     const kernels::Exec& e) override {
        return ok->process(in, out, s, e);
      }
      bool can_process_rows(const Region& dst) const override { return ok->can_process_rows(dst); }
      Status process_rows(const TensorView& in, int64_t row0, std::span<const TensorView> out,
                          const kernels::Exec& e) override {
        return *fail ? Status::internal("injected rows failure") : ok->process_rows(in, row0, out, e);
      }
      std::unique_ptr<ProcessingKernel> ok;
      const bool* fail;
    };
    return std::unique_ptr<ProcessingKernel>(new Failing(std::move(k), fail));
  };
}

constexpr char kFailingRows[] = "model.layers.1.mlp.down_proj.weight";

// A fp8_per_channel rank (engine options `o`) whose kFailingRows parameter fails its piece-by-piece
// processing in version 2, loaded with `opts` after version 1 loaded whole.
struct FailedRows {
  std::unique_ptr<bool> fail = std::make_unique<bool>(false);  // outlives the rank's kernels
  std::unique_ptr<testing::Rank> rank;
  std::map<std::string, std::vector<uint8_t>> before;  // storage holding version 1
  std::string why;                                     // version 2's error
};
FailedRows load_failing_rows(EngineOptions o, const LoadOptions& opts) {
  const tiny::Config cfg;
  FailedRows f;
  o.kernel_factory = failing_rows_of(kFailingRows, f.fail.get());
  f.rank = make_rank(cfg, Scheme::kFp8PerChannel, std::move(o));
  auto a = tiny::Weights::random(cfg, f.rank->spec, 1);
  auto b = tiny::Weights::random(cfg, f.rank->spec, 2);
  EXPECT_TRUE(load_checkpoint(*f.rank->engine, a->checkpoint(), 1).ok());
  f.before = testing::contents(f.rank->storage);
  *f.fail = true;
  auto r = load_checkpoint(*f.rank->engine, b->checkpoint(), 2, opts);
  EXPECT_FALSE(r.ok());
  if (!r.ok()) f.why = r.status().to_string();
  EXPECT_NE(f.why.find("injected rows failure"), std::string::npos) << f.why;
  return f;
}

// A parameter whose rows fail on arrival, borrowed (processed together at the end of a bucket) or
// copied (processed in the call), refuses its layer, named with the parameter and its rows. Rows of
// the layer already in storage are undone by the rollback, from the snapshot taken before the
// first of them.
TEST(Staging, RowsThatFailOnArrivalRefuseTheirLayerAndAreRolledBack) {
  for (const size_t bucket : {size_t{16} << 10, size_t{0}}) {
    SCOPED_TRACE(bucket ? "borrowed" : "copied");
    EngineOptions o;
    o.rollback = RollbackMode::kHost;
    LoadOptions opts = interleaved();
    opts.chunk_rows = 8;
    opts.borrow_bucket_bytes = bucket;
    const FailedRows f = load_failing_rows(std::move(o), opts);
    EXPECT_NE(f.why.find(std::string(kFailingRows) + " rows"), std::string::npos) << f.why;
    EXPECT_NE(f.why.find("layer model.layers.1 is refused"), std::string::npos) << f.why;
    ASSERT_TRUE(f.rank->engine->rollback().ok());
    EXPECT_EQ(testing::contents(f.rank->storage), f.before);
    EXPECT_EQ(f.rank->engine->census().moved, 0u);
  }
}

// Lent rows are processed at completion straight into storage, a parameter's pieces at once on the
// work pool: one that fails there fails the update, named with the parameter and its rows, and the
// rows its other pieces wrote beside it are undone by the rollback.
TEST(Staging, LentRowsThatFailAtCompletionAreNamedAndRolledBack) {
  EngineOptions o;
  o.rollback = RollbackMode::kHost;
  LoadOptions opts = interleaved();
  opts.chunk_rows = 8;  // several lent pieces of every parameter
  opts.lend = true;
  const FailedRows f = load_failing_rows(std::move(o), opts);
  EXPECT_NE(f.why.find(std::string(kFailingRows) + " rows from"), std::string::npos) << f.why;
  ASSERT_TRUE(f.rank->engine->rollback().ok());
  EXPECT_EQ(testing::contents(f.rank->storage), f.before);
  EXPECT_EQ(f.rank->engine->census().moved, 0u);
  // The next update, nothing failing, lands whole.
  *f.fail = false;
  auto b = tiny::Weights::random(tiny::Config{}, f.rank->spec, 2);
  auto again = load_checkpoint(*f.rank->engine, b->checkpoint(), 3, opts);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_NE(testing::contents(f.rank->storage), f.before);
}

TEST(Staging, OverTheLimitIsRefusedAndTheLayerIsRolledBack) {
  const tiny::Config cfg;
  auto probe = make_rank(cfg, Scheme::kFp8PerTensor);
  const uint64_t limit = largest_layer(probe->spec) + 1024;
  EngineOptions limited;
  limited.max_staging_bytes = limit;
  limited.rollback = RollbackMode::kHost;  // rows of the refused layer may be in storage already
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor, limited);
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  // In plan order the limit is enough. Pieces are parts of shards, staged in full precision.
  LoadOptions plan_order;
  plan_order.chunk_rows = 5;
  ASSERT_TRUE(load_checkpoint(*rank->engine, a->checkpoint(), 1, plan_order).ok());
  const auto v1 = testing::contents(rank->storage);
  LoadOptions o;
  o.interleave_layers = true;
  o.chunk_rows = 5;
  auto r = load_checkpoint(*rank->engine, b->checkpoint(), 2, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  const std::string msg = r.status().to_string();
  EXPECT_NE(msg.find("FERRY_MAX_STAGING_BYTES"), std::string::npos) << msg;
  // The refused layer is named; after the rollback none of its registered tensors differs.
  ASSERT_TRUE(rank->engine->rollback().ok());
  expect_refused_layer_untouched(*rank, msg, v1);
  EXPECT_EQ(rank->engine->staging_bytes(), 0u);
  // A complete update in plan order lands afterwards.
  auto again = load_checkpoint(*rank->engine, b->checkpoint(), 3);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_NE(testing::contents(rank->storage), v1);
}

// Borrowed pieces are the caller's bytes until release_borrowed(): a bucket that holds whole layers
// stages nothing and processes every piece straight into storage; buckets smaller than a layer hold
// only what release_borrowed() copies of the layers they leave incomplete, within one layer.
TEST(Staging, BorrowedBucketsStageOnlyLayersTheyLeaveIncomplete) {
  const tiny::Config cfg;
  for (const Scheme scheme : {Scheme::kFp8PerTensor, Scheme::kFp8PerChannel, Scheme::kInt4Group}) {
    auto rank = make_rank(cfg, scheme);
    auto w = tiny::Weights::random(cfg, rank->spec, 4);
    LoadOptions whole;
    whole.borrow_bucket_bytes = 64 << 20;
    auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1, whole);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->peak_staging_bytes, 0u) << scheme_name(scheme);
    EXPECT_EQ(r->piecewise_pieces, 0u) << scheme_name(scheme);
    EXPECT_GT(r->direct_pieces, 0u) << scheme_name(scheme);

    LoadOptions small;
    small.borrow_bucket_bytes = 24 << 10;
    small.chunk_rows = 16;
    auto s = load_checkpoint(*rank->engine, w->checkpoint(), 2, small);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    if (scheme == Scheme::kFp8PerTensor) {
      EXPECT_GT(s->peak_staging_bytes, 0u);  // parts of a shard wait for the rest of it
    } else {
      EXPECT_EQ(s->peak_staging_bytes, 0u) << scheme_name(scheme) << ": rows go straight into storage";
    }
    EXPECT_LE(s->peak_staging_bytes, largest_layer(rank->spec)) << scheme_name(scheme);
    EXPECT_EQ(s->out_of_order_layers, 0u) << scheme_name(scheme);
    EXPECT_EQ(rank->engine->staging_bytes(), 0u);
  }
}

// The staging limit applies to what release_borrowed() copies: over it, the layer is refused, named,
// and keeps its weights, and no borrow outlives the call.
TEST(Staging, BorrowedPiecesCopiedOverTheLimitRefuseTheirLayer) {
  const tiny::Config cfg;
  EngineOptions limited;
  limited.max_staging_bytes = 4096;
  limited.rollback = RollbackMode::kHost;  // rows of the refused layer may be in storage already
  auto rank = make_rank(cfg, Scheme::kFp8PerTensor, limited);
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  auto b = tiny::Weights::random(cfg, rank->spec, 2);
  LoadOptions whole;
  whole.borrow_bucket_bytes = 64 << 20;  // every layer completes inside the bucket: nothing staged
  ASSERT_TRUE(load_checkpoint(*rank->engine, a->checkpoint(), 1, whole).ok());
  const auto v1 = testing::contents(rank->storage);
  LoadOptions small;
  small.borrow_bucket_bytes = 24 << 10;
  small.chunk_rows = 5;
  auto r = load_checkpoint(*rank->engine, b->checkpoint(), 2, small);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
  const std::string msg = r.status().to_string();
  EXPECT_EQ(rank->engine->staging_bytes(), 0u);
  ASSERT_TRUE(rank->engine->rollback().ok());
  expect_refused_layer_untouched(*rank, msg, v1);
}

}  // namespace
}  // namespace ferry::reload
