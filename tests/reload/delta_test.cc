// The engine's delta shadow: a delta applies only on top of exactly the version the shadow holds
// complete, never on any other (nor without a shadow), and the shadow holds no version after an
// update that failed, was rolled back, or bypassed it.
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/region_copy.h"

#include "reload/checkpoint_loader.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::contents;
using testing::make_rank;

EngineOptions shadow(bool on, RollbackMode rollback = RollbackMode::kOff) {
  EngineOptions o;
  o.delta_shadow = on;
  o.rollback = rollback;
  return o;
}

// The first piece of the first parameter with a slice, as a delta that flips every element.
Status delta_on_first(ReloadEngine& e, uint64_t base, bool* applied) {
  const auto& p = e.spec().params.front();
  const Region dst = sharding::slice_dst_region(p.slices.front(), p);
  const DType dtype = e.input_layout(0).front().dtype;
  return e.take_delta_piece(
      0, 0, dst, dtype, dtype_bytes(dtype, dst.numel()), base,
      [applied](uint8_t* v, size_t n, std::vector<std::pair<uint64_t, uint64_t>>* changed, uint64_t) {
        for (size_t i = 0; i < n; ++i) v[i] ^= 0xff;
        changed->assign(1, {0, n / 2});
        *applied = true;
        return ok_status();
      });
}

TEST(DeltaShadow, ADeltaAgainstAnotherVersionIsRefusedAndNothingIsApplied) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerChannel, shadow(true));
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  EXPECT_EQ(rank->engine->delta_base(), 0u) << "a new rank holds no version";
  ASSERT_OK(load_checkpoint(*rank->engine, w->checkpoint(), 1).status());
  EXPECT_EQ(rank->engine->delta_base(), 1u);
  const auto before = contents(rank->storage);

  ASSERT_OK(rank->engine->begin(3));
  bool applied = false;
  for (uint64_t wrong : {uint64_t{2}, uint64_t{0}, uint64_t{3}}) {
    const Status st = delta_on_first(*rank->engine, wrong, &applied);
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << wrong << ": " << st.to_string();
    EXPECT_NE(st.message().find("refused"), std::string::npos) << st.to_string();
    EXPECT_NE(st.message().find("holds v1"), std::string::npos) << st.to_string();
  }
  EXPECT_FALSE(applied) << "a refused delta never reaches the values";
  EXPECT_TRUE(contents(rank->storage) == before) << "nor the storage";
  // The refused pieces covered nothing: the right base is still taken for the same region (its
  // layer, the embedding alone, completes and is written).
  ASSERT_OK(delta_on_first(*rank->engine, 1, &applied));
  EXPECT_TRUE(applied);
  EXPECT_FALSE(contents(rank->storage) == before);
  rank->engine->abort();
}

TEST(DeltaShadow, WithoutAShadowEveryDeltaIsRefused) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kNone, shadow(false));
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*rank->engine, w->checkpoint(), 1).status());
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  ASSERT_OK(rank->engine->begin(2));
  bool applied = false;
  const Status st = delta_on_first(*rank->engine, 1, &applied);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("FERRY_DELTA_SHADOW=off"), std::string::npos) << st.to_string();
  EXPECT_FALSE(applied);
}

// A shadow in device memory (FERRY_DELTA_SHADOW=device) needs storage on a GPU: a rank whose
// storage is on the host is refused at creation, naming the setting.
TEST(DeltaShadow, ADeviceShadowForHostStorageIsRefused) {
  const tiny::Config cfg;
  auto spec = *tiny::rank_spec(cfg, Scheme::kFp8PerChannel);
  auto storage = ModelStorage::allocate(spec, Device::cpu());
  ASSERT_TRUE(storage.ok());
  EngineOptions o = shadow(true);
  o.shadow_on_device = true;
  auto e = ReloadEngine::create(spec, *storage, o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("FERRY_DELTA_SHADOW=device"), std::string::npos) << e.status().to_string();
}

TEST(DeltaShadow, AFailedRolledBackOrBypassedUpdateLeavesNoBase) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kInt4Group, shadow(true, RollbackMode::kHost));
  auto a = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 1).status());
  ASSERT_EQ(rank->engine->delta_base(), 1u);
  // An update that ends incomplete, then is rolled back: storage holds v1 again, the shadow does not.
  ASSERT_OK(rank->engine->begin(2));
  bool applied = false;
  ASSERT_OK(delta_on_first(*rank->engine, 1, &applied));
  EXPECT_FALSE(rank->engine->finalize().ok());
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  ASSERT_OK(rank->engine->rollback());
  EXPECT_EQ(rank->engine->version(), 1u);
  EXPECT_EQ(rank->engine->delta_base(), 0u) << "the shadow took the aborted update's delta";
  // A complete update gives it a base again; one whose pieces bypassed it does not.
  ASSERT_OK(load_checkpoint(*rank->engine, a->checkpoint(), 3).status());
  EXPECT_EQ(rank->engine->delta_base(), 3u);
  ASSERT_OK(rank->engine->begin(4));
  rank->engine->drop_shadow();
  rank->engine->abort();
  ASSERT_OK(rank->engine->begin(5));
  rank->engine->drop_shadow();
  EXPECT_EQ(delta_on_first(*rank->engine, 3, &applied).code(), StatusCode::kFailedPrecondition)
      << "a shadow that missed pieces takes no delta";
}

// Whether a rank keeps its shadow (BucketHeader.no_deltas, ReloadEngine::note_sender): while a
// sender that may send deltas is heard from, the shadow keeps every piece and its version. An
// update that hears only from senders that send none (all of them, or the only one this rank hears
// from), or whose pieces bypassed the shadow, frees it; the next leaves it unwritten, and a delta is
// refused until a sender that may send deltas comes back and a dense update gives the shadow a
// version again. Storage is a dense load's every time.
TEST(DeltaShadow, TheShadowIsKeptOnlyWhileASenderMaySendDeltas) {
  const tiny::Config cfg;
  auto rank = make_rank(cfg, Scheme::kFp8PerChannel, shadow(true));
  auto cold = make_rank(cfg, Scheme::kFp8PerChannel);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*cold->engine, w->checkpoint(), 1).status());
  uint64_t v = 0;
  // One update from two senders, after `say` ran; returns its shadow bytes.
  const auto update = [&](const std::function<void(ReloadEngine&)>& say) -> uint64_t {
    LoadOptions o;
    o.senders = 2;
    o.after_begin = say;
    auto r = load_checkpoint(*rank->engine, w->checkpoint(), ++v, o);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(contents(rank->storage) == contents(cold->storage)) << "v" << v;
    return r.ok() ? r->shadow_bytes : 0;
  };
  const auto delta_applies = [&](uint64_t base) {
    EXPECT_TRUE(rank->engine->begin(v + 1).ok());
    bool applied = false;
    const Status st = delta_on_first(*rank->engine, base, &applied);
    rank->engine->abort();
    EXPECT_EQ(applied, st.ok());
    return st.ok();
  };
  const auto one_with_deltas = [](ReloadEngine& e) {
    e.note_sender(7, false);
    e.note_sender(8, true);
  };
  const uint64_t shadow_bytes = update(nullptr);  // no bucket said anything: the shadow stays
  EXPECT_GT(shadow_bytes, 0u);
  EXPECT_EQ(rank->engine->delta_base(), v);

  EXPECT_EQ(update(one_with_deltas), shadow_bytes) << "sender 8 may send deltas";
  EXPECT_EQ(rank->engine->delta_base(), v);
  EXPECT_TRUE(delta_applies(v));

  // Only sender 7 is heard from, and it sends no deltas: the shadow goes, and stays unwritten.
  EXPECT_EQ(update([](ReloadEngine& e) { e.note_sender(7, false); }), 0u);
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  EXPECT_FALSE(delta_applies(v));
  EXPECT_EQ(update([](ReloadEngine& e) { e.note_sender(7, false); }), 0u) << "nothing allocated";
  EXPECT_EQ(update([](ReloadEngine& e) {
              e.note_sender(7, false);
              e.note_sender(8, false);
            }),
            0u);

  // A sender that may send deltas again: that update still leaves the shadow unwritten, the next
  // fills it and gives it a version, and deltas against it apply.
  EXPECT_EQ(update(one_with_deltas), 0u);
  EXPECT_EQ(rank->engine->delta_base(), 0u);
  EXPECT_EQ(update(one_with_deltas), shadow_bytes);
  EXPECT_EQ(rank->engine->delta_base(), v);
  EXPECT_TRUE(delta_applies(v));

  // Pieces that bypass the shadow (direct reads) free it too, whatever the senders say.
  EXPECT_EQ(update([&](ReloadEngine& e) {
              one_with_deltas(e);
              e.drop_shadow();
            }),
            0u);
  EXPECT_EQ(rank->engine->delta_base(), 0u);
}

// Loads a random version 1 of the tiny model, then version 2 (version 1 with `change` made to the
// bytes of layer 0's up_proj, rows [256, 512) of the fused gate_up: 256 rows of 128 bf16) with
// every slice of every parameter as a delta, onto host storage with its shadow on the host or
// storage on a GPU with its shadow there (FERRY_DELTA_SHADOW=device). Storage must end
// byte-identical to a cold engine loaded with version 2 densely; `kept` gets the report's rows
// left as they were. On the device the rows a piece's delta changes are marked here, as the data
// plane's kernel marks them (TheRowsADeltaWritesInAreMarked, dataplane_delta_device_test).
void delta_v2(Scheme scheme, bool on_device, const std::function<void(std::vector<uint8_t>&)>& change, uint64_t* kept) {
  EngineOptions options = shadow(true);
  options.shadow_on_device = on_device;
  const tiny::Config cfg;
  auto rank = make_rank(cfg, scheme, options, EngineLayout::kFerry, on_device ? Device::cuda(0) : Device::cpu());
  auto cold = make_rank(cfg, scheme);
  auto w = tiny::Weights::random(cfg, rank->spec, 1);
  ASSERT_OK(load_checkpoint(*rank->engine, w->checkpoint(), 1).status());
  Checkpoint v2;
  std::map<std::string, std::vector<uint8_t>> bytes;
  for (const auto& [name, t] : w->checkpoint()) {
    auto& b = bytes[name];
    b.assign(static_cast<const uint8_t*>(t.data()), static_cast<const uint8_t*>(t.data()) + t.nbytes());
    v2.emplace(name, TensorView(b.data(), t.dtype(), t.shape()));
  }
  std::string moved;
  for (auto& [name, b] : bytes) {
    if (name.find("layers.0.mlp.up_proj.weight") != std::string::npos) {
      change(b);
      moved = name;
      break;
    }
  }
  ASSERT_FALSE(moved.empty());
  ASSERT_OK(load_checkpoint(*cold->engine, v2, 2).status());
  // Every slice of every parameter as a delta: its new values over the old ones.
  ASSERT_OK(rank->engine->begin(2));
  for (uint32_t i = 0; i < rank->spec.params.size(); ++i) {
    const auto& p = rank->spec.params[i];
    for (const auto& s : p.slices) {
      const TensorView src = v2.at(s.source);
      const Region dst = sharding::slice_dst_region(s, p);
      const size_t n = dtype_bytes(src.dtype(), s.src.numel());
      std::vector<uint8_t> now(n);
      ASSERT_OK(pack_region(src, s.src, now.data(), n));
      const size_t elem = dtype_bytes(src.dtype(), 1);
      ReloadEngine::DeltaSource delta;
      delta.apply = [&](uint8_t* values, size_t bytes, std::vector<std::pair<uint64_t, uint64_t>>* changed, uint64_t) {
        changed->clear();
        for (size_t e = 0; e < bytes / elem; ++e) {
          if (std::memcmp(values + e * elem, now.data() + e * elem, elem) != 0) changed->emplace_back(e, 1);
        }
        std::memcpy(values, now.data(), bytes);
        return ok_status();
      };
      // On the device: the old values come back to compare, the rows they differ in are marked.
      delta.apply_on_device = [&](void* values, size_t bytes, Device device, uint64_t per_row,
                                  uint8_t* marks) -> Status {
        std::vector<uint8_t> old(bytes);
        FERRY_RETURN_IF_ERROR(copy_bytes(old.data(), Device::cpu(), values, device, bytes));
        for (size_t e = 0; e < bytes / elem; ++e) {
          if (std::memcmp(old.data() + e * elem, now.data() + e * elem, elem) != 0) marks[e / per_row] = 1;
        }
        return copy_bytes(values, device, now.data(), Device::cpu(), bytes);
      };
      ASSERT_OK(rank->engine->take_delta_piece(i, 0, dst, src.dtype(), n, 1, delta));
    }
  }
  auto r = rank->engine->finalize();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(contents(rank->storage) == contents(cold->storage)) << "storage differs from a dense load of v2";
  EXPECT_EQ(r->census.moved, 0u);
  *kept = r->kept_rows;
}

// Row-local schemes re-process only the rows a delta changed: a version that changes one element
// of one parameter leaves every other row as it was, on the host and on a GPU (that case skips
// without a device).
struct RowsCase {
  bool amax_moves;
  bool on_device;
};
class DeltaRows : public ::testing::TestWithParam<RowsCase> {};

TEST_P(DeltaRows, OnlyTheRowsADeltaChangedAreProcessedAgain) {
  // What each scheme processes again for one changed element in row 128 of layer 0's up_proj,
  // which is rows [256, 512) of the fused gate_up (tiny config: intermediate 256, hidden 128): the
  // row alone where every row's codes and scale are its own, its 128-row block under fp8_block
  // (rows 384-511), and under fp8_per_tensor the row alone while the up shard's scale holds, the
  // whole shard (all 256 rows) once the element becomes its amax (a scale sees every element); on
  // the GPU the whole shard either way (keeping a shard's scale is the CPU kernels' alone).
  // kNone first: its kept rows (one row processed) are the others' baseline.
  const bool amax_moves = GetParam().amax_moves;
  const bool on_device = GetParam().on_device;
  if (on_device && !cuda_device_available()) GTEST_SKIP() << "no CUDA device here";
  const std::vector<std::pair<Scheme, uint64_t>> processed = {
      {Scheme::kNone, 1},
      {Scheme::kFp8PerChannel, 1},
      {Scheme::kInt4Group, 1},
      {Scheme::kFp8Block, 128},
      {Scheme::kFp8PerTensor, amax_moves || on_device ? 256u : 1u}};
  const auto change = [amax_moves](std::vector<uint8_t>& b) {
    const size_t e = b.size() / 4;  // an element of the middle row
    if (amax_moves) {
      b[2 * e] = 0x48, b[2 * e + 1] = 0x42;  // 50.0 in bf16: far above every other weight
    } else {
      b[2 * e] ^= 0x40;  // the mantissa's top bit
    }
  };
  std::optional<uint64_t> kept_by_rows;
  for (const auto& [scheme, rows_processed] : processed) {
    SCOPED_TRACE(scheme_name(scheme));
    uint64_t kept = 0;
    delta_v2(scheme, on_device, change, &kept);
    if (HasFatalFailure()) return;
    // Every scheme leaves the unchanged parameters as they were, and of the changed one all rows
    // but those its change reaches.
    EXPECT_GT(kept, 100u) << "rows without a change are left as they were";
    if (scheme == Scheme::kNone) kept_by_rows = kept + 1;
    ASSERT_TRUE(kept_by_rows.has_value());
    EXPECT_EQ(kept, *kept_by_rows - rows_processed) << "rows processed again";
  }
}

// On a GPU each run of changed rows is a kernel launch: a parameter whose changes fall in more
// runs than a few (8) is processed whole there, in one, and still lands a dense load's bytes; on
// the host only its changed rows are processed.
TEST(DeltaRowsOnTheGpu, AParameterChangedInManyRunsIsProcessedWhole) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device here";
  // One element in each of `runs` rows of up_proj, two rows apart.
  const auto rows_apart = [](int runs) {
    return [runs](std::vector<uint8_t>& b) {
      const size_t row = b.size() / 256;
      for (int k = 0; k < runs; ++k) b[static_cast<size_t>(2 * k) * row] ^= 0x40;
    };
  };
  uint64_t host8 = 0, gpu8 = 0, host20 = 0, gpu20 = 0;
  delta_v2(Scheme::kFp8PerChannel, false, rows_apart(8), &host8);
  delta_v2(Scheme::kFp8PerChannel, true, rows_apart(8), &gpu8);
  delta_v2(Scheme::kFp8PerChannel, false, rows_apart(20), &host20);
  delta_v2(Scheme::kFp8PerChannel, true, rows_apart(20), &gpu20);
  if (HasFatalFailure()) return;
  EXPECT_EQ(host20, host8 - 12) << "the host processes the 20 changed rows";
  EXPECT_EQ(gpu8, host8) << "8 runs: the GPU processes their rows alone";
  EXPECT_EQ(gpu20, host20 - (512 - 20)) << "20 runs: the GPU processes the fused gate_up's 512 rows whole";
}

INSTANTIATE_TEST_SUITE_P(Changes, DeltaRows,
                         ::testing::Values(RowsCase{false, false}, RowsCase{true, false}, RowsCase{false, true},
                                           RowsCase{true, true}),
                         [](const ::testing::TestParamInfo<RowsCase>& info) {
                           return std::string(info.param.amax_moves ? "AmaxMoves" : "ScalesHold") +
                                  (info.param.on_device ? "OnTheGpu" : "");
                         });

}  // namespace
}  // namespace ferry::reload
