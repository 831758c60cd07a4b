// `ferry plan --trainers N --layout ...`: sharded trainer ranks, each sending what it holds, beside
// gathering onto rank 0 and sending from there; `--layout whole` (the default) is the plan of N
// ranks that each hold everything.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/plan_command.h"

namespace ferry::cli {
namespace {

using ::testing::HasSubstr;

// The command's output for `args` (after "plan"); throws CLI::RuntimeError when it fails.
std::string run(std::vector<std::string> args) {
  CLI::App app("ferry");
  std::ostringstream out;
  add_plan_command(app, out);
  args.insert(args.begin(), "plan");
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  app.parse(args);
  return out.str();
}

nlohmann::json run_json(std::vector<std::string> args) {
  args.push_back("--json");
  return nlohmann::json::parse(run(args));
}

const std::vector<std::string> kLlama = {"--model", "llama3-8b", "--trainers", "4", "--replicas", "2", "--tp", "2"};

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(PlanLayouts, WholeIsTheDefault) {
  const auto a = run_json(kLlama);
  const auto b = run_json(with(kLlama, {"--layout", "whole"}));
  EXPECT_EQ(a["layout"], "whole");
  EXPECT_EQ(a["predicted_seconds"], b["predicted_seconds"]);
  EXPECT_EQ(a["bytes_per_sender"], b["bytes_per_sender"]);
  EXPECT_FALSE(a.contains("gather"));
  EXPECT_EQ(a["bytes_per_sender"].size(), 4u);
}

TEST(PlanLayouts, ShardedRanksSendTheirOwnBesideGatherThenSend) {
  const auto whole = run_json(kLlama);
  for (const char* layout : {"fsdp", "hsdp", "pipeline"}) {
    const auto j = run_json(with(kLlama, {"--layout", layout, "--shard-group", "2"}));
    EXPECT_EQ(j["layout"], layout);
    const auto per = j["bytes_per_sender"].get<std::vector<uint64_t>>();
    ASSERT_EQ(per.size(), 4u) << layout;
    // Every byte of the plan leaves one sender: the same total as when every rank holds everything.
    const uint64_t sum = std::accumulate(per.begin(), per.end(), uint64_t{0});
    const auto wper = whole["bytes_per_sender"].get<std::vector<uint64_t>>();
    EXPECT_EQ(sum, std::accumulate(wper.begin(), wper.end(), uint64_t{0})) << layout;
    EXPECT_EQ(j["sender_payload"]["min"].get<uint64_t>(), *std::min_element(per.begin(), per.end())) << layout;
    EXPECT_EQ(j["sender_payload"]["max"].get<uint64_t>(), *std::max_element(per.begin(), per.end())) << layout;
    EXPECT_EQ(j["max_sender_bytes"].get<uint64_t>(), *std::max_element(per.begin(), per.end())) << layout;  // bf16 wire
    EXPECT_GT(j["sender_payload"]["min"].get<uint64_t>(), 0u) << layout;
    // Gather then send: the one-sender plan plus the gather, slower than every rank sending its own.
    EXPECT_GT(j["gather"]["seconds"].get<double>(), 0) << layout;
    EXPECT_DOUBLE_EQ(j["gather_then_send_seconds"].get<double>(),
                     j["broadcast"]["predicted_seconds"].get<double>() + j["gather"]["seconds"].get<double>());
    EXPECT_GT(j["speedup_over_gather_then_send"].get<double>(), 1.0) << layout;
  }
  // FSDP2 rows are even but for the vocabulary: the senders within 10% of each other.
  EXPECT_LE(run_json(with(kLlama, {"--layout", "fsdp"}))["sender_imbalance"].get<double>(), 0.10);
}

TEST(PlanLayouts, ExpertParallelTrainerOfAnMoeModel) {
  const auto j = run_json({"--model", "qwen3-30b-a3b", "--trainers", "8", "--tp", "4", "--ep", "4", "--layout", "ep"});
  EXPECT_EQ(j["bytes_per_sender"].size(), 8u);
  EXPECT_GT(j["sender_payload"]["min"].get<uint64_t>(), 0u);
  EXPECT_LE(j["sender_imbalance"].get<double>(), 0.10);  // 16 of the 128 experts each, the rest Shard(0)
}

// The same trainer holding each layer's experts stacked: EP rank r holds rows [16 r, 16 r + 16)
// of every stacked tensor, so the senders' payloads are the per-expert plan's.
TEST(PlanLayouts, ExpertParallelTrainerOfStackedExperts) {
  const std::vector<std::string> args = {"--model", "qwen3-30b-a3b", "--trainers", "8", "--tp", "4", "--ep", "4",
                                         "--layout", "ep"};
  auto stacked_args = args;
  stacked_args.insert(stacked_args.end(), {"--experts", "stacked"});
  const auto per_expert = run_json(args), stacked = run_json(stacked_args);
  EXPECT_EQ(stacked["bytes_per_sender"], per_expert["bytes_per_sender"]);
  EXPECT_LT(stacked["pieces"].get<uint64_t>(), per_expert["pieces"].get<uint64_t>() / 2);  // 11,190 against 28,854
}

TEST(PlanLayouts, TextShowsBothSidesAndEverySenderOnRequest) {
  const std::string text = run(with(kLlama, {"--layout", "fsdp", "--per-sender"}));
  EXPECT_THAT(text, HasSubstr("layout fsdp"));
  EXPECT_THAT(text, HasSubstr("gather to rank 0, send"));
  EXPECT_THAT(text, HasSubstr("sharded (fsdp)"));
  EXPECT_THAT(text, HasSubstr("gather onto rank 0"));
  EXPECT_THAT(text, HasSubstr("per-sender payload (source dtype): min"));
  EXPECT_THAT(text, HasSubstr("payload per sender (source dtype):\n      0"));
  EXPECT_THAT(text, HasSubstr("\n      3 "));
  // The default layout's table is the one it always was.
  EXPECT_THAT(run(kLlama), HasSubstr("broadcast from rank 0"));
}

// Megatron-Core's trainer: DP x PP x TP ranks holding its fused linear_qkv / linear_fc1 shards
// (sharding::megatron_layout), the data-parallel groups holding copies the plan balances.
TEST(PlanLayouts, MegatronTrainers) {
  const auto whole = run_json(kLlama);
  const auto wper = whole["bytes_per_sender"].get<std::vector<uint64_t>>();
  const uint64_t total = std::accumulate(wper.begin(), wper.end(), uint64_t{0});
  for (const char* layout : {"megatron-tp2", "megatron-tp4", "megatron-tp2-pp2", "megatron-tp1-pp4"}) {
    const auto j = run_json(with(kLlama, {"--layout", layout}));
    EXPECT_EQ(j["layout"], layout);
    const auto per = j["bytes_per_sender"].get<std::vector<uint64_t>>();
    ASSERT_EQ(per.size(), 4u) << layout;
    EXPECT_EQ(std::accumulate(per.begin(), per.end(), uint64_t{0}), total) << layout;
    EXPECT_GT(j["sender_payload"]["min"].get<uint64_t>(), 0u) << layout;
    EXPECT_GT(j["speedup_over_gather_then_send"].get<double>(), 1.0) << layout;
  }
  // TP 2 in two data-parallel copies: the copies share the sending, each TP rank's half split in two.
  EXPECT_LE(run_json(with(kLlama, {"--layout", "megatron-tp2"}))["sender_imbalance"].get<double>(), 0.10);
  // Megatron's rank order puts the pipeline stages outermost: of 8 ranks as TP 2 x DP 2 x PP 2,
  // ranks 0-3 are stage 0, which holds the (tied) embedding, and 4-7 stage 1.
  const auto staged = run_json({"--model", "llama3.2-1b", "--trainers", "8", "--layout", "megatron-tp2-pp2"});
  const auto bytes = staged["bytes_per_sender"].get<std::vector<uint64_t>>();
  ASSERT_EQ(bytes.size(), 8u);
  const uint64_t first = std::accumulate(bytes.begin(), bytes.begin() + 4, uint64_t{0});
  const uint64_t second = std::accumulate(bytes.begin() + 4, bytes.end(), uint64_t{0});
  EXPECT_GT(static_cast<double>(first), 1.2 * static_cast<double>(second));
  EXPECT_THROW(run({"--model", "llama3.2-1b", "--trainers", "3", "--layout", "megatron-tp1-pp3"}), CLI::RuntimeError);  // 16 layers
  // Qwen2's qkv biases and Qwen3's q/k norms are laid out too.
  for (const char* model : {"qwen2-7b", "qwen3-8b"}) {
    const auto j = run_json({"--model", model, "--trainers", "4", "--tp", "2", "--layout", "megatron-tp2"});
    EXPECT_EQ(j["bytes_per_sender"].size(), 4u) << model;
  }
  EXPECT_THROW(run(with(kLlama, {"--layout", "megatron-tp3"})), CLI::RuntimeError);  // 4 trainers
  EXPECT_THROW(run({"--model", "llama3-8b", "--trainers", "16", "--layout", "megatron-tp16"}), CLI::RuntimeError);  // 8 KV heads
  // Experts: Megatron's grouped experts, split over EP ranks (expert TP = TP unless given); every
  // byte of the model is sent once whatever the split.
  const auto moe_whole = run_json({"--model", "qwen3-30b-a3b", "--trainers", "8"});
  const auto moe_per = moe_whole["bytes_per_sender"].get<std::vector<uint64_t>>();
  const uint64_t moe_total = std::accumulate(moe_per.begin(), moe_per.end(), uint64_t{0});
  for (const char* layout :
       {"megatron-tp2", "megatron-tp2-ep4", "megatron-tp2-ep8-etp1", "megatron-tp4-pp2-ep2-etp2"}) {
    const auto j = run_json({"--model", "qwen3-30b-a3b", "--trainers", "8", "--layout", layout});
    const auto per = j["bytes_per_sender"].get<std::vector<uint64_t>>();
    ASSERT_EQ(per.size(), 8u) << layout;
    EXPECT_EQ(std::accumulate(per.begin(), per.end(), uint64_t{0}), moe_total) << layout;
    EXPECT_GT(j["sender_payload"]["min"].get<uint64_t>(), 0u) << layout;
  }
  EXPECT_THROW(run({"--model", "qwen3-30b-a3b", "--trainers", "6", "--layout", "megatron-tp2-ep3"}),
               CLI::RuntimeError);                                                       // 128 experts
  EXPECT_THROW(run(with(kLlama, {"--layout", "megatron-tp2-ep2"})), CLI::RuntimeError);  // no experts
  EXPECT_THROW(run({"--model", "kimi-k2", "--trainers", "8", "--layout", "megatron-tp2-ep4"}),
               CLI::RuntimeError);  // MLA
  EXPECT_THROW(run(with(kLlama, {"--layout", "megatron-tp0"})), CLI::ValidationError);
  for (const char* bad : {"megatron-tp2-pp", "megatron-tp02", "megatron-tp2-pp2x", "megatron-tp12345", "megatron-tp",
                          "megatron-tp2-ep", "megatron-tp2-ep2-etp", "megatron-tp2-etp2-ep2", "megatron-ep2"}) {
    EXPECT_THROW(run(with(kLlama, {"--layout", bad})), CLI::ValidationError) << bad;
  }
}

TEST(PlanLayouts, RefusesLayoutsThatDoNotFit) {
  EXPECT_THROW(run(with(kLlama, {"--layout", "ep"})), CLI::RuntimeError);  // a dense model has no experts
  EXPECT_THROW(run(with(kLlama, {"--layout", "hsdp", "--shard-group", "3"})), CLI::RuntimeError);  // 4 % 3
  EXPECT_THROW(run(with(kLlama, {"--layout", "tp"})), CLI::ValidationError);
}

}  // namespace
}  // namespace ferry::cli
