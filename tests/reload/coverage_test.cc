// Exact coverage through the engine: every order of a layer's pieces, chunked pieces, duplicates,
// overlaps, pieces out of range, an empty update, a missing shard (the update fails naming it, and
// rollback restores its layer) and a piece for an unknown name.
#include <algorithm>
#include <span>

#include "core/float_convert.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

struct Piece {
  std::string param;
  Region dst;
  std::vector<uint16_t> data;  // bf16
};

// Layer 0: P [8, 128] from a (rows 0-3) and b (rows 4-7), scheme none; Q [4, 128] from c, scheme
// fp8_per_tensor. Layer 1: R [4, 128] from d, scheme none.
sharding::RankSpec spec() {
  sharding::RankSpec s;
  for (const char* n : {"a", "b", "c", "d"}) s.expects.push_back({n, DType::kBF16, {4, 128}});
  const Region rows4{{0, 0}, {4, 128}};
  s.params.push_back({"model.layers.0.p.weight", "model.layers.0", {8, 128}, DType::kBF16, Scheme::kNone, {},
                      {{"a", rows4, {0, 0}}, {"b", rows4, {4, 0}}}});
  s.params.push_back({"model.layers.0.q.weight", "model.layers.0", {4, 128}, DType::kBF16, Scheme::kFp8PerTensor, {},
                      {{"c", rows4, {0, 0}}}});
  s.params.push_back({"model.layers.1.r.weight", "model.layers.1", {4, 128}, DType::kBF16, Scheme::kNone, {},
                      {{"d", rows4, {0, 0}}}});
  return s;
}

std::vector<uint16_t> values(int64_t n, float base) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = f32_to_bf16(base + 0.01f * static_cast<float>(i % 97));
  return v;
}

Piece piece(const std::string& p, Region r, float base) { return {p, r, values(r.numel(), base)}; }

// Layer 0 in five pieces (one of them cut by columns), layer 1 in one.
std::vector<Piece> layer0(float v) {
  return {piece("model.layers.0.p.weight", {{0, 0}, {2, 128}}, v), piece("model.layers.0.p.weight", {{2, 0}, {2, 128}}, v + 1),
          piece("model.layers.0.p.weight", {{4, 0}, {4, 128}}, v + 4),
          piece("model.layers.0.q.weight", {{0, 0}, {4, 64}}, v + 2), piece("model.layers.0.q.weight", {{0, 64}, {4, 64}}, v + 3)};
}
Piece layer1(float v) { return piece("model.layers.1.r.weight", {{0, 0}, {4, 128}}, v); }

ModelStorage allocate(const sharding::RankSpec& s) {
  auto r = ModelStorage::allocate(s, Device::cpu());
  EXPECT_TRUE(r.ok());
  return std::move(*r);
}

std::unique_ptr<ReloadEngine> engine_for(const sharding::RankSpec& s, ModelStorage& storage,
                                         EngineOptions options = {}) {
  auto r = ReloadEngine::create(s, storage, std::move(options));
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(*r);
}

struct Fixture {
  explicit Fixture(EngineOptions options = {}) : engine(engine_for(s, storage, std::move(options))) {}
  sharding::RankSpec s = spec();
  ModelStorage storage = allocate(s);
  std::unique_ptr<ReloadEngine> engine;
  Status apply(const Piece& p) {
    return engine->apply_named_piece(p.param, 0, p.dst, DType::kBF16, p.data.data(), p.data.size() * 2);
  }
};

TEST(Coverage, EveryOrderOfALayersPiecesGivesTheSameStorage) {
  Fixture ref;
  ASSERT_OK(ref.engine->begin(1));
  for (const auto& p : layer0(1.0f)) ASSERT_OK(ref.apply(p));
  ASSERT_OK(ref.apply(layer1(5.0f)));
  ASSERT_TRUE(ref.engine->finalize().ok());
  const auto expected = testing::contents(ref.storage);
  // Storage really holds the pieces: P row 0 is piece 0 converted (bf16 -> bf16 is a copy).
  const std::vector<uint16_t> p0 = layer0(1.0f)[0].data;
  EXPECT_EQ(std::vector<uint8_t>(expected.at("model.layers.0.p.weight").begin(),
                                 expected.at("model.layers.0.p.weight").begin() + 256),
            std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(p0.data()), reinterpret_cast<const uint8_t*>(p0.data()) + 256));

  std::vector<int> order{0, 1, 2, 3, 4};
  int orders = 0;
  do {
    Fixture f;
    ASSERT_OK(f.engine->begin(1));
    const auto pieces = layer0(1.0f);
    for (size_t i = 0; i < order.size(); ++i) {
      ASSERT_OK(f.apply(pieces[static_cast<size_t>(order[i])]));
      // The layer is processed exactly when its last piece lands: Q's halves (one scale over both)
      // are staged until then; P's rows go into storage as they come.
      const auto applied = std::span(order).first(i + 1);
      const bool q_started = std::ranges::count(applied, 3) + std::ranges::count(applied, 4) > 0;
      EXPECT_EQ(f.engine->staging_bytes() > 0, q_started && i + 1 < order.size());
    }
    ASSERT_OK(f.apply(layer1(5.0f)));
    auto r = f.engine->finalize();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->layers, 2u);
    EXPECT_EQ(testing::contents(f.storage), expected);
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 120);
}

TEST(Coverage, ChunkedPiecesOfOneRowEach) {
  Fixture ref, f;
  ASSERT_OK(ref.engine->begin(1));
  for (const auto& p : layer0(2.0f)) ASSERT_OK(ref.apply(p));
  ASSERT_OK(ref.apply(layer1(3.0f)));
  ASSERT_TRUE(ref.engine->finalize().ok());
  ASSERT_OK(f.engine->begin(1));
  for (const auto& p : layer0(2.0f)) {
    const int64_t cols = p.dst.size[1];
    for (int64_t r = 0; r < p.dst.size[0]; ++r) {
      Piece c{p.param, {{p.dst.offset[0] + r, p.dst.offset[1]}, {1, cols}},
              std::vector<uint16_t>(p.data.begin() + r * cols, p.data.begin() + (r + 1) * cols)};
      ASSERT_OK(f.apply(c));
    }
  }
  ASSERT_OK(f.apply(layer1(3.0f)));
  ASSERT_TRUE(f.engine->finalize().ok());
  EXPECT_EQ(testing::contents(f.storage), testing::contents(ref.storage));
}

TEST(Coverage, DuplicateOverlapAndOutOfRangeNameTensorAndRegion) {
  Fixture f;
  ASSERT_OK(f.engine->begin(1));
  const auto pieces = layer0(1.0f);
  ASSERT_OK(f.apply(pieces[0]));
  Status dup = f.apply(pieces[0]);
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.to_string().find("model.layers.0.p.weight"), std::string::npos) << dup.to_string();
  EXPECT_NE(dup.to_string().find("duplicates"), std::string::npos) << dup.to_string();
  EXPECT_NE(dup.to_string().find(pieces[0].dst.to_string()), std::string::npos) << dup.to_string();
  Status over = f.apply(piece("model.layers.0.p.weight", {{1, 0}, {2, 128}}, 0));
  EXPECT_EQ(over.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.to_string().find("overlaps"), std::string::npos) << over.to_string();
  EXPECT_NE(over.to_string().find(Region{{1, 0}, {2, 128}}.to_string()), std::string::npos);
  // Straddles the two slices' boxes: no single source slice holds it.
  Status straddle = f.apply(piece("model.layers.0.p.weight", {{3, 0}, {2, 128}}, 0));
  EXPECT_EQ(straddle.code(), StatusCode::kOutOfRange) << straddle.to_string();
  Status outside = f.apply(piece("model.layers.1.r.weight", {{3, 0}, {2, 128}}, 0));
  EXPECT_EQ(outside.code(), StatusCode::kOutOfRange) << outside.to_string();
  EXPECT_NE(outside.to_string().find("model.layers.1.r.weight"), std::string::npos);
}

TEST(Coverage, EmptyUpdateFailsNamingEveryLayer) {
  Fixture f;
  ASSERT_OK(f.engine->begin(1));
  auto r = f.engine->finalize();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().to_string().find("2 of 2 layers are incomplete"), std::string::npos) << r.status().to_string();
  // Led by the cause, in the trainer's words: the checkpoint tensors that never arrived.
  EXPECT_EQ(r.status().message().find("update v1 never received checkpoint tensors: a [0:4, 0:128], b [0:4, 0:128], c"), 0u)
      << r.status().to_string();
  EXPECT_NE(r.status().to_string().find("model.layers.0"), std::string::npos);
  EXPECT_NE(r.status().to_string().find("model.layers.1"), std::string::npos);
}

// A layer one shard short fails the update, named by the checkpoint tensor never sent. Its rows that
// did arrive may already be in storage (the rank stays paused until a complete update lands), and
// the rollback snapshot taken before the first of them restores the layer, byte for byte.
TEST(Coverage, MissingShardFailsTheUpdateAndRollbackRestoresItsLayer) {
  EngineOptions o;
  o.rollback = RollbackMode::kHost;
  Fixture f(std::move(o));
  ASSERT_OK(f.engine->begin(1));
  for (const auto& p : layer0(1.0f)) ASSERT_OK(f.apply(p));
  ASSERT_OK(f.apply(layer1(2.0f)));
  ASSERT_TRUE(f.engine->finalize().ok());
  const auto v1 = testing::contents(f.storage);

  ASSERT_OK(f.engine->begin(2));
  const auto pieces = layer0(7.0f);
  ASSERT_OK(f.apply(pieces[0]));  // P's shard from a; the shard from b never arrives
  ASSERT_OK(f.apply(pieces[1]));
  ASSERT_OK(f.apply(pieces[3]));
  ASSERT_OK(f.apply(pieces[4]));
  ASSERT_OK(f.apply(layer1(8.0f)));
  auto r = f.engine->finalize();
  ASSERT_FALSE(r.ok());
  const std::string msg = r.status().to_string();
  EXPECT_NE(msg.find("1 of 2 layers are incomplete"), std::string::npos) << msg;
  // The checkpoint tensor never sent (b), not the fused parameter's rows [4:8] it lands in.
  EXPECT_NE(msg.find("never received checkpoint tensors: b [0:4, 0:128];"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("model.layers.0.p.weight"), std::string::npos) << msg;
  const auto v2 = testing::contents(f.storage);
  EXPECT_NE(v2.at("model.layers.1.r.weight"), v1.at("model.layers.1.r.weight"));  // complete: written
  EXPECT_NE(v2.at("model.layers.0.p.weight"), v1.at("model.layers.0.p.weight"));  // a's rows, on arrival
  EXPECT_EQ(v2.at("model.layers.0.q.weight"), v1.at("model.layers.0.q.weight"));  // staged: one scale
  EXPECT_EQ(v2.at("model.layers.0.q.weight_scale"), v1.at("model.layers.0.q.weight_scale"));
  EXPECT_EQ(f.engine->snapshot_layers(), 2u);                                     // layer 1, and layer 0's rows from a
  ASSERT_OK(f.engine->rollback());
  EXPECT_EQ(testing::contents(f.storage), v1);
  EXPECT_EQ(f.engine->census().moved, 0u);
}

TEST(Coverage, PieceForAnUnknownNameIsReportedByFinalize) {
  Fixture f;
  ASSERT_OK(f.engine->begin(1));
  for (const auto& p : layer0(1.0f)) ASSERT_OK(f.apply(p));
  ASSERT_OK(f.apply(layer1(2.0f)));
  Status st = f.apply(piece("model.layers.9.nope.weight", {{0, 0}, {1, 128}}, 0));
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  auto r = f.engine->finalize();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().to_string().find("model.layers.9.nope.weight"), std::string::npos) << r.status().to_string();
}

TEST(Coverage, PieceAfterItsLayerCompletedIsRefused) {
  Fixture f;
  ASSERT_OK(f.engine->begin(1));
  ASSERT_OK(f.apply(layer1(2.0f)));
  Status st = f.apply(layer1(2.0f));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.to_string().find("after layer model.layers.1 was complete"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace ferry::reload
