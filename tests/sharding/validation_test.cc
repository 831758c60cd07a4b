// Every kind of mismatch is refused before a byte moves, and the error names the tensor.
#include <gtest/gtest.h>

#include "sharding/layout.h"
#include "sharding/llama.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"

namespace ferry::sharding {
namespace {

ModelConfig cfg() {
  ModelConfig c;
  c.family = "llama";
  c.hidden_size = 256;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.intermediate_size = 512;
  c.vocab_size = 300;
  c.num_layers = 2;
  return c;
}

struct Cluster {
  Manifest manifest;
  std::vector<RankSpec> ranks;
};

Cluster make_cluster(const ModelConfig& c, int tp, Scheme scheme = Scheme::kNone) {
  auto d = describe_model(c);
  EXPECT_TRUE(d.ok());
  auto r = model_rank_specs(*d, 1, tp, 1, scheme);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return {model_manifest(*d), r.ok() ? std::move(*r) : std::vector<RankSpec>{}};
}

void expect_error(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
}

TEST(Validation, UnknownTensorFromTrainer) {
  Cluster s = make_cluster(cfg(), 2);
  s.manifest.push_back({"model.layers.0.mlp.extra.weight", DType::kBF16, {4, 4}});
  expect_error(make_plan(s.manifest, s.ranks, {SenderInfo{}}).status(), StatusCode::kInvalidArgument,
               "model.layers.0.mlp.extra.weight");
}

TEST(Validation, TensorMissingFromTrainer) {
  Cluster s = make_cluster(cfg(), 2);
  s.manifest.erase(s.manifest.begin() + 3);
  const std::string name = make_cluster(cfg(), 2).manifest[3].name;
  expect_error(make_plan(s.manifest, s.ranks, {SenderInfo{}}).status(), StatusCode::kInvalidArgument, name);
}

TEST(Validation, ShapeMismatch) {
  Cluster s = make_cluster(cfg(), 2);
  for (auto& t : s.manifest) {
    if (t.name == "model.layers.1.mlp.down_proj.weight") t.shape = {256, 511};
  }
  const Status st = make_plan(s.manifest, s.ranks, {SenderInfo{}}).status();
  expect_error(st, StatusCode::kInvalidArgument, "model.layers.1.mlp.down_proj.weight");
  expect_error(st, StatusCode::kInvalidArgument, "[256, 511]");
}

TEST(Validation, DtypeMismatch) {
  Cluster s = make_cluster(cfg(), 2);
  s.manifest[0].dtype = DType::kF32;
  expect_error(make_plan(s.manifest, s.ranks, {SenderInfo{}}).status(), StatusCode::kInvalidArgument,
               "model.embed_tokens.weight");
}

// A gptq_int4 rank loads a GPTQ checkpoint, not a trainer's weights: a trainer's plan for it is
// refused at start, naming the checkpoint tensor and what to use instead. Regression: the plan was
// made, the ranks paused, and each refused the trainer's f32 pieces on its packed codes at the end.
TEST(Validation, ATrainerCannotFeedAGptqRank) {
  Cluster s = make_cluster(cfg(), 2, Scheme::kGptqInt4);
  ASSERT_FALSE(s.ranks.empty());
  const Status st = make_plan(s.manifest, s.ranks, {SenderInfo{}}).status();
  expect_error(st, StatusCode::kInvalidArgument, "tensor model.layers.0.self_attn.q_proj.weight");
  expect_error(st, StatusCode::kInvalidArgument, "GPTQ checkpoint");
  expect_error(st, StatusCode::kInvalidArgument, "int4_group");
}

TEST(Validation, GroupSizeThatDoesNotDivideTheShard) {
  // down_proj has 512 input columns: TP 2 gives 256 per rank (fine), TP 8 gives 64 (< one group of 128).
  EXPECT_TRUE(model_rank_spec(*describe_model(cfg()), 0, 2, 1, Scheme::kInt4Group).ok());
  auto bad = model_rank_spec(*describe_model(cfg()), 0, 8, 1, Scheme::kInt4Group);
  ASSERT_FALSE(bad.ok());
  expect_error(bad.status(), StatusCode::kInvalidArgument, "self_attn.o_proj.weight");
  expect_error(bad.status(), StatusCode::kInvalidArgument, "int4_group");
  // The Llama preset refuses it the same way.
  auto lc = to_llama_config(cfg());
  ASSERT_TRUE(lc.ok());
  expect_error(llama_rank_spec(*lc, 0, 8, Scheme::kInt4Group).status(), StatusCode::kInvalidArgument,
               "self_attn.o_proj.weight");
  // And the planner a spec edited by hand.
  std::vector<RankSpec> ranks;
  for (int r = 0; r < 8; ++r) {
    RankSpec spec = *llama_rank_spec(*lc, r, 8, Scheme::kNone);
    for (ParamSpec& p : spec.params.edit()) {
      if (p.name.ends_with("o_proj.weight")) p.scheme = Scheme::kInt4Group;
    }
    ranks.push_back(std::move(spec));
  }
  expect_error(make_plan(llama_manifest(*lc), ranks, {SenderInfo{}}).status(), StatusCode::kInvalidArgument,
               "model.layers.0.self_attn.o_proj.weight");
}

TEST(Validation, LayoutThatDoesNotSplit) {
  ModelConfig c = cfg();
  c.num_heads = 6;
  c.num_kv_heads = 3;
  expect_error(model_rank_spec(*describe_model(c), 0, 4, 1, Scheme::kNone).status(), StatusCode::kInvalidArgument,
               "self_attn.qkv_proj.weight");
  ModelConfig m = cfg();
  m.family = "qwen3_moe";
  m.num_experts = 6;
  m.moe_intermediate_size = 64;
  expect_error(model_rank_spec(*describe_model(m), 0, 4, 4, Scheme::kNone).status(), StatusCode::kInvalidArgument,
               "experts.w13_weight");
  expect_error(model_rank_spec(*describe_model(m), 0, 4, 3, Scheme::kNone).status(), StatusCode::kInvalidArgument,
               "does not divide TP");
}

TEST(Validation, MissingSender) {
  Cluster s = make_cluster(cfg(), 2);
  std::vector<SenderInfo> senders(2);
  for (size_t i = 1; i < s.manifest.size(); ++i) senders[i % 2].owns.push_back(s.manifest[i].name);
  expect_error(make_plan(s.manifest, s.ranks, senders).status(), StatusCode::kInvalidArgument,
               s.manifest[0].name + ": no sender holds it");
  senders[0].owns.push_back("model.nothing.weight");
  expect_error(make_plan(s.manifest, s.ranks, senders).status(), StatusCode::kInvalidArgument, "model.nothing.weight");
  expect_error(make_plan(s.manifest, s.ranks, {}).status(), StatusCode::kInvalidArgument, "sender");
}

TEST(Validation, OverlappingSlicesInAHandWrittenSpec) {
  Cluster s = make_cluster(cfg(), 1);
  ParamSpec& qkv = s.ranks[0].params.edit()[2];
  ASSERT_EQ(qkv.name, "model.layers.0.self_attn.qkv_proj.weight");
  qkv.slices[1].dst_offset[0] -= 1;  // k lands one row into q
  expect_error(make_plan(s.manifest, s.ranks, {SenderInfo{}}).status(), StatusCode::kInvalidArgument, "overlap");
}

}  // namespace
}  // namespace ferry::sharding
