// The opt-in Prometheus endpoint, scraped over a real socket.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/coordinator.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/raw_socket.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;

std::string scrape(uint16_t port, const std::string& path) {
  RawSocket s("127.0.0.1:" + std::to_string(port));
  if (!s.ok()) return "";
  s.write("GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string all;
  char buf[4096];
  while (true) {
    const ssize_t n = ::recv(s.fd(), buf, sizeof buf, 0);
    if (n <= 0) break;
    all.append(buf, static_cast<size_t>(n));
  }
  return all;
}

TEST(Metrics, OffUnlessAsked) {
  auto c = coordinator::Coordinator::start({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->metrics_port(), 0);
}

TEST(Metrics, ServesMembersVersionsAndUpdates) {
  coordinator::TrainerOptions o;
  coordinator::CoordinatorOptions co;
  co.metrics_port = 0;
  auto coord = coordinator::Coordinator::start(co);
  ASSERT_TRUE(coord.ok());
  ASSERT_GT((*coord)->metrics_port(), 0);
  const std::string empty = scrape((*coord)->metrics_port(), "/metrics");
  EXPECT_THAT(empty, HasSubstr("200 OK"));
  EXPECT_THAT(empty, HasSubstr("ferry_members{role=\"rollout\"} 0"));
  EXPECT_THAT(empty, HasSubstr("ferry_updates_total{result=\"ok\"} 0"));
  EXPECT_THAT(scrape((*coord)->metrics_port(), "/other"), HasSubstr("404"));

  // Members and an update on it.
  o.coordinator = (*coord)->address();
  auto trainer = coordinator::Trainer::create(o);
  ASSERT_TRUE(trainer.ok());
  const auto cfg = tiny_llama();
  auto spec = sharding::llama_rank_spec(cfg, 0, 1, Scheme::kFp8PerTensor);
  auto storage = reload::ModelStorage::allocate(*spec, Device::cpu());
  coordinator::RolloutOptions ro;
  ro.coordinator = (*coord)->address();
  ro.spec = *spec;
  ro.storage = &*storage;
  auto worker = coordinator::RolloutWorker::create(std::move(ro));
  ASSERT_TRUE(worker.ok());
  const auto manifest = sharding::llama_manifest(cfg);
  Checkpoint ck(manifest, 4);
  ASSERT_TRUE((*trainer)->start_weight_update(4, manifest).ok());
  coordinator::MapSource src(ck.views);
  ASSERT_TRUE((*trainer)->update_weights(src).ok());
  ASSERT_TRUE((*trainer)->finish_weight_update().ok());
  const std::string m = scrape((*coord)->metrics_port(), "/metrics");
  EXPECT_THAT(m, HasSubstr("ferry_members{role=\"rollout\"} 1"));
  EXPECT_THAT(m, HasSubstr("ferry_members{role=\"trainer\"} 1"));
  EXPECT_THAT(m, HasSubstr("ferry_updates_total{result=\"ok\"} 1"));
  EXPECT_THAT(m, HasSubstr("ferry_weight_version{replica=\"0\",rank=\"0\"} 4"));
  EXPECT_THAT(m, HasSubstr("ferry_rank_consistent{replica=\"0\",rank=\"0\"} 1"));
  EXPECT_THAT(m, HasSubstr("ferry_last_update_bytes "));
}

}  // namespace
}  // namespace ferry::testutil
