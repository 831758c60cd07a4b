#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "sharding/layout.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/presets.h"
#include "sharding/trainer_layouts.h"

namespace ferry::sharding {
namespace {

struct Fixture {
  Manifest manifest;
  std::vector<RankSpec> ranks;
};

Fixture small_model(int tp, int replicas, int layers = 4) {
  ModelConfig c;
  c.family = "llama";
  c.hidden_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.intermediate_size = 128;
  c.vocab_size = 1000;
  c.num_layers = layers;
  c.vocab_pad_multiple = 8;
  auto desc = describe_model(c);
  EXPECT_TRUE(desc.ok());
  auto ranks = model_rank_specs(*desc, replicas, tp, 1, Scheme::kNone);
  EXPECT_TRUE(ranks.ok()) << ranks.status().to_string();
  return {model_manifest(*desc), std::move(*ranks)};
}

TEST(Planner, DeterministicAcrossRuns) {
  Fixture f = small_model(4, 2);
  std::vector<SenderInfo> senders(3);
  auto a = make_plan(f.manifest, f.ranks, senders, PlanOptions{4096});
  auto b = make_plan(f.manifest, f.ranks, senders, PlanOptions{4096});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->key, b->key);
  ASSERT_EQ(a->pieces.size(), b->pieces.size());
  for (size_t i = 0; i < a->pieces.size(); ++i) {
    EXPECT_EQ(a->pieces[i].sender, b->pieces[i].sender);
    EXPECT_EQ(a->pieces[i].dst, b->pieces[i].dst);
    EXPECT_EQ(a->pieces[i].src, b->pieces[i].src);
  }
  ASSERT_EQ(a->buckets.size(), b->buckets.size());
  for (size_t i = 0; i < a->buckets.size(); ++i) {
    ASSERT_EQ(a->buckets[i].parts.size(), b->buckets[i].parts.size());
    for (size_t k = 0; k < a->buckets[i].parts.size(); ++k) {
      EXPECT_EQ(a->buckets[i].parts[k].piece, b->buckets[i].parts[k].piece);
      EXPECT_EQ(a->buckets[i].parts[k].rows, b->buckets[i].parts[k].rows);
    }
  }
}

TEST(Planner, LayersInOrderEmbeddingFirstHeadLast) {
  Fixture f = small_model(2, 1, 12);  // layer 10 must follow layer 9, not layer 1
  auto plan = make_plan(f.manifest, f.ranks, {SenderInfo{}}, PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->layers.size(), 12u + 3u);
  EXPECT_EQ(plan->layers.front(), "model.embed_tokens");
  for (int i = 0; i < 12; ++i) EXPECT_EQ(plan->layers[static_cast<size_t>(i) + 1], "model.layers." + std::to_string(i));
  EXPECT_EQ(plan->layers.back(), "lm_head");
  int last = -1;
  for (const Piece& pc : plan->pieces) {
    const int li = layer_index_of(f.manifest[static_cast<size_t>(pc.source)].name);
    if (li >= 0) {
      EXPECT_GE(li, last);
      last = li;
    }
  }
}

// Every row of every piece lands in exactly one bucket of its (sender, destination) stream, in
// plan order; a bucket holds at most the bucket size, except a single row larger than that.
TEST(Planner, BucketsCutPiecesByRowsUpToTheLimit) {
  Fixture f = small_model(2, 2);
  const uint64_t cap = 3000;
  auto plan = make_plan(f.manifest, f.ranks, std::vector<SenderInfo>(3), PlanOptions{cap});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->bucket_bytes, cap);
  std::vector<int64_t> next_row(plan->pieces.size(), 0);
  std::map<std::pair<int, int>, int> last_piece;
  bool split = false;
  for (const Bucket& b : plan->buckets) {
    uint64_t bytes = 0;
    ASSERT_FALSE(b.parts.empty());
    EXPECT_LE(b.parts.size(), kMaxPiecesPerBucket);
    for (const BucketPart& part : b.parts) {
      const Piece& pc = plan->pieces[static_cast<size_t>(part.piece)];
      EXPECT_EQ(pc.sender, b.sender);
      EXPECT_EQ(pc.dst, b.dst);
      EXPECT_EQ(part.first_row, next_row[static_cast<size_t>(part.piece)]) << "rows out of order or twice";
      next_row[static_cast<size_t>(part.piece)] += part.rows;
      const PieceRows pr = piece_rows(pc.src.size, pc.bytes);
      EXPECT_EQ(part.bytes, static_cast<uint64_t>(part.rows) * pr.row_bytes);
      split |= part.rows < pr.rows;
      bytes += part.bytes;
      auto key = std::make_pair(b.sender, b.dst);
      if (last_piece.count(key)) {
        EXPECT_GE(part.piece, last_piece[key]);
      }
      last_piece[key] = part.piece;
    }
    EXPECT_EQ(bytes, b.bytes);
    if (b.bytes > cap) {
      ASSERT_EQ(b.parts.size(), 1u);
      EXPECT_EQ(b.parts[0].rows, 1) << "only a single row larger than a bucket may exceed it";
    }
  }
  for (size_t i = 0; i < plan->pieces.size(); ++i) {
    EXPECT_EQ(next_row[i], piece_rows(plan->pieces[i].src.size, plan->pieces[i].bytes).rows) << "piece " << i;
  }
  EXPECT_TRUE(split) << "the embedding shard is larger than a bucket and must be cut";
}

// The rule itself, against its statement in buckets.h.
TEST(Planner, BucketCutterFollowsTheRule) {
  BucketCutter c(1000);
  EXPECT_EQ(c.fit(10, 300), 3);  // whole rows up to the bucket size
  EXPECT_FALSE(c.place(3, 300));
  EXPECT_EQ(c.fit(5, 200), 0);  // 100 bytes left: not one row; send first
  c.sent();
  EXPECT_EQ(c.fit(1, 5000), 1);  // a row larger than a bucket travels alone
  EXPECT_TRUE(c.place(1, 5000));
  c.sent();
  EXPECT_EQ(c.fit(4, 250), 4);
  EXPECT_TRUE(c.place(4, 250));  // exactly full: sent at once
  c.sent();
  for (size_t i = 0; i + 1 < kMaxPiecesPerBucket; ++i) EXPECT_FALSE(c.place(1, 0));
  EXPECT_TRUE(c.place(1, 0));  // the piece bound
  c.sent();
  EXPECT_TRUE(c.fit(3, 300) == 3 && !c.place(3, 300));
  EXPECT_EQ(c.fit(10, 300, /*whole=*/true), 10);  // a direct piece is never cut
  EXPECT_TRUE(c.place(10, 300));
}

TEST(Planner, DefaultBucketSizeIs64MiB) {
  Fixture f = small_model(1, 1, 1);
  auto plan = make_plan(f.manifest, f.ranks, {SenderInfo{}});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->bucket_bytes, 64ull << 20);
  EXPECT_EQ(plan->buckets.size(), 1u);  // a tiny model fits in one bucket
}

TEST(Planner, BalancedWithinTenPercentOfIdeal) {
  for (int senders : {2, 3, 5, 8, 16}) {
    for (int tp : {1, 2, 4, 8}) {
      Fixture f = small_model(tp, 2, 6);
      auto plan = make_plan(f.manifest, f.ranks, std::vector<SenderInfo>(static_cast<size_t>(senders)), PlanOptions{1 << 20});
      ASSERT_TRUE(plan.ok());
      uint64_t biggest = 0, total = 0;
      for (const Piece& pc : plan->pieces) {
        biggest = std::max(biggest, pc.bytes);
        total += pc.bytes;
      }
      EXPECT_EQ(total, plan->total_bytes);
      // The ideal split cannot beat the largest indivisible piece.
      const double ideal = std::max(static_cast<double>(total) / senders, static_cast<double>(biggest));
      const uint64_t max_load = *std::max_element(plan->bytes_per_sender.begin(), plan->bytes_per_sender.end());
      EXPECT_LE(static_cast<double>(max_load), 1.10 * ideal) << senders << " senders, tp " << tp;
    }
  }
}

TEST(Planner, BalancedOnAPresetAtScale) {
  auto desc = preset_model("qwen3-30b-a3b");
  ASSERT_TRUE(desc.ok());
  auto ranks = model_rank_specs(*desc, 2, 4, 4, Scheme::kFp8Block);
  ASSERT_TRUE(ranks.ok()) << ranks.status().to_string();
  auto plan = make_plan(model_manifest(*desc), *ranks, std::vector<SenderInfo>(32), PlanOptions{64 << 20});
  ASSERT_TRUE(plan.ok());
  const double ideal = static_cast<double>(plan->total_bytes) / 32;
  const uint64_t max_load = *std::max_element(plan->bytes_per_sender.begin(), plan->bytes_per_sender.end());
  EXPECT_LE(static_cast<double>(max_load), 1.10 * ideal);
}

TEST(Planner, ReplicatedPiecesFanOutOverSenders) {
  Fixture f = small_model(4, 2);
  auto plan = make_plan(f.manifest, f.ranks, std::vector<SenderInfo>(4), PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  for (size_t s = 0; s < f.manifest.size(); ++s) {
    if (f.manifest[s].name.find("layernorm") == std::string::npos) continue;
    std::set<int> senders;
    for (int i : plan->by_source[s]) senders.insert(plan->pieces[static_cast<size_t>(i)].sender);
    EXPECT_EQ(plan->by_source[s].size(), 8u);  // 2 replicas x 4 ranks
    EXPECT_GT(senders.size(), 1u) << f.manifest[s].name;
  }
}

TEST(Planner, SendersOwningSubsetsSendOnlyWhatTheyOwn) {
  Fixture f = small_model(2, 1);
  std::vector<SenderInfo> senders(3);
  for (size_t i = 0; i < f.manifest.size(); ++i) senders[i % 3].owns.push_back(f.manifest[i].name);
  auto plan = make_plan(f.manifest, f.ranks, senders, PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  for (const Piece& pc : plan->pieces) EXPECT_EQ(pc.sender, pc.source % 3);
}

TEST(Planner, CacheReusesPlansAndKeysOnInputs) {
  Fixture f = small_model(2, 1);
  PlanCache cache;
  std::vector<SenderInfo> senders(2);
  auto a = cache.get(f.manifest, f.ranks, senders, PlanOptions{4096});
  auto b = cache.get(f.manifest, f.ranks, senders, PlanOptions{4096});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(cache.hits(), 1u);
  EXPECT_EQ(cache.misses(), 1u);
  auto c = cache.get(f.manifest, f.ranks, senders, PlanOptions{8192});  // other bucket size
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->get(), c->get());
  Fixture g = small_model(4, 1);  // other specs
  EXPECT_NE(plan_key(f.manifest, f.ranks, senders), plan_key(g.manifest, g.ranks, senders));
  f.ranks[1].params.edit()[3].scheme = Scheme::kFp8PerChannel;  // one scheme changes the key
  EXPECT_NE(plan_key(f.manifest, f.ranks, senders), a->get()->key);
  auto d = cache.get(f.manifest, f.ranks, senders, PlanOptions{4096});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(cache.misses(), 3u);
  EXPECT_EQ(cache.hits(), 1u);
}

// The same specs, each rank with buffers of its own: nothing shared between ranks.
std::vector<RankSpec> built_apart(const std::vector<RankSpec>& ranks) {
  std::vector<RankSpec> out = ranks;
  for (RankSpec& r : out) {
    r.params = CowVector<ParamSpec>(std::vector<ParamSpec>(r.params.get()));
    r.expects = CowVector<SourceTensor>(std::vector<SourceTensor>(r.expects.get()));
  }
  return out;
}

void expect_same_plan(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.source_order, b.source_order);
  ASSERT_EQ(a.pieces.size(), b.pieces.size());
  for (size_t i = 0; i < a.pieces.size(); ++i) {
    const Piece& x = a.pieces[i];
    const Piece& y = b.pieces[i];
    ASSERT_TRUE(x.dst == y.dst && x.param == y.param && x.slice == y.slice && x.source == y.source && x.src == y.src &&
                x.bytes == y.bytes && x.sender == y.sender && x.box == y.box)
        << "piece " << i;
  }
  EXPECT_EQ(a.by_source, b.by_source);
  EXPECT_EQ(a.bytes_per_sender, b.bytes_per_sender);
  EXPECT_EQ(a.bytes_per_dst, b.bytes_per_dst);
  EXPECT_EQ(a.total_bytes, b.total_bytes);
  EXPECT_EQ(a.max_row_bytes, b.max_row_bytes);
  ASSERT_EQ(a.buckets.size(), b.buckets.size());
  for (size_t i = 0; i < a.buckets.size(); ++i) {
    const Bucket& x = a.buckets[i];
    const Bucket& y = b.buckets[i];
    ASSERT_TRUE(x.sender == y.sender && x.dst == y.dst && x.bytes == y.bytes && x.parts.size() == y.parts.size()) << i;
    for (size_t k = 0; k < x.parts.size(); ++k) {
      ASSERT_TRUE(x.parts[k].piece == y.parts[k].piece && x.parts[k].first_row == y.parts[k].first_row &&
                  x.parts[k].rows == y.parts[k].rows && x.parts[k].bytes == y.parts[k].bytes)
          << i << "/" << k;
    }
  }
}

// Identical replicas share their ranks' specs (model_rank_specs copies them), and the planner checks
// and walks a shared layout once: the plan must be the one that specs built apart give, whole
// tensors or boxes, dense or experts, with a rank written after it was copied.
TEST(Planner, SharedSpecsPlanAsSpecsBuiltApart) {
  struct Case {
    std::string name;
    Manifest manifest;
    std::vector<RankSpec> ranks;
    std::vector<SenderInfo> senders;
  };
  std::vector<Case> cases;
  {
    Fixture f = small_model(2, 3);
    cases.push_back({"dense, whole", f.manifest, f.ranks, std::vector<SenderInfo>(3)});
    std::vector<SenderInfo> fsdp;
    for (int r = 0; r < 3; ++r) fsdp.push_back(fsdp_holdings(f.manifest, r, 3));
    cases.push_back({"dense, fsdp", f.manifest, f.ranks, fsdp});
    Fixture g = small_model(4, 2);
    g.ranks[5].params.edit()[3].scheme = Scheme::kFp8PerChannel;  // written after the copy
    cases.push_back({"dense, one rank written", g.manifest, g.ranks, std::vector<SenderInfo>(2)});
  }
  {
    auto desc = preset_model("qwen3-30b-a3b");
    ASSERT_TRUE(desc.ok());
    ModelDesc small = *desc;
    small.params.resize(40);  // the embedding and the first layers' attention and experts
    auto ranks = model_rank_specs(small, 2, 4, 2, Scheme::kFp8Block);
    ASSERT_TRUE(ranks.ok()) << ranks.status().to_string();
    const Manifest manifest = model_manifest(small);
    std::vector<SenderInfo> ep;
    for (int r = 0; r < 4; ++r) ep.push_back(expert_holdings(manifest, r, 4));
    cases.push_back({"experts, ep", manifest, *ranks, ep});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const size_t tp = static_cast<size_t>(c.ranks[0].tp_size);
    ASSERT_GT(c.ranks.size(), tp);
    EXPECT_TRUE(c.ranks[0].params.shares(c.ranks[tp].params));  // replica 1's rank 0 is replica 0's
    const std::vector<RankSpec> apart = built_apart(c.ranks);
    EXPECT_FALSE(apart[0].params.shares(apart[tp].params));
    auto shared = make_plan(c.manifest, c.ranks, c.senders, PlanOptions{1 << 16});
    auto separate = make_plan(c.manifest, apart, c.senders, PlanOptions{1 << 16});
    ASSERT_TRUE(shared.ok()) << shared.status().to_string();
    ASSERT_TRUE(separate.ok()) << separate.status().to_string();
    expect_same_plan(*shared, *separate);
  }
}

// A rank that shares its parameters with a checked one but expects other tensors is checked anew.
TEST(Planner, ASharedRankWithOtherTensorsIsChecked) {
  Fixture f = small_model(2, 2);
  ASSERT_TRUE(f.ranks[0].params.shares(f.ranks[2].params));
  f.ranks[2].expects.edit()[0].shape = {7, 7};
  auto plan = make_plan(f.manifest, f.ranks, std::vector<SenderInfo>(1), PlanOptions{1 << 16});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("replica 1 rank 0 expects"), std::string::npos) << plan.status().to_string();
  EXPECT_NE(plan.status().message().find(f.ranks[2].expects[0].name), std::string::npos);
}

// Specs that arrive apart (over the wire, one per rank) share when equal, and only then.
TEST(Planner, SpecsBuiltApartShareWhenEqual) {
  Fixture f = small_model(2, 2);
  std::vector<RankSpec> apart = built_apart(f.ranks);
  ASSERT_FALSE(apart[2].params.shares(apart[0].params));
  EXPECT_TRUE(share_layout(apart[2], apart[0]));  // replica 1's rank 0 is replica 0's
  EXPECT_TRUE(apart[2].params.shares(apart[0].params));
  EXPECT_TRUE(apart[2].expects.shares(apart[0].expects));
  EXPECT_FALSE(share_layout(apart[3], apart[0]));  // rank 1 holds other shards
  EXPECT_FALSE(apart[3].params.shares(apart[0].params));
  apart[3].params.edit()[0].name += ".other";
  EXPECT_FALSE(share_layout(apart[3], apart[1]));
  EXPECT_EQ(apart[3].params[0].name, f.ranks[3].params[0].name + ".other");
  // Among many, the one of the same TP rank (rank 1 of replica 1 finds rank 1 of replica 0).
  std::vector<RankSpec> again = built_apart(f.ranks);
  const std::vector<const RankSpec*> others{&again[0], &again[1], &again[3]};
  EXPECT_TRUE(share_with_alike(again[3], others));  // itself is skipped
  EXPECT_TRUE(again[3].params.shares(again[1].params));
  EXPECT_FALSE(again[3].params.shares(again[0].params));
  auto shared = make_plan(f.manifest, f.ranks, std::vector<SenderInfo>(2), PlanOptions{1 << 16});
  std::vector<RankSpec> mixed = built_apart(f.ranks);
  ASSERT_TRUE(share_layout(mixed[2], mixed[0]));
  auto after = make_plan(f.manifest, mixed, std::vector<SenderInfo>(2), PlanOptions{1 << 16});
  ASSERT_TRUE(shared.ok() && after.ok());
  expect_same_plan(*shared, *after);
}

}  // namespace
}  // namespace ferry::sharding
