// A Trainer, a RolloutWorker and the coordinator take every value from the settings snapshot in
// their options, not the environment: with malformed FERRY_* variables set, faces given a snapshot
// still complete an update over the snapshot's transport, buckets and token; faces given none read
// the environment and name the malformed variable.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "coordinator/coordinator.h"
#include "tests/common/scoped_env.h"
#include "tests/coordinator/cluster.h"

namespace ferry::testutil {
namespace {

Result<std::unique_ptr<coordinator::RolloutWorker>> rank(const std::string& address, const sharding::RankSpec& spec,
                                                          reload::ModelStorage& storage, std::optional<Settings> settings) {
  coordinator::RolloutOptions o;
  o.coordinator = address;
  o.spec = spec;
  o.storage = &storage;
  o.pause = [](const coordinator::PauseRequest&) { return ok_status(); };
  o.resume = [](uint64_t) { return ok_status(); };
  o.settings = std::move(settings);
  return coordinator::RolloutWorker::create(std::move(o));
}

TEST(SettingsSnapshot, FacesTakeTheirOptionsSettingsNotTheEnvironment) {
  ScopedEnv timeout("FERRY_TIMEOUT_MS", "soon");
  ScopedEnv transport("FERRY_TRANSPORT", "carrier-pigeon");
  ScopedEnv token("FERRY_TOKEN", "not-the-snapshot's");

  // Without a snapshot the environment is read, and its first malformed variable named.
  auto plain = coordinator::Trainer::create({});
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.status().message().find("FERRY_TIMEOUT_MS='soon'"), std::string::npos) << plain.status().to_string();

  SettingOverrides keywords{{"timeout_ms", "20000"}, {"transport", "tcp"}, {"bucket_bytes", "8K"}, {"token", "s3cret"}};
  auto settings = load_settings(keywords);
  ASSERT_TRUE(settings.ok()) << settings.status().to_string();
  EXPECT_EQ(settings->source("FERRY_TRANSPORT"), SettingSource::kKeyword);
  coordinator::TrainerOptions to;
  to.settings = *settings;
  auto trainer = coordinator::Trainer::create(to);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();

  const auto cfg = tiny_llama();
  auto spec = sharding::llama_rank_spec(cfg, 0, 1, Scheme::kFp8PerTensor);
  ASSERT_TRUE(spec.ok());
  auto storage = reload::ModelStorage::allocate(*spec, Device::cpu());
  ASSERT_TRUE(storage.ok());
  const std::string address = (*trainer)->coordinator_address();

  // The embedded coordinator requires the snapshot's token: a rank with another one is refused.
  Settings other = *settings;
  other.token = "wrong";
  auto refused = rank(address, *spec, *storage, other);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnauthenticated) << refused.status().to_string();

  auto worker = rank(address, *spec, *storage, *settings);
  ASSERT_TRUE(worker.ok()) << worker.status().to_string();
  const auto endpoints = (*worker)->data_endpoints();
  ASSERT_EQ(endpoints.size(), 1u);
  EXPECT_EQ(endpoints[0].transport, "tcp");
  ASSERT_TRUE((*trainer)->wait_for_ranks(1, 10'000).ok());

  const auto manifest = sharding::llama_manifest(cfg);
  Checkpoint ck(manifest, 5);
  ASSERT_TRUE((*trainer)->start_weight_update(1, manifest).ok());
  coordinator::MapSource src(ck.views);
  ASSERT_TRUE((*trainer)->update_weights(src).ok());
  auto report = (*trainer)->finish_weight_update();
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_EQ(report->moved, 0u);
  EXPECT_EQ((*worker)->weight_version(), 1u);
  // Buckets of the snapshot's 8 KiB: the model's bytes take many of them.
  ASSERT_EQ(report->buckets.size(), 1u);
  EXPECT_GE(report->buckets[0], report->bytes / 8192);
}

}  // namespace
}  // namespace ferry::testutil
