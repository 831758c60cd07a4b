// `ferry bench e2e --json` run as a black box per transport: a trainer and two rank processes, two
// timed updates of the demo model, and one well-formed line with the measured and predicted
// seconds. Speed is for the benchmark to measure; this only checks the line.
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

struct BenchRun {
  int rc = -1;
  std::vector<std::string> lines;  // stdout only
  std::string all;
};

BenchRun run(const std::string& args) {
  BenchRun r;
  FILE* p = popen((std::string(FERRY_BIN) + " " + args + " 2>/dev/null").c_str(), "r");
  if (!p) return r;
  char buf[8192];
  while (fgets(buf, sizeof buf, p)) {
    std::string s(buf);
    r.all += s;
    if (!s.empty() && s.back() == '\n') s.pop_back();
    r.lines.push_back(s);
  }
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class E2eBench : public ::testing::TestWithParam<std::string> {};

TEST_P(E2eBench, PrintsOneWellFormedLine) {
  const std::string transport = GetParam();
  BenchRun r = run("bench e2e --transport " + transport + " --updates 2 --json");
  ASSERT_EQ(r.rc, 0) << r.all;
  ASSERT_EQ(r.lines.size(), 1u) << r.all;
  const auto j = nlohmann::json::parse(r.lines[0], nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.lines[0];
  EXPECT_EQ(j.at("bench"), "e2e");
  EXPECT_EQ(j.at("case"), transport + "/fp8_per_channel");
  EXPECT_EQ(j.at("device"), "cpu");
  EXPECT_EQ(j.at("tp"), 2);
  EXPECT_EQ(j.at("updates"), 2);
  EXPECT_GT(j.at("bytes").get<uint64_t>(), 0u);
  EXPECT_GT(j.at("buckets").get<uint64_t>(), 0u);
  for (const char* k : {"seconds", "predicted_seconds", "ratio"}) EXPECT_GT(j.at(k).get<double>(), 0.0) << k;
  EXPECT_NEAR(j.at("ratio").get<double>(), j.at("predicted_seconds").get<double>() / j.at("seconds").get<double>(),
              1e-3 * j.at("ratio").get<double>() + 1e-3);
  for (const char* k : {"pause", "transfer", "process", "resume"}) {
    EXPECT_GT(j.at("measured").at(k).get<double>(), 0.0) << k;
  }
  for (const char* k : {"control", "pipeline", "busy", "pack", "process", "host"}) {
    EXPECT_GT(j.at("predicted").at(k).get<double>(), 0.0) << k;
  }
  EXPECT_FALSE(j.at("predicted").at("critical").get<std::string>().empty());
  for (const char* k : {"round_trip_seconds", "host_gbps", "pack_gbps", "process_gbps", "host_parallelism"}) {
    EXPECT_GT(j.at("links").at(k).get<double>(), 0.0) << k;
  }
  EXPECT_GE(j.at("links").at("seconds_per_bucket").get<double>(), 0.0);
  // The footprint: resident bytes of the trainer and of the largest rank, both measured.
  for (const char* k : {"trainer_rss_bytes", "rank_rss_bytes"}) EXPECT_GT(j.at("memory").at(k).get<uint64_t>(), 1u << 20) << k;
}

// --trainers: one line per size, the sharded trainer beside gather-then-send, both predicted.
TEST(E2eBenchTrainers, PrintsShardedBesideGatherPerSize) {
  BenchRun r = run("bench e2e --transport tcp --trainers 1,2 --updates 1 --json");
  ASSERT_EQ(r.rc, 0) << r.all;
  ASSERT_EQ(r.lines.size(), 2u) << r.all;
  for (size_t i = 0; i < 2; ++i) {
    const auto j = nlohmann::json::parse(r.lines[i], nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << r.lines[i];
    EXPECT_EQ(j.at("bench"), "e2e-trainers");
    EXPECT_EQ(j.at("trainers"), static_cast<int>(i + 1));
    for (const char* k : {"sharded_seconds", "sharded_predicted_seconds", "gather_seconds", "gather_predicted_seconds",
                          "speedup"}) {
      EXPECT_GT(j.at(k).get<double>(), 0.0) << k;
    }
    EXPECT_NEAR(j.at("speedup").get<double>(), j.at("gather_seconds").get<double>() / j.at("sharded_seconds").get<double>(),
                1e-3 * j.at("speedup").get<double>() + 1e-3);
    // The ranks' processing is measured for the pieces as the sharded plan cuts them too (several
    // senders' rows of each slice), which the sharded prediction takes.
    const double many = j.at("links").at("process_many_gbps").get<double>();
    // So is the host's parallelism (the stages run at once).
    const double parallelism = j.at("links").at("host_parallelism").get<double>();
    const double parallelism_many = j.at("links").at("host_parallelism_many").get<double>();
    EXPECT_GT(parallelism, 0.0);
    EXPECT_GT(j.at("links").at("overlap_seconds").get<double>(), 0.0) << "the stages at once were timed";
    const double overlap_many = j.at("links").at("overlap_many_seconds").get<double>();
    if (i == 0) {
      EXPECT_EQ(overlap_many, 0.0);
      EXPECT_EQ(many, 0.0) << "one sender: nothing else to measure";
      EXPECT_EQ(parallelism_many, 0.0);
    } else {
      EXPECT_GT(many, 0.0);
      EXPECT_GT(parallelism_many, 0.0);
      EXPECT_GT(overlap_many, 0.0);
    }
  }
}

std::vector<std::string> transports() {
  std::vector<std::string> t = {"tcp", "shm"};
#if FERRY_E2E_UCX
  t.push_back("ucx");
#endif
  return t;
}

INSTANTIATE_TEST_SUITE_P(Transports, E2eBench, ::testing::ValuesIn(transports()),
                         [](const auto& info) { return info.param; });

}  // namespace
