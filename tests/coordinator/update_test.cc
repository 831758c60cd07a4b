// A trainer and a TP replica in one process over real sockets: the update lifecycle end to end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/channel.h"
#include "core/version.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/raw_socket.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;

TEST(Update, LandsOnEveryRankAndResumesTogether) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  const uint64_t before0 = c.rank(0).fingerprint(), before1 = c.rank(1).fingerprint();
  Checkpoint a(c.manifest(), 1);
  auto r = c.update(1, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->version, 1u);
  EXPECT_EQ(r->ranks, 2);
  EXPECT_EQ(r->moved, 0u);
  EXPECT_GT(r->registered, 0u);
  EXPECT_GT(r->bytes, 0u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(c.rank(i).pauses, 1);
    EXPECT_EQ(c.rank(i).resumes, 1);
    EXPECT_EQ(c.rank(i).last_resume, 1u);
    EXPECT_EQ(c.rank(i).worker->weight_version(), 1u);
    EXPECT_TRUE(c.rank(i).worker->consistent());
  }
  EXPECT_NE(c.rank(0).fingerprint(), before0);
  EXPECT_NE(c.rank(1).fingerprint(), before1);
}

TEST(Update, SameWeightsGiveSameStorageAndNewWeightsChangeIt) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  Checkpoint a(c.manifest(), 1), b(c.manifest(), 2);
  ASSERT_TRUE(c.update(1, a).ok());
  const uint64_t fa = c.rank(1).fingerprint();
  ASSERT_TRUE(c.update(2, b).ok());
  EXPECT_NE(c.rank(1).fingerprint(), fa);
  ASSERT_TRUE(c.update(3, a).ok());
  EXPECT_EQ(c.rank(1).fingerprint(), fa);
  EXPECT_EQ(c.rank(1).worker->weight_version(), 3u);
}

// Bad input: a mismatch fails start_weight_update, names the tensor, writes nothing, pauses no one,
// and the next correct update succeeds.
class BadManifest : public ::testing::TestWithParam<int> {};

TEST_P(BadManifest, FailsAtStartAndWritesNothing) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  Checkpoint a(c.manifest(), 1);
  ASSERT_TRUE(c.update(1, a).ok());
  const uint64_t f0 = c.rank(0).fingerprint(), f1 = c.rank(1).fingerprint();

  sharding::Manifest bad = c.manifest();
  const std::string victim = "model.layers.1.mlp.up_proj.weight";
  auto it = std::find_if(bad.begin(), bad.end(), [&](const auto& t) { return t.name == victim; });
  ASSERT_NE(it, bad.end());
  std::string want;
  switch (GetParam()) {
    case 0: it->shape[0] += 1; want = "bf16[256, 128], trainer sends bf16[257, 128]"; break;
    case 1: it->dtype = DType::kF32; want = "trainer sends f32[256, 128]"; break;
    case 2:
      bad.push_back({"model.layers.1.mlp.extra.weight", DType::kBF16, {4}});
      want = "model.layers.1.mlp.extra.weight: trainer sends bf16[4], but no replica has a tensor of that name";
      break;
    case 3: bad.erase(it); want = "trainer sends nothing"; break;
  }
  Status st = c.trainer().start_weight_update(2, bad);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr(want));
  if (GetParam() != 2) {
    EXPECT_THAT(st.message(), HasSubstr(victim));
  }
  EXPECT_EQ(c.rank(0).pauses, 1);  // only the first update paused anyone
  EXPECT_EQ(c.rank(0).fingerprint(), f0);
  EXPECT_EQ(c.rank(1).fingerprint(), f1);
  EXPECT_EQ(c.rank(0).worker->weight_version(), 1u);

  Checkpoint b(c.manifest(), 2);
  auto r = c.update(2, b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_NE(c.rank(0).fingerprint(), f0);
  EXPECT_EQ(c.rank(1).worker->weight_version(), 2u);
}

// The manifest travels once: later starts carry its digest only, and the coordinator reuses what it
// checked. A changed manifest is sent and checked again (refused here, naming the tensor), and the
// unchanged one works after it.
TEST(Update, RepeatedManifestTravelsOnceAndChangesAreStillChecked) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  for (uint64_t v = 1; v <= 3; ++v) {
    Checkpoint ck(c.manifest(), v);
    auto r = c.update(v, ck);
    ASSERT_TRUE(r.ok()) << "v" << v << ": " << r.status().to_string();
  }
  sharding::Manifest changed = c.manifest();
  changed.back().shape[0] += 64;
  Status st = c.trainer().start_weight_update(4, changed);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_THAT(st.message(), HasSubstr(changed.back().name));
  Checkpoint ck(c.manifest(), 4);
  auto r = c.update(4, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(c.rank(0).worker->weight_version(), 4u);
}

// A start that omits a manifest the coordinator does not hold is refused, asking for it.
TEST(Update, OmittedManifestTheCoordinatorLacksIsRefused) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  RawSocket s(c.trainer().coordinator_address());
  ASSERT_TRUE(s.ok());
  wire::Envelope challenge;
  ASSERT_TRUE(s.read_frame(&challenge));
  wire::Envelope hello;
  hello.mutable_hello()->set_protocol_version(kProtocolVersion);
  hello.mutable_hello()->set_role("trainer");
  ASSERT_TRUE(s.write(coordinator::encode_frame(hello)));
  wire::Envelope welcome;
  ASSERT_TRUE(s.read_frame(&welcome));
  ASSERT_TRUE(welcome.has_welcome());
  wire::Envelope start;
  start.mutable_start_update()->set_version(9);
  start.mutable_start_update()->set_manifest_digest(0x1234);
  start.mutable_start_update()->set_manifest_omitted(true);
  ASSERT_TRUE(s.write(coordinator::encode_frame(start)));
  wire::Envelope reply;
  do {
    ASSERT_TRUE(s.read_frame(&reply));
  } while (!reply.has_start_reply());
  EXPECT_EQ(reply.start_reply().status().code(), static_cast<int>(StatusCode::kFailedPrecondition));
  EXPECT_THAT(reply.start_reply().status().message(), HasSubstr("resend"));
  EXPECT_EQ(c.rank(0).pauses, 0);
}

std::string bad_manifest_name(const ::testing::TestParamInfo<int>& info) {
  static const char* const kNames[] = {"Shape", "DType", "UnknownName", "MissingTensor"};
  return kNames[info.param];
}

INSTANTIATE_TEST_SUITE_P(Kinds, BadManifest, ::testing::Values(0, 1, 2, 3), bad_manifest_name);

TEST(Update, SendOfWrongShapeIsRefused) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  Checkpoint a(c.manifest(), 1);
  ASSERT_TRUE(c.trainer().start_weight_update(1, c.manifest()).ok());
  std::vector<uint16_t> small(10);
  Status st = c.trainer().send("model.norm.weight", TensorView(small.data(), DType::kBF16, {10}));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("model.norm.weight"));
  EXPECT_FALSE(c.trainer().finish_weight_update().ok());
}

// A failed update leaves its open bucket unsent; the next update returns it to the pool. (It was
// lost: after FERRY_BUCKETS_IN_FLIGHT failed updates no bucket was left, and the sender waited on
// an empty queue.)
TEST(Update, FailedUpdatesDoNotLoseBuckets) {
  setenv("FERRY_BUCKETS_IN_FLIGHT", "2", 1);
  Cluster c(1);
  const Status started = c.start();
  unsetenv("FERRY_BUCKETS_IN_FLIGHT");
  ASSERT_TRUE(started.ok()) << started.to_string();
  Checkpoint a(c.manifest(), 1);
  std::vector<uint16_t> small(10);
  for (uint64_t v = 1; v <= 4; ++v) {
    ASSERT_TRUE(c.trainer().start_weight_update(v, c.manifest()).ok());
    ASSERT_TRUE(c.trainer().send(a.views.begin()->first, a.views.begin()->second).ok());  // opens a bucket
    EXPECT_FALSE(c.trainer().send("model.norm.weight", TensorView(small.data(), DType::kBF16, {10})).ok());
    EXPECT_FALSE(c.trainer().finish_weight_update().ok());
  }
  auto r = c.update(5, a);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(c.rank(0).worker->consistent());
}

TEST(Update, IncompleteUpdateNamesTheLayerAndLeavesRanksInconsistentUntilTheNextOne) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  Checkpoint a(c.manifest(), 1);
  ASSERT_TRUE(c.update(1, a).ok());
  // The bytes of the layer that will stay incomplete, on every rank. Its rows that arrive may go into
  // storage at once; the ranks stay paused and inconsistent until a complete update lands.
  const auto layer1 = [](Cluster& of, int rank) {
    std::map<std::string, std::string> out;
    for (const auto& [name, v] : of.rank(rank).storage->tensors()) {
      if (name.starts_with("model.layers.1.")) out[name].assign(static_cast<const char*>(v.data()), v.nbytes());
    }
    return out;
  };
  const auto before0 = layer1(c, 0), before1 = layer1(c, 1);
  ASSERT_FALSE(before0.empty());
  Checkpoint b(c.manifest(), 2);
  // What a complete update to b leaves, from a replica of its own.
  Cluster ref(2);
  ASSERT_TRUE(ref.start().ok());
  ASSERT_TRUE(ref.update(1, Checkpoint(ref.manifest(), 2)).ok());
  const std::map<std::string, std::string> want[] = {layer1(ref, 0), layer1(ref, 1)};
  ASSERT_TRUE(c.trainer().start_weight_update(2, c.manifest()).ok());
  for (const auto& [name, v] : b.views) {
    if (name == "model.layers.1.self_attn.k_proj.weight") continue;
    ASSERT_TRUE(c.trainer().send(name, v).ok());
  }
  auto r = c.trainer().finish_weight_update();
  ASSERT_FALSE(r.ok());
  // Led by the cause, named as the trainer knows it: the checkpoint tensor never sent, not the fused
  // qkv_proj rows it lands in.
  EXPECT_THAT(r.status().message(), ::testing::StartsWith("update v2 never received checkpoint tensors: "
                                                          "model.layers.1.self_attn.k_proj.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("layers are incomplete: model.layers.1"));
  EXPECT_THAT(r.status().message(), ::testing::Not(HasSubstr("qkv_proj")));
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(c.rank(i).worker->consistent());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 1u);
    EXPECT_EQ(c.rank(i).resumes, 1);  // no replica resumed with a mixed model
    // (Its storage is not read here: the update fails as soon as one rank reports, and the other
    // may still be taking its last buckets, rows of which go into storage as they arrive.)
  }
  auto next = c.update(3, b);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(c.rank(i).worker->consistent());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 3u);
  }
  EXPECT_EQ(layer1(c, 0), want[0]);
  EXPECT_EQ(layer1(c, 1), want[1]);
  EXPECT_NE(want[0], before0);
  EXPECT_NE(want[1], before1);
}

TEST(Update, VersionsOnlyIncrease) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  Checkpoint a(c.manifest(), 1);
  ASSERT_TRUE(c.update(5, a).ok());
  Status st = c.trainer().start_weight_update(5, c.manifest());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("not above the current version 5"));
}

TEST(Update, SecondConcurrentUpdateIsRefused) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  coordinator::TrainerOptions o;
  o.coordinator = c.trainer().coordinator_address();
  auto other = coordinator::Trainer::create(o);
  ASSERT_TRUE(other.ok()) << other.status().to_string();
  ASSERT_TRUE(c.trainer().start_weight_update(1, c.manifest()).ok());
  Status st = (*other)->start_weight_update(2, c.manifest());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  Checkpoint a(c.manifest(), 1);
  coordinator::MapSource src(a.views);
  ASSERT_TRUE(c.trainer().update_weights(src).ok());
  ASSERT_TRUE(c.trainer().finish_weight_update().ok());
}

TEST(Update, SmallBucketsAndChecksumsGiveTheSameStorage) {
  uint64_t reference = 0;
  {
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    Checkpoint ck(c.manifest(), 7);
    ASSERT_TRUE(c.update(1, ck).ok());
    reference = c.rank(1).fingerprint();
  }
  setenv("FERRY_BUCKET_BYTES", "8K", 1);
  setenv("FERRY_BUCKETS_IN_FLIGHT", "2", 1);
  setenv("FERRY_VERIFY", "1", 1);
  {
    Cluster c(2);
    ASSERT_TRUE(c.start().ok());
    Checkpoint ck(c.manifest(), 7);
    auto r = c.update(1, ck);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(c.rank(1).fingerprint(), reference);
  }
  unsetenv("FERRY_BUCKET_BYTES");
  unsetenv("FERRY_BUCKETS_IN_FLIGHT");
  unsetenv("FERRY_VERIFY");
}

TEST(Update, NoRanksIsAFailedPrecondition) {
  auto t = coordinator::Trainer::create({});
  ASSERT_TRUE(t.ok());
  Status st = (*t)->start_weight_update(1, sharding::llama_manifest(tiny_llama()));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ferry::testutil

namespace ferry::testutil {
namespace {

// FERRY_ROLLBACK=host: an aborted update restores every written layer in place and the replica
// resumes, all ranks together, on the version it served before.
TEST(Update, RollbackResumesThePreviousVersion) {
  setenv("FERRY_ROLLBACK", "host", 1);
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  unsetenv("FERRY_ROLLBACK");
  Checkpoint a(c.manifest(), 1), b(c.manifest(), 2);
  ASSERT_TRUE(c.update(1, a).ok());
  const uint64_t f0 = c.rank(0).fingerprint(), f1 = c.rank(1).fingerprint();
  ASSERT_TRUE(c.trainer().start_weight_update(2, c.manifest()).ok());
  for (const auto& [name, v] : b.views) {
    if (name == "model.layers.1.mlp.down_proj.weight") continue;
    ASSERT_TRUE(c.trainer().send(name, v).ok());
  }
  ASSERT_FALSE(c.trainer().finish_weight_update().ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(c.rank(i).worker->wait_serving(10'000).ok()) << "rank " << i << " did not resume";
    EXPECT_TRUE(c.rank(i).worker->consistent());
    EXPECT_EQ(c.rank(i).worker->weight_version(), 1u);
    EXPECT_EQ(c.rank(i).resumes, 2);
    EXPECT_EQ(c.rank(i).last_resume, 1u);
  }
  EXPECT_EQ(c.rank(0).fingerprint(), f0);
  EXPECT_EQ(c.rank(1).fingerprint(), f1);
  auto r = c.update(3, b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->moved, 0u);
}

}  // namespace
}  // namespace ferry::testutil

namespace ferry::testutil {
namespace {

// Rolling updates: one replica is updated while the other keeps serving, then the other, at the
// same version; no replica is paused by the other's update.
TEST(Update, RollingUpdateLeavesTheOtherReplicaServing) {
  auto trainer = coordinator::Trainer::create({});
  ASSERT_TRUE(trainer.ok());
  const auto cfg = tiny_llama();
  std::vector<std::unique_ptr<Rank>> replicas;
  for (int replica = 0; replica < 2; ++replica) {
    auto rank = std::make_unique<Rank>();
    auto spec = sharding::llama_rank_spec(cfg, 0, 1, Scheme::kFp8PerTensor);
    ASSERT_TRUE(spec.ok());
    spec->replica = replica;
    auto storage = reload::ModelStorage::allocate(*spec, Device::cpu());
    ASSERT_TRUE(storage.ok());
    rank->storage = std::make_unique<reload::ModelStorage>(std::move(*storage));
    coordinator::RolloutOptions o;
    o.coordinator = (*trainer)->coordinator_address();
    o.spec = *spec;
    o.storage = rank->storage.get();
    Rank* raw = rank.get();
    o.pause = [raw](const coordinator::PauseRequest&) {
      raw->pauses++;
      return ok_status();
    };
    auto w = coordinator::RolloutWorker::create(std::move(o));
    ASSERT_TRUE(w.ok());
    rank->worker = std::move(*w);
    replicas.push_back(std::move(rank));
  }
  ASSERT_TRUE((*trainer)->wait_for_ranks(2, 10'000).ok());
  const auto manifest = sharding::llama_manifest(cfg);
  Checkpoint ck(manifest, 1);
  for (int group = 0; group < 2; ++group) {
    coordinator::UpdateOptions uo;
    uo.replicas = {group};
    ASSERT_TRUE((*trainer)->start_weight_update(1, manifest, uo).ok());
    coordinator::MapSource src(ck.views);
    ASSERT_TRUE((*trainer)->update_weights(src).ok());
    auto r = (*trainer)->finish_weight_update();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->ranks, 1);
    EXPECT_EQ(replicas[static_cast<size_t>(group)]->worker->weight_version(), 1u);
    EXPECT_EQ(replicas[static_cast<size_t>(group)]->pauses, 1);
    if (group == 0) {
      EXPECT_EQ(replicas[1]->pauses, 0);  // kept serving
      EXPECT_EQ(replicas[1]->worker->weight_version(), 0u);
    }
  }
  EXPECT_EQ(replicas[0]->fingerprint(), replicas[1]->fingerprint());
}

}  // namespace
}  // namespace ferry::testutil
