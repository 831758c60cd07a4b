// A Megatron-Core trainer of a Qwen3-MoE-shaped model, four ranks of TP 2 and EP 2 (expert TP 1 or
// 2), each its own Trainer over real sockets sending from its fused local tensors (linear_qkv,
// linear_fc1, the grouped experts' linear_fc1.weight{i} / linear_fc2.weight{i}), built here from
// Megatron's definitions (tests/common/megatron_shards.h), into a TP-2 / EP-2 replica: every
// element of every rank lands where the rank specs place it.
#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/trainer.h"
#include "sharding/presets.h"
#include "sharding/source_layout.h"
#include "tests/common/megatron_shards.h"
#include "tests/sharding/update_fixture.h"

namespace ferry::sharding {
namespace {

using fixture::check_storage;
using fixture::Replica;
using fixture::Weights;

// Qwen3-MoE with every size scaled down: 4 experts, layer 0 dense (mlp_only_layers), layer 1 MoE.
constexpr const char* kTinyQwen3Moe = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
  "mlp_only_layers": [0], "vocab_size": 300, "num_hidden_layers": 2, "torch_dtype": "bfloat16"})";

class MegatronMoe : public ::testing::TestWithParam<int> {};  // expert TP

TEST_P(MegatronMoe, FourRanksOfTp2Ep2UpdateATp2Ep2Replica) {
  const int etp = GetParam(), n = 4;
  auto cfg = parse_hf_config(kTinyQwen3Moe);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  ASSERT_TRUE(cfg->layer_is_moe(1) && !cfg->layer_is_moe(0));
  auto model = describe_model(*cfg);
  ASSERT_TRUE(model.ok());
  const Manifest manifest = model_manifest(*model);
  Replica r;
  ASSERT_TRUE(r.start(*model, 2, 2, Scheme::kNone).ok());  // its trainer is only the coordinator's host here
  std::vector<std::unique_ptr<coordinator::Trainer>> ranks;
  for (int t = 0; t < n; ++t) {
    coordinator::TrainerOptions o;
    o.coordinator = r.trainer->coordinator_address();
    o.trainer_rank = t;
    o.trainer_ranks = n;
    auto tr = coordinator::Trainer::create(o);
    ASSERT_TRUE(tr.ok()) << tr.status().to_string();
    ranks.push_back(std::move(*tr));
  }
  for (uint32_t version : {1, 2}) {
    const Weights w(manifest, 11 + version);
    const auto source = [&w](const std::string& name) {
      const auto& b = w.bytes.at(name);
      return std::span<const uint16_t>(reinterpret_cast<const uint16_t*>(b.data()), b.size() / 2);
    };
    std::vector<Status> result(n);
    std::vector<std::thread> threads;
    for (int t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        auto place = megatron_rank(t, n, 2, 1, 2, etp, nullptr);
        if (!place.ok()) {
          result[t] = place.status();
          return;
        }
        coordinator::UpdateOptions u;
        auto layout = megatron_layout(*cfg, *place);
        if (!layout.ok()) {
          result[t] = layout.status();
          return;
        }
        u.source_layout = std::move(*layout);
        const testutil::MegatronShards local(*cfg, source, *place);
        result[t] = ranks[t]->start_weight_update(version, manifest, u);
        coordinator::MapSource src(local.views);
        if (result[t].ok()) result[t] = ranks[t]->update_weights(src);
        if (result[t].ok()) result[t] = ranks[t]->finish_weight_update().status();
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < n; ++t) {
      ASSERT_TRUE(result[t].ok()) << "trainer rank " << t << " v" << version << ": " << result[t].to_string();
    }
    EXPECT_EQ(check_storage(r, w), "") << "v" << version;
  }
}

INSTANTIATE_TEST_SUITE_P(ExpertTp, MegatronMoe, ::testing::Values(1, 2));

}  // namespace
}  // namespace ferry::sharding
