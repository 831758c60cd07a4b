// A trainer that joined a coordinator of its own (`ferry coordinator`), not the one it embeds: it
// waits for the ranks and updates them as with the embedded one.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "coordinator/coordinator.h"
#include "tests/coordinator/cluster.h"

namespace ferry::testutil {
namespace {

struct Ranks {
  std::vector<std::unique_ptr<reload::ModelStorage>> storage;
  std::vector<std::unique_ptr<coordinator::RolloutWorker>> workers;

  Status join(const std::string& address, const sharding::LlamaConfig& cfg, int tp, int first, int count) {
    for (int r = first; r < first + count; ++r) {
      FERRY_ASSIGN_OR_RETURN(auto spec, sharding::llama_rank_spec(cfg, r, tp, Scheme::kFp8PerTensor));
      FERRY_ASSIGN_OR_RETURN(auto s, reload::ModelStorage::allocate(spec, Device::cpu()));
      storage.push_back(std::make_unique<reload::ModelStorage>(std::move(s)));
      coordinator::RolloutOptions o;
      o.coordinator = address;
      o.spec = spec;
      o.storage = storage.back().get();
      o.pause = [](const coordinator::PauseRequest&) { return ok_status(); };
      o.resume = [](uint64_t) { return ok_status(); };
      FERRY_ASSIGN_OR_RETURN(auto w, coordinator::RolloutWorker::create(std::move(o)));
      workers.push_back(std::move(w));
    }
    return ok_status();
  }
};

TEST(StandaloneCoordinator, TrainerWaitsForRanksAndUpdatesThem) {
  auto coord = coordinator::Coordinator::start({});
  ASSERT_TRUE(coord.ok()) << coord.status().to_string();
  coordinator::TrainerOptions to;
  to.coordinator = (*coord)->address();
  auto trainer = coordinator::Trainer::create(to);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  const auto cfg = tiny_llama();

  // No rank yet: the wait ends at its deadline, saying how many joined.
  Status none = (*trainer)->wait_for_ranks(1, 50);
  EXPECT_EQ(none.code(), StatusCode::kDeadlineExceeded) << none.to_string();
  EXPECT_NE(none.message().find("0 of 1"), std::string::npos) << none.to_string();

  Ranks ranks;
  ASSERT_TRUE(ranks.join((*coord)->address(), cfg, 2, 0, 1).ok());
  Status one = (*trainer)->wait_for_ranks(2, 100);
  EXPECT_NE(one.message().find("1 of 2"), std::string::npos) << one.to_string();
  // The second rank joins: the next wait sees both.
  ASSERT_TRUE(ranks.join((*coord)->address(), cfg, 2, 1, 1).ok());
  Status both = (*trainer)->wait_for_ranks(2, 10'000);
  ASSERT_TRUE(both.ok()) << both.to_string();

  const auto manifest = sharding::llama_manifest(cfg);
  Checkpoint ck(manifest, 3);
  ASSERT_TRUE((*trainer)->start_weight_update(1, manifest).ok());
  coordinator::MapSource src(ck.views);
  ASSERT_TRUE((*trainer)->update_weights(src).ok());
  auto report = (*trainer)->finish_weight_update();
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->ranks, 2);
  EXPECT_EQ(report->moved, 0u);
  for (const auto& w : ranks.workers) EXPECT_EQ(w->weight_version(), 1u);
}

}  // namespace
}  // namespace ferry::testutil
