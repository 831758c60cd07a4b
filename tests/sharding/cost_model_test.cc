// The cost model against hand-computed link times, and `ferry plan` end to end.
#include <sstream>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/plan_command.h"
#include "sharding/cost_model.h"
#include "sharding/layout.h"
#include "sharding/planner.h"

namespace ferry::sharding {
namespace {

// One replicated tensor of `rows` x 1024 bf16, sent to `ranks` ranks of one replica.
struct Tiny {
  ModelDesc desc;
  Manifest manifest;
  std::vector<RankSpec> ranks;
};

Tiny tiny(int64_t rows, int tp, bool quantize) {
  Tiny t;
  ParamRule r;
  r.param = "model.layers.0.mlp.w.weight";
  r.sources = {r.param};
  r.shapes = {{rows, 1024}};
  r.layout = Layout::kColumn;
  r.quantize = quantize;
  t.desc.params.push_back(r);
  t.manifest = model_manifest(t.desc);
  t.ranks = *model_rank_specs(t.desc, 1, tp, 1, quantize ? Scheme::kFp8PerChannel : Scheme::kNone);
  return t;
}

// The link fit from two timed runs recovers a link's rate and fixed cost, so that the model's time
// for the large run (bytes at the rate plus its buckets' fixed cost) is the time it was measured
// to take. The rate of the large run alone (bytes over time) would count its fixed cost twice.
TEST(LinkFit, RecoversRateAndFixedCostFromTwoRuns) {
  const double rate = 40e9, fixed = 15e-6;
  const double big_bytes = 2 * 64.0 * (1 << 20), small_bytes = 2 * 4096.0;
  const double t_big = big_bytes / rate + 2 * fixed, t_small = small_bytes / rate + 2 * fixed;
  auto fit = fit_link(big_bytes, 2, t_big, small_bytes, 2, t_small);
  ASSERT_TRUE(fit.ok()) << fit.status().to_string();
  EXPECT_NEAR(fit->bytes_per_second, rate, rate * 1e-9);
  EXPECT_NEAR(fit->seconds_per_bucket, fixed, 1e-12);
  EXPECT_NEAR(big_bytes / fit->bytes_per_second + 2 * fit->seconds_per_bucket, t_big, 1e-12);
  // Runs of different bucket counts (the e2e bench: many small buckets, the plan's large ones).
  fit = fit_link(1e9, 16, 1e9 / rate + 16 * fixed, 256 * 4096.0, 256, 256 * 4096.0 / rate + 256 * fixed);
  ASSERT_TRUE(fit.ok());
  EXPECT_NEAR(fit->bytes_per_second, rate, rate * 1e-9);
  EXPECT_NEAR(fit->seconds_per_bucket, fixed, 1e-12);
}

TEST(LinkFit, NoiseThatLeavesNoPositiveRateOrCostIsUnavailable) {
  // The small run took longer per bucket than the large one: no positive rate fits.
  EXPECT_EQ(fit_link(1e8, 2, 1e-3, 8192, 2, 2e-3).status().code(), StatusCode::kUnavailable);
  // The small run was faster than its bytes allow at the large run's rate: negative fixed cost.
  EXPECT_EQ(fit_link(1e8, 2, 1e-2, 1e7, 2, 1e-4).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(fit_link(1e8, 0, 1e-2, 8192, 2, 1e-4).status().code(), StatusCode::kInvalidArgument);
}

TEST(CostModel, OneSenderOneReceiverAcrossNodesIsNicBound) {
  Tiny t = tiny(1024, 1, false);  // 2 MiB
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 20});
  ASSERT_TRUE(plan.ok());
  Topology topo;
  topo.nic_gbps = 100;
  topo.pcie_gbps = 200;
  topo.seconds_per_bucket = 1e-3;
  auto cost = estimate_cost(*plan, t.ranks, 1, topo);
  ASSERT_TRUE(cost.ok());
  const double bytes = 1024.0 * 1024 * 2;
  EXPECT_EQ(cost->bytes_moved, static_cast<uint64_t>(bytes));
  EXPECT_EQ(cost->max_link_bytes, static_cast<uint64_t>(bytes));
  // The 2 MiB piece is cut by rows into two 1 MiB buckets; the NIC at 100 Gb/s is the slower link.
  EXPECT_EQ(cost->buckets, 2u);
  EXPECT_NEAR(cost->predicted_seconds, bytes * 8 / 100e9 + 2e-3, 1e-9);
  EXPECT_NE(cost->busiest.front().link.find("nic"), std::string::npos);
  EXPECT_NEAR(cost->receiver_bound_seconds, bytes * 8 / 100e9, 1e-9);
}

TEST(CostModel, InsideOneNodeUsesNvlink) {
  Tiny t = tiny(1024, 1, false);
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 22});
  ASSERT_TRUE(plan.ok());
  Topology topo;
  topo.colocated = true;
  topo.nvlink_gbps = 1000;
  topo.seconds_per_bucket = 0;
  auto same_gpu = estimate_cost(*plan, t.ranks, 1, topo);  // sender 0 and rank 0 share GPU 0
  ASSERT_TRUE(same_gpu.ok());
  EXPECT_EQ(same_gpu->predicted_seconds, 0.0);
  auto two = make_plan(t.manifest, t.ranks, {SenderInfo{{"x"}, {}}, SenderInfo{}}, PlanOptions{1 << 22});
  EXPECT_FALSE(two.ok());  // sender 0 owns an unknown tensor
  std::vector<SenderInfo> senders(2);
  senders[0].owns = {"model.layers.0.mlp.w.weight"};
  senders[1].owns = {"model.layers.0.mlp.w.weight"};
  auto plan2 = make_plan(t.manifest, t.ranks, senders, PlanOptions{1 << 22});
  ASSERT_TRUE(plan2.ok());
  // Force the piece onto sender 1 (GPU 1, same node as rank 0 on GPU 0): NVLink.
  Plan p = *plan2;
  p.pieces[0].sender = 1;
  p.buckets = cut_buckets(p, 1 << 22);
  auto nv = estimate_cost(p, t.ranks, 2, topo);
  ASSERT_TRUE(nv.ok());
  EXPECT_NEAR(nv->predicted_seconds, 2.0 * 1024 * 1024 * 8 / 1000e9, 1e-12);
  EXPECT_NE(nv->busiest.front().link.find("nvlink"), std::string::npos);
}

// Ranks placed by hand: a TP-2 replica whose two ranks share GPU 1, fed by trainer GPU 0 over
// NVLink. GPU 1's receiving link carries both ranks' bytes, so it (or the sender's, carrying the
// same bytes) bounds the update; a GPU list of the wrong length is refused.
TEST(CostModel, RanksPlacedOnOneGpuShareItsLinks) {
  Tiny t = tiny(1024, 2, false);  // each rank gets 512 rows: 1 MiB
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 22});
  ASSERT_TRUE(plan.ok());
  Topology topo;
  topo.gpus_per_node = 2;
  topo.nvlink_gbps = 800;
  topo.seconds_per_bucket = 1e-4;
  topo.rank_gpus = {1, 1};
  auto cost = estimate_cost(*plan, t.ranks, 1, topo);
  ASSERT_TRUE(cost.ok()) << cost.status().to_string();
  const double bytes = 1024.0 * 1024 * 2;
  EXPECT_EQ(cost->max_link_bytes, static_cast<uint64_t>(bytes));
  EXPECT_EQ(cost->buckets, 2u);
  EXPECT_NEAR(cost->predicted_seconds, bytes * 8 / 800e9 + 2 * 1e-4, 1e-12);
  bool rx_named = false;
  for (const auto& l : cost->busiest) rx_named = rx_named || l.link == "nvlink_rx gpu 1 (rollout ranks 0,1)";
  EXPECT_TRUE(rx_named) << cost->busiest.front().link;
  // Apart, on GPUs 1 and 2 (GPU 2 on the next node), each rank's link carries half.
  topo.rank_gpus = {1, 2};
  auto apart = estimate_cost(*plan, t.ranks, 1, topo);
  ASSERT_TRUE(apart.ok());
  EXPECT_NE(apart->busiest.front().link.find("trainer 0"), std::string::npos) << apart->busiest.front().link;
  topo.rank_gpus = {1};
  EXPECT_EQ(estimate_cost(*plan, t.ranks, 1, topo).status().code(), StatusCode::kInvalidArgument);
}

TEST(CostModel, QuantizingOnTheSenderHalvesFp8Bytes) {
  Tiny t = tiny(1024, 2, true);
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 22});
  ASSERT_TRUE(plan.ok());
  auto full = estimate_cost(*plan, t.ranks, 1, Topology{});
  auto half = estimate_cost(*plan, t.ranks, 1, Topology{}, CostOptions{true});
  ASSERT_TRUE(full.ok() && half.ok());
  EXPECT_EQ(half->bytes_moved * 2, full->bytes_moved);
}

TEST(CostModel, BalancedBeatsBroadcastByTheSenderCount) {
  Tiny t = tiny(4096, 8, false);
  auto one = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 20});
  auto eight = make_plan(t.manifest, t.ranks, std::vector<SenderInfo>(8), PlanOptions{1 << 20});
  ASSERT_TRUE(one.ok() && eight.ok());
  Topology topo;
  topo.seconds_per_bucket = 0;
  auto a = estimate_cost(*one, t.ranks, 1, topo);
  auto b = estimate_cost(*eight, t.ranks, 8, topo);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->bytes_moved, b->bytes_moved);
  EXPECT_NEAR(a->predicted_seconds / b->predicted_seconds, 8.0, 1e-6);
  EXPECT_EQ(b->senders_used, 8);
}

// One host whose transport carries 1 GB/s at 0.1 ms per bucket.
Topology one_host() {
  Topology topo;
  topo.placement = Placement::kOneHost;
  topo.host_gbps = 8;
  topo.seconds_per_bucket = 1e-4;
  return topo;
}

// Packing at 2 GB/s, processing at 1 GB/s.
CostOptions host_stages() {
  CostOptions o;
  o.stages.pack_bytes_per_second = 2e9;
  o.stages.process_bytes_per_second = 1e9;
  return o;
}

// One host (a CPU machine): the trainer and two ranks are processes; 2 MiB in one bucket per rank.
// Every stage is work for the same cores, so the pipeline is their sum; five control round trips.
TEST(CostModel, OneHostAddsEveryStageAndTheRoundTrips) {
  Tiny t = tiny(1024, 2, false);  // 1024 x 1024 bf16, column-split: 1 MiB per rank
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{4 << 20});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 2u);
  Topology topo = one_host();
  auto links = estimate_cost(*plan, t.ranks, 1, topo);
  ASSERT_TRUE(links.ok());
  const double mib = 1024.0 * 1024;
  // Without stages: the busiest link, the trainer's host_tx: 2 MiB at 1 GB/s plus two buckets.
  EXPECT_NEAR(links->predicted_seconds, 2 * mib / 1e9 + 2e-4, 1e-12);
  EXPECT_EQ(links->busiest.front().link, "host_tx (trainer 0)");

  CostOptions o = host_stages();
  o.stages.round_trip_seconds = 1e-3;
  auto c = estimate_cost(*plan, t.ranks, 1, topo, o);
  ASSERT_TRUE(c.ok());
  const double pack = 2 * mib / 2e9;             // 1.048576 ms: the trainer packs both buckets
  const double wire = 2 * mib / 1e9 + 2 * 1e-4;  // 2.297152 ms: host_tx carries both
  const double process = 2 * (mib / 1e9);        // 2.097152 ms: each rank its 1 MiB
  EXPECT_NEAR(c->pack_seconds, pack, 1e-12);
  EXPECT_NEAR(c->process_seconds, mib / 1e9, 1e-12);  // the busiest rank's
  EXPECT_NEAR(c->host_seconds, pack + wire + process, 1e-12);  // 5.44288 ms
  // The longest chain alone (host_tx: both buckets leave once everything is packed, the last is
  // processed after it) is 4.394304 ms: shorter than the host's work, which is the pipeline.
  EXPECT_NEAR(c->pipeline_seconds, pack + wire + process, 1e-12);
  EXPECT_EQ(c->critical, "host (every stage, one at a time)");
  EXPECT_NEAR(c->control_seconds, 5e-3, 1e-15);
  EXPECT_NEAR(c->predicted_seconds, 5e-3 + 5.44288e-3, 1e-12);
}

// The same host doing several stages at once (Topology::host_parallelism, as measured): the host's
// work divided by it bounds the pipeline only while that exceeds the longest chain.
TEST(CostModel, OneHostDoingStagesAtOnceDividesItsWork) {
  Tiny t = tiny(1024, 2, false);
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{4 << 20});
  ASSERT_TRUE(plan.ok());
  Topology topo = one_host();
  CostOptions o = host_stages();
  const double host = 5.44288e-3;    // every stage one at a time (above)
  const double chain = 4.394304e-3;  // host_tx's chain: both buckets once packed, the last processed
  topo.host_parallelism = 1.1;       // 4.948 ms: still above the chain
  auto c = estimate_cost(*plan, t.ranks, 1, topo, o);
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(c->host_seconds, host, 1e-12);
  EXPECT_NEAR(c->pipeline_seconds, host / 1.1, 1e-12);
  EXPECT_NEAR(c->busy_seconds, host / 1.1, 1e-12);
  EXPECT_EQ(c->critical, "host (1.10 stages at a time)");
  topo.host_parallelism = 2;  // 2.72 ms: the chain decides
  c = estimate_cost(*plan, t.ranks, 1, topo, o);
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(c->host_seconds, host, 1e-12);
  EXPECT_NEAR(c->pipeline_seconds, chain, 1e-12);
  EXPECT_EQ(c->critical, "host_tx (trainer 0)");
  topo.host_parallelism = 0.5;  // never below one stage at a time
  c = estimate_cost(*plan, t.ranks, 1, topo, o);
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(c->pipeline_seconds, host, 1e-12);
  EXPECT_EQ(c->critical, "host (every stage, one at a time)");
  // GPUs on nodes have no host term: the parallelism changes nothing there.
  Topology nodes;
  nodes.gpus_per_node = 1;
  auto a = estimate_cost(*plan, t.ranks, 1, nodes, o);
  nodes.host_parallelism = 4;
  auto b = estimate_cost(*plan, t.ranks, 1, nodes, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->predicted_seconds, b->predicted_seconds);
  EXPECT_EQ(a->critical, b->critical);
}

// Two sender processes on the host, each holding the rows one rank takes: they pack side by side,
// so the host's work counts the busiest sender's packing once, beside every link's and rank's work.
TEST(CostModel, OneHostSendersPackSideBySide) {
  Tiny t = tiny(1024, 2, false);
  std::vector<SenderInfo> halves(2);
  halves[0].holds.push_back({"model.layers.0.mlp.w.weight", Region{{0, 0}, {512, 1024}}});
  halves[1].holds.push_back({"model.layers.0.mlp.w.weight", Region{{512, 0}, {512, 1024}}});
  auto plan = make_plan(t.manifest, t.ranks, halves, PlanOptions{4 << 20});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_EQ(plan->buckets.size(), 2u);
  Topology topo = one_host();
  CostOptions o = host_stages();
  auto c = estimate_cost(*plan, t.ranks, 2, topo, o);
  ASSERT_TRUE(c.ok());
  const double mib = 1024.0 * 1024;
  const double pack = mib / 2e9;                  // each sender its 1 MiB, side by side
  const double wire = 2 * (mib / 1e9 + 1e-4);     // each sender's host_tx, one bucket each
  const double process = 2 * (mib / 1e9);         // each rank its 1 MiB
  EXPECT_NEAR(c->pack_seconds, pack, 1e-12);
  EXPECT_NEAR(c->host_seconds, pack + wire + process, 1e-12);
  EXPECT_NEAR(c->predicted_seconds, pack + wire + process, 1e-12);
}

// GPUs on two nodes, 4 buckets of 512 KiB over a 1 GB/s NIC: the busiest link's 2.097152 ms, plus
// the fill before its first bucket (packed at 2 GB/s: 0.262144 ms) and the drain after its last
// (processed at 4 GB/s: 0.131072 ms).
TEST(CostModel, StagesAddFillAndDrainToTheBusiestLink) {
  ModelDesc d;
  for (int i = 0; i < 4; ++i) {
    ParamRule r;
    r.param = "model.layers." + std::to_string(i) + ".mlp.w.weight";
    r.sources = {r.param};
    r.shapes = {{256, 1024}};
    r.layout = Layout::kColumn;
    d.params.push_back(r);
  }
  const Manifest manifest = model_manifest(d);
  auto ranks = model_rank_specs(d, 1, 1, 1, Scheme::kNone);
  ASSERT_TRUE(ranks.ok());
  auto plan = make_plan(manifest, *ranks, {SenderInfo{}}, PlanOptions{512 << 10});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 4u);
  Topology topo;
  topo.nic_gbps = 8;
  topo.pcie_gbps = 16;
  topo.seconds_per_bucket = 0;
  auto bare = estimate_cost(*plan, *ranks, 1, topo);
  ASSERT_TRUE(bare.ok());
  EXPECT_NEAR(bare->predicted_seconds, 2.097152e-3, 1e-12);
  EXPECT_EQ(bare->fill_seconds, 0.0);
  EXPECT_EQ(bare->drain_seconds, 0.0);

  CostOptions o;
  o.stages.pack_bytes_per_second = 2e9;
  o.stages.process_bytes_per_second = 4e9;
  auto c = estimate_cost(*plan, *ranks, 1, topo, o);
  ASSERT_TRUE(c.ok());
  // The first bucket leaves as soon as it is full: 512 KiB packed.
  EXPECT_NEAR(c->fill_seconds, 0.262144e-3, 1e-12);
  EXPECT_NEAR(c->busy_seconds, 2.097152e-3, 1e-12);
  EXPECT_NEAR(c->drain_seconds, 0.131072e-3, 1e-12);
  EXPECT_NEAR(c->predicted_seconds, 2.490368e-3, 1e-12);
  EXPECT_EQ(c->critical, "nic_tx gpu 0 (trainer 0)");
  EXPECT_EQ(c->host_seconds, 0.0);  // no host term across GPU nodes
  EXPECT_EQ(c->control_seconds, 0.0);
}

TEST(CostModel, RefusesNegativeStagesAndAHostWithoutBandwidth) {
  Tiny t = tiny(1024, 1, false);
  auto plan = make_plan(t.manifest, t.ranks, {SenderInfo{}}, PlanOptions{1 << 22});
  ASSERT_TRUE(plan.ok());
  Topology host;
  host.placement = Placement::kOneHost;
  EXPECT_FALSE(estimate_cost(*plan, t.ranks, 1, host).ok());
  CostOptions o;
  o.stages.round_trip_seconds = -1;
  EXPECT_FALSE(estimate_cost(*plan, t.ranks, 1, Topology{}, o).ok());
}

nlohmann::json run_plan_command(const std::vector<std::string>& args) {
  CLI::App app("ferry");
  std::ostringstream out;
  ferry::cli::add_plan_command(app, out);
  std::vector<std::string> argv = args;
  std::reverse(argv.begin(), argv.end());  // CLI11 parses a reversed vector
  app.parse(argv);
  return nlohmann::json::parse(out.str());
}

TEST(PlanCommand, JsonHasThePromisedFields) {
  auto j = run_plan_command({"plan", "--model", "llama3-8b", "--trainers", "16", "--replicas", "2", "--tp", "4", "--json"});
  for (const char* key : {"predicted_seconds", "bytes_moved", "max_link_bytes", "broadcast"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_GT(j["predicted_seconds"].get<double>(), 0);
  // 2 x 16 GB leave rank 0's one NIC; balanced, each rollout GPU's NIC takes its 4 GB: 8x faster.
  EXPECT_GT(j["broadcast"]["predicted_seconds"].get<double>(), 7 * j["predicted_seconds"].get<double>());
  EXPECT_LE(j["sender_imbalance"].get<double>(), 0.10);
}

TEST(PlanCommand, RefusesAnUnshardableLayout) {
  CLI::App app("ferry");
  std::ostringstream out;
  ferry::cli::add_plan_command(app, out);
  std::vector<std::string> argv = {"--json", "3", "--tp", "qwen2-7b", "--model", "plan"};
  EXPECT_THROW(app.parse(argv), CLI::RuntimeError);  // 28 heads over TP 3... 28 % 3 != 0
}

// The worked case of docs/cost_model.md: Kimi-K2, 256 trainer GPUs to 8 replicas x 16 GPUs.
TEST(PlanCommand, KimiK2WorkedCase) {
  auto j = run_plan_command({"plan", "--model", "kimi-k2", "--trainers", "256", "--replicas", "8", "--tp", "16", "--ep",
                             "16", "--nic-gbps", "400", "--gpus-per-node", "8", "--json"});
  std::cout << j.dump(2) << "\n";
  const double params = j["parameters"].get<double>();
  EXPECT_NEAR(params / 1.027e12, 1.0, 0.01);
  // bf16 on the wire: every rollout GPU takes 1/16 of 2 TB through a 50 GB/s NIC, about 2.6 s.
  EXPECT_GT(j["predicted_seconds"].get<double>(), 2.4);
  EXPECT_LT(j["predicted_seconds"].get<double>(), 3.0);
  auto q = run_plan_command({"plan", "--model", "kimi-k2", "--trainers", "256", "--replicas", "8", "--tp", "16", "--ep",
                             "16", "--quantize-on-sender", "--json"});
  std::cout << q.dump(2) << "\n";
  EXPECT_LT(q["predicted_seconds"].get<double>(), 1.5);
}

}  // namespace
}  // namespace ferry::sharding
