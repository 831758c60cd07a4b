// A tiny DeepSeek-V3-shaped model from its config.json, planned and updated in one process: a
// trainer (embedding the coordinator) and the ranks of one replica over real sockets. With the
// `none` scheme every element of every rank's storage is checked against the trainer's tensors
// where the rank spec places it; with fp8 the update completes with the census at 0 moved.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "sharding/planner.h"
#include "sharding/presets.h"
#include "sharding/trainer_layouts.h"
#include "tests/sharding/update_fixture.h"

namespace ferry::sharding {
namespace {

using fixture::box_index;
using fixture::check_storage;
using fixture::element;
using fixture::Replica;
using fixture::Weights;

// DeepSeek-V3's config.json with every size scaled down (4 heads, 4 routed experts, layer 0 dense).
constexpr const char* kTinyDeepseekV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
  "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 1,
  "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 4,
  "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
  "v_head_dim": 8, "num_hidden_layers": 2, "vocab_size": 100, "tie_word_embeddings": false,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "dtype": "bfloat16"
})";

class DeepseekV3Update : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DeepseekV3Update, EveryElementLandsWhereTheSpecPlacesIt) {
  const auto [tp, ep] = GetParam();
  auto model = model_from_json(kTinyDeepseekV3);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const Manifest manifest = model_manifest(*model);
  Replica r;
  const Status started = r.start(*model, tp, ep, Scheme::kNone);
  ASSERT_TRUE(started.ok()) << started.to_string();
  for (uint64_t version : {1, 2}) {
    const Weights w(manifest);
    auto report = r.update(version, manifest, w);
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->ranks, tp);
    EXPECT_EQ(report->moved, 0u);
    EXPECT_EQ(check_storage(r, w), "");
  }
}

INSTANTIATE_TEST_SUITE_P(TpEp, DeepseekV3Update,
                         ::testing::Values(std::tuple{1, 1}, std::tuple{2, 1}, std::tuple{2, 2}));

TEST(DeepseekV3Update, Fp8PerChannel) {
  auto model = model_from_json(kTinyDeepseekV3);
  ASSERT_TRUE(model.ok());
  const Manifest manifest = model_manifest(*model);
  Replica r;
  const Status started = r.start(*model, 2, 2, Scheme::kFp8PerChannel);
  ASSERT_TRUE(started.ok()) << started.to_string();
  auto report = r.update(1, manifest, Weights(manifest));
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->moved, 0u);
  EXPECT_GT(report->registered, 0u);
}

// The stacked tensors of `stacked` (stack_experts) assembled from the per-expert tensors of `w`, as
// transformers' fused experts hold them: expert e's sources' rows one after another.
Weights stack(const ModelDesc& per_expert, const ModelDesc& stacked, const Weights& w) {
  const Manifest m = model_manifest(stacked);
  Weights out(m);
  for (size_t k = 0; k < per_expert.params.size(); ++k) {
    const ParamRule& r = per_expert.params[k];
    if (r.layout != Layout::kExperts) continue;
    auto& dst = out.bytes.at(stacked.params[k].stacked);
    size_t at = 0;
    for (int64_t e = 0; e < r.num_experts; ++e) {
      for (const std::string& tmpl : r.sources) {
        const auto& src = w.bytes.at(expert_name(tmpl, e));
        std::memcpy(dst.data() + at, src.data(), src.size());
        at += src.size();
      }
    }
  }
  for (const auto& t : m) {
    if (w.bytes.contains(t.name)) out.bytes.at(t.name) = w.bytes.at(t.name);
  }
  return out;
}

// A trainer that holds each layer's experts stacked (gate_up_proj, down_proj) updates the replica
// into the same bytes as one that holds a tensor per expert, from one plan piece per stacked tensor
// and rank (per source when TP splits the experts): every storage tensor of every rank is compared
// byte for byte, under each scheme, and with `none` every element against the spec as well.
class StackedExperts : public ::testing::TestWithParam<std::tuple<int, int, Scheme>> {};

TEST_P(StackedExperts, UpdateTheSameBytesAsPerExpertTensors) {
  const auto [tp, ep, scheme] = GetParam();
  auto model = model_from_json(kTinyDeepseekV3);
  ASSERT_TRUE(model.ok());
  ModelDesc stacked = *model;
  ASSERT_TRUE(stack_experts(stacked).ok());
  const Manifest manifest = model_manifest(*model), stacked_manifest = model_manifest(stacked);
  ASSERT_LT(stacked_manifest.size(), manifest.size());
  // The plan's expert pieces: per stacked tensor and rank (w13: per source when TP splits experts),
  // against two per expert and rank for w13 and one for w2.
  auto expert_pieces = [&](const ModelDesc& d) -> size_t {
    auto specs = model_rank_specs(d, 1, tp, ep, scheme);
    if (!specs.ok()) return 0;
    auto plan = make_plan(model_manifest(d), *specs, {SenderInfo{}}, PlanOptions{});
    if (!plan.ok()) return 0;
    return static_cast<size_t>(std::count_if(plan->pieces.begin(), plan->pieces.end(), [&](const Piece& pc) {
      return (*specs)[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)].name.find(".experts.w") !=
             std::string::npos;
    }));
  };
  const size_t per_group = static_cast<size_t>(tp / ep);
  EXPECT_EQ(expert_pieces(stacked), static_cast<size_t>(tp) * (per_group == 1 ? 2 : 3));  // one MoE layer
  EXPECT_EQ(expert_pieces(*model), static_cast<size_t>(4 / ep) * 3 * static_cast<size_t>(tp));
  Replica a, b;
  const Status sa = a.start(*model, tp, ep, scheme), sb = b.start(stacked, tp, ep, scheme);
  ASSERT_TRUE(sa.ok()) << sa.to_string();
  ASSERT_TRUE(sb.ok()) << sb.to_string();
  for (uint32_t version : {1, 2}) {
    const Weights w(manifest, version);
    const Weights ws = stack(*model, stacked, w);
    auto ra = a.update(version, manifest, w);
    ASSERT_TRUE(ra.ok()) << ra.status().to_string();
    auto rb = b.update(version, stacked_manifest, ws);
    ASSERT_TRUE(rb.ok()) << rb.status().to_string();
    EXPECT_EQ(rb->moved, 0u);
    EXPECT_EQ(rb->registered, ra->registered);

    if (scheme == Scheme::kNone) {
      EXPECT_EQ(check_storage(b, ws), "");
    }
    for (size_t i = 0; i < a.storage.size(); ++i) {
      for (const auto& [name, t] : a.storage[i]->tensors()) {
        auto other = b.storage[i]->get(name);
        ASSERT_TRUE(other.ok()) << name;
        ASSERT_EQ(other->nbytes(), t.nbytes()) << name;
        EXPECT_EQ(std::memcmp(other->data(), t.data(), t.nbytes()), 0) << "rank " << i << " " << name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TpEpScheme, StackedExperts,
                         ::testing::Values(std::tuple{1, 1, Scheme::kNone}, std::tuple{2, 1, Scheme::kNone},
                                           std::tuple{2, 2, Scheme::kNone}, std::tuple{1, 1, Scheme::kFp8PerChannel},
                                           std::tuple{2, 1, Scheme::kFp8PerChannel}, std::tuple{2, 2, Scheme::kFp8Block},
                                           std::tuple{1, 1, Scheme::kFp8Block}, std::tuple{2, 1, Scheme::kFp8Block}));

// vLLM's layout of per-tensor fp8 for stacked experts: one scale per local expert over its merged
// gate and up matrix (w13_weight_scale [E]), as Fp8PerTensorOnlineMoEMethod keeps it: each equals
// the largest |x| of the trainer's tensors the spec places in that expert, / 448.
TEST(DeepseekV3Update, VllmLayoutKeepsOnePerTensorScalePerExpert) {
  auto model = model_from_json(kTinyDeepseekV3);
  ASSERT_TRUE(model.ok());
  const Manifest manifest = model_manifest(*model);
  Replica r;
  const Status started = r.start(*model, 2, 2, Scheme::kFp8PerTensor, EngineLayout::kVllm);
  ASSERT_TRUE(started.ok()) << started.to_string();
  const Weights w(manifest);
  auto report = r.update(1, manifest, w);
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->moved, 0u);
  int checked = 0;
  for (size_t i = 0; i < r.specs.size(); ++i) {
    for (const auto& p : r.specs[i].params) {
      if (!p.name.ends_with("experts.w13_weight") && !p.name.ends_with("experts.w2_weight")) continue;
      auto scale = r.storage[i]->get(p.name + "_scale");  // w13_weight -> w13_weight_scale
      ASSERT_TRUE(scale.ok()) << scale.status().to_string();
      ASSERT_EQ(scale->shape(), Shape{p.shape[0]}) << p.name;
      std::vector<float> amax(static_cast<size_t>(p.shape[0]), 0.0f);
      for (const auto& sl : p.slices) {
        const TensorView& src = w.views.at(sl.source);
        for (int64_t k = 0; k < sl.src.numel(); ++k) {
          float& m = amax[static_cast<size_t>(sl.dst_offset[0])];
          m = std::max(m, std::fabs(element(src, box_index(src.shape(), sl.src, k))));
        }
      }
      for (int64_t e = 0; e < p.shape[0]; ++e, ++checked) {
        EXPECT_EQ(scale->data_as<float>()[e], amax[static_cast<size_t>(e)] / 448.0f) << p.name << " expert " << e;
      }
    }
  }
  EXPECT_GT(checked, 0);
}

// An expert-parallel trainer of two ranks (routed experts split between them, every other tensor
// Shard(0) over both: expert_holdings), each rank its own Trainer over real sockets and sending only
// its local tensors, into a TP-2 / EP-2 replica: every element lands where the spec places it.
TEST(DeepseekV3Update, ExpertParallelTrainerRanksUpdateATp2Ep2Replica) {
  auto model = model_from_json(kTinyDeepseekV3);
  ASSERT_TRUE(model.ok());
  const Manifest manifest = model_manifest(*model);
  Replica r;
  ASSERT_TRUE(r.start(*model, 2, 2, Scheme::kNone).ok());  // its trainer is only the coordinator's host here
  std::unique_ptr<coordinator::Trainer> ranks[2];
  for (int t = 0; t < 2; ++t) {
    coordinator::TrainerOptions o;
    o.coordinator = r.trainer->coordinator_address();
    o.trainer_rank = t;
    o.trainer_ranks = 2;
    auto tr = coordinator::Trainer::create(o);
    ASSERT_TRUE(tr.ok()) << tr.status().to_string();
    ranks[t] = std::move(*tr);
  }
  for (uint64_t version : {1, 2}) {
    const Weights w(manifest);
    Status result[2];
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        coordinator::UpdateOptions u;
        u.holdings = expert_holdings(manifest, t, 2);
        // This rank's local tensors: its rows of each Shard(0) box, its experts whole.
        std::map<std::string, std::vector<char>> local;
        std::map<std::string, TensorView> views;
        for (const auto& name : u.holdings.owns) views.emplace(name, w.views.at(name));
        for (const auto& h : u.holdings.holds) {
          const TensorView& whole = w.views.at(h.name);
          const size_t row = whole.nbytes() / static_cast<size_t>(std::max<int64_t>(whole.shape()[0], 1));
          auto& bytes = local[h.name];
          const char* from = static_cast<const char*>(whole.data()) + static_cast<size_t>(h.region.offset[0]) * row;
          bytes.assign(from, from + static_cast<size_t>(h.region.size[0]) * row);
          views.emplace(h.name, TensorView(bytes.data(), whole.dtype(), h.region.size));
        }
        result[t] = ranks[t]->start_weight_update(version, manifest, u);
        coordinator::MapSource src(views);
        if (result[t].ok()) result[t] = ranks[t]->update_weights(src);
        if (result[t].ok()) result[t] = ranks[t]->finish_weight_update().status();
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < 2; ++t) ASSERT_TRUE(result[t].ok()) << "trainer rank " << t << " v" << version << ": " << result[t].to_string();
    EXPECT_EQ(check_storage(r, w), "");
  }
}

}  // namespace
}  // namespace ferry::sharding
