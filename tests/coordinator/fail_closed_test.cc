// Fail closed, on real processes and sockets: a replica short of a rank is never updated (or resumed)
// in part; a failing resume hook fails the update and leaves its replica not serving; the coordinator
// keeps accepting after a burst that exhausts its descriptors; unauthenticated connections are
// capped, bounded and timed out; a rank tells a lost coordinator from the end of the job.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/status_client.h"
#include "dataplane/bucket.h"
#include "dataplane/credential.h"
#include "tests/common/sibling_binary.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/process.h"
#include "tests/coordinator/raw_socket.h"
#include "tests/coordinator/status_util.h"
#include "transport/transport.h"

namespace ferry::testutil {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// Every deadline of these tests (heartbeats, joining, each phase); generous enough for a loaded
// machine under a sanitizer, and what the timing assertions scale with.
constexpr int64_t kTimeoutMs = 3000;

class FailClosed : public ::testing::Test {
 protected:
  void SetUp() override { setenv("FERRY_TIMEOUT_MS", std::to_string(kTimeoutMs).c_str(), 1); }
  void TearDown() override { unsetenv("FERRY_TIMEOUT_MS"); }

  static std::unique_ptr<Child> rollout(const std::string& address, int rank, int tp, const std::string& log = "") {
    const std::string cmd = fmt::format("exec {} rollout {} {} {}{}", sibling_binary(FERRY_FAULT_PEER), address, rank,
                                        tp, log.empty() ? "" : " 2> " + log);
    return std::make_unique<Child>(std::vector<std::string>{"/bin/sh", "-c", cmd});
  }
  // Polls `address` until `n` rollout ranks are members.
  static bool wait_members(const std::string& address, int n) {
    for (auto until = Clock::now() + std::chrono::seconds(20); Clock::now() < until;) {
      auto s = coordinator::query_status(address, 5000, load_settings().value());
      int k = 0;
      for (const auto& m : s.ok() ? s->members() : decltype(s->members()){}) k += m.role() == "rollout";
      if (k >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  static std::string read_file(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  // Waits for a child to publish its coordinator's address in `file`.
  static std::string published(const std::string& file) {
    for (auto until = Clock::now() + std::chrono::seconds(20); Clock::now() < until;) {
      if (std::filesystem::exists(file)) return read_file(file);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "";
  }
  std::string temp(const std::string& name) const {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    return (std::filesystem::temp_directory_path() / fmt::format("ferry-{}-{}-{}", info->name(), getpid(), name)).string();
  }
};

Result<coordinator::UpdateReport> full_update(coordinator::Trainer& t, uint64_t v,
                                             const coordinator::UpdateOptions& o = {}) {
  const auto manifest = sharding::llama_manifest(tiny_llama());
  Checkpoint ck(manifest, v);
  FERRY_RETURN_IF_ERROR(t.start_weight_update(v, manifest, o));
  coordinator::MapSource src(ck.views);
  FERRY_RETURN_IF_ERROR(t.update_weights(src));
  return t.finish_weight_update();
}

// Issue case 1: a rank killed while idle. The next update used to resume rank 0 alone at the new
// version and report `ok ranks=1`; now it fails before anything pauses, naming the rank, and the
// survivor keeps serving its old version untouched.
TEST_F(FailClosed, UpdateOfAReplicaMissingARankFailsBeforeAnyPause) {
  auto trainer = coordinator::Trainer::create({});
  ASSERT_TRUE(trainer.ok());
  const std::string addr = (*trainer)->coordinator_address();
  auto r0 = rollout(addr, 0, 2);
  auto r1 = rollout(addr, 1, 2);
  ASSERT_TRUE((*trainer)->wait_for_ranks(2, 20'000).ok());
  ASSERT_TRUE(full_update(**trainer, 1).ok());
  r1->signal(SIGKILL);
  ASSERT_EQ(r1->wait_exit(5000), 128 + SIGKILL);
  wait_gone(addr, 1);
  auto r = full_update(**trainer, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("replica 0 is missing rank 1 of 2"));
  EXPECT_THAT(r.status().message(), HasSubstr("nothing was paused"));
  auto s = status(addr);
  ASSERT_NE(rank(s, 0), nullptr);
  EXPECT_EQ(rank(s, 0)->version(), 1u);
  EXPECT_EQ(rank(s, 0)->state(), "serving");
  EXPECT_TRUE(rank(s, 0)->consistent());
  ASSERT_NE(replica(s, 0), nullptr);
  EXPECT_EQ(replica(s, 0)->state(), "incomplete");
  EXPECT_FALSE(replica(s, 0)->serving());
  ASSERT_EQ(replica(s, 0)->missing_ranks_size(), 1);
  EXPECT_EQ(replica(s, 0)->missing_ranks(0), 1);
  ASSERT_FALSE(s.updates().empty());
  EXPECT_EQ(s.updates(s.updates_size() - 1).version(), 1u);  // v2 never started

  // The restarted rank joins at v0 below its replica's v1; the next update brings both to v3 at once.
  auto r1b = rollout(addr, 1, 2);
  ASSERT_TRUE((*trainer)->wait_for_ranks(2, 20'000).ok());
  auto ok = full_update(**trainer, 3);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->ranks, 2);
  s = status(addr);
  EXPECT_TRUE(replica(s, 0)->serving());
  EXPECT_EQ(replica(s, 0)->version(), 3u);
}

// A rolling update may leave out a replica short of ranks, but only when it names the others.
TEST_F(FailClosed, RollingUpdateWithoutTheShortReplicaIsAllowed) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  // A second replica, TP 2, whose rank 1 never joins.
  auto spec = sharding::llama_rank_spec(tiny_llama(), 0, 2, Scheme::kFp8PerTensor);
  ASSERT_TRUE(spec.ok());
  spec->replica = 1;
  auto storage = reload::ModelStorage::allocate(*spec, Device::cpu());
  ASSERT_TRUE(storage.ok());
  coordinator::RolloutOptions o;
  o.coordinator = c.trainer().coordinator_address();
  o.spec = *spec;
  o.storage = &*storage;
  auto lonely = coordinator::RolloutWorker::create(std::move(o));
  ASSERT_TRUE(lonely.ok());
  ASSERT_TRUE(c.trainer().wait_for_ranks(2, 10'000).ok());
  auto all = full_update(c.trainer(), 1);
  ASSERT_FALSE(all.ok());
  EXPECT_THAT(all.status().message(), HasSubstr("replica 1 is missing rank 1 of 2 (it has not joined)"));
  EXPECT_EQ(c.rank(0).pauses.load(), 0);
  coordinator::UpdateOptions only0;
  only0.replicas = {0};
  auto some = full_update(c.trainer(), 1, only0);
  ASSERT_TRUE(some.ok()) << some.status().to_string();
  EXPECT_EQ(c.rank(0).worker->weight_version(), 1u);
  EXPECT_EQ((*lonely)->weight_version(), 0u);
  EXPECT_TRUE((*lonely)->paused());
}

// Issue case 2: a resume hook that fails on one rank fails finish_weight_update with the rank named;
// the replica is reported not serving until the rank's own retry succeeds.
TEST_F(FailClosed, FailingResumeHookFailsTheUpdateAndTheReplicaIsNotServing) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  const std::string addr = c.trainer().coordinator_address();
  Checkpoint ck1(c.manifest(), 1);
  ASSERT_TRUE(c.update(1, ck1).ok());
  c.rank(1).fail_resume = true;
  Checkpoint ck2(c.manifest(), 2);
  auto r = c.update(2, ck2);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("resume hook failed"));
  EXPECT_THAT(r.status().message(), HasSubstr("replica 0 rank 1"));
  EXPECT_THAT(r.status().message(), HasSubstr("could not restart its scheduler"));
  EXPECT_TRUE(c.rank(1).worker->paused());
  EXPECT_EQ(c.rank(1).worker->weight_version(), 2u);  // the storage holds v2 complete
  auto s = status(addr);
  EXPECT_EQ(replica(s, 0)->state(), "resume-failed");
  EXPECT_FALSE(replica(s, 0)->serving());
  EXPECT_EQ(rank(s, 1)->state(), "resume-failed");
  ASSERT_FALSE(s.updates().empty());
  EXPECT_FALSE(s.updates(s.updates_size() - 1).ok());

  // The rank retries on its own once its engine can run again.
  EXPECT_FALSE(c.rank(1).worker->resume().ok());
  c.rank(1).fail_resume = false;
  ASSERT_TRUE(c.rank(1).worker->resume().ok());
  EXPECT_FALSE(c.rank(1).worker->paused());
  for (auto until = Clock::now() + std::chrono::seconds(5); Clock::now() < until;) {
    s = status(addr);
    if (replica(s, 0)->serving()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(replica(s, 0)->serving());
  EXPECT_EQ(replica(s, 0)->version(), 2u);
  Checkpoint ck3(c.manifest(), 3);
  auto next = c.update(3, ck3);
  ASSERT_TRUE(next.ok()) << next.status().to_string();
}

// After a failed send the update can be ended; the ranks stay paused and inconsistent, a later update
// lands.
TEST_F(FailClosed, AbortWeightUpdateEndsAnOpenUpdate) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  EXPECT_EQ(c.trainer().abort_weight_update("nothing open").code(), StatusCode::kFailedPrecondition);
  const auto manifest = c.manifest();
  Checkpoint ck(manifest, 1);
  ASSERT_TRUE(c.trainer().start_weight_update(1, manifest).ok());
  ASSERT_TRUE(c.trainer().send(manifest[0].name, ck.views.at(manifest[0].name)).ok());
  ASSERT_TRUE(c.trainer().abort_weight_update("the optimizer step diverged").ok());
  EXPECT_FALSE(c.trainer().finish_weight_update().ok());
  auto s = status(c.trainer().coordinator_address());
  EXPECT_EQ(s.phase(), "idle");
  ASSERT_FALSE(s.updates().empty());
  EXPECT_THAT(s.updates(s.updates_size() - 1).error(), HasSubstr("the optimizer step diverged"));
  for (int k = 0; k < 2; ++k) {
    EXPECT_FALSE(c.rank(k).worker->consistent());
    EXPECT_TRUE(c.rank(k).worker->paused());
  }
  auto ok = c.update(2, Checkpoint(manifest, 2));
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_TRUE(c.rank(0).worker->consistent());
}

TEST_F(FailClosed, UnknownPauseModeIsRefusedAtStart) {
  Cluster c(1);
  ASSERT_TRUE(c.start().ok());
  coordinator::UpdateOptions o;
  o.pause_mode = "bogus";
  auto r = full_update(c.trainer(), 1, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("pause mode 'bogus' is not one of abort, wait, keep"));
  EXPECT_EQ(c.rank(0).pauses.load(), 0);
}

// Issue case 3: 1,500 connections opened at once and closed at a coordinator limited to 1024
// descriptors; it keeps accepting: ranks join and an update lands. (The bound on connections waiting
// to join keeps it from running out of descriptors at all; the accept loop's back-off on EMFILE is
// tested on a tcp listener in tests/transport/accept_test.cc.)
TEST_F(FailClosed, CoordinatorSurvivesAConnectionBurstPastItsDescriptorLimit) {
  for (const char* limit : {"1024"}) {
    SCOPED_TRACE(limit);
    const std::string file = temp(std::string("addr-") + limit);
    Child coord({sibling_binary(FERRY_FAULT_PEER), "coordinator", file, limit});
    const std::string addr = published(file);
    ASSERT_FALSE(addr.empty());
    {
      std::vector<std::unique_ptr<RawSocket>> burst;
      int opened = 0;
      for (int i = 0; i < 1500; ++i) {
        burst.push_back(std::make_unique<RawSocket>(addr));
        opened += burst.back()->ok();
      }
      EXPECT_EQ(opened, 1500);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }  // all closed
    auto r0 = rollout(addr, 0, 2);
    auto r1 = rollout(addr, 1, 2);
    ASSERT_TRUE(wait_members(addr, 2));
    coordinator::TrainerOptions o;
    o.coordinator = addr;
    auto trainer = coordinator::Trainer::create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
    auto ok = full_update(**trainer, 1);
    ASSERT_TRUE(ok.ok()) << ok.status().to_string();
    std::filesystem::remove(file);
  }
}

// Issue case 4: a frame header announcing 64 MiB before the hello is refused at once (nothing
// reserved); 200 idle and 20 trickling connections that never join are closed within the deadline,
// while an update lands.
TEST_F(FailClosed, UnauthenticatedConnectionsAreCappedBoundedAndTimedOut) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  const std::string addr = c.trainer().coordinator_address();
  {
    RawSocket big(addr);
    ASSERT_TRUE(big.ok());
    ASSERT_TRUE(big.write(frame_header(64u << 20)));
    EXPECT_TRUE(big.closed_by_peer(1000));
  }
  std::vector<std::unique_ptr<RawSocket>> idle, trickle;
  for (int i = 0; i < 200; ++i) idle.push_back(std::make_unique<RawSocket>(addr));
  for (int i = 0; i < 20; ++i) trickle.push_back(std::make_unique<RawSocket>(addr));
  std::atomic<bool> stop{false};
  std::thread drip([&] {
    // One byte of a 1000-byte hello per connection every 100 ms: never a whole frame in time.
    const std::string header = frame_header(1000);
    for (size_t i = 0; !stop && i < 100; ++i) {
      for (auto& t : trickle) t->write(i < header.size() ? header.substr(i, 1) : std::string(1, 'x'));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const auto t0 = Clock::now();
  Checkpoint ck(c.manifest(), 1);
  auto r = c.update(1, ck);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  for (auto* group : {&idle, &trickle}) {
    for (auto& s : *group) EXPECT_TRUE(s->closed_by_peer(static_cast<int>(3 * kTimeoutMs)));
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.0 * kTimeoutMs / 1000);
  stop = true;
  drip.join();
  // Members are untouched by all this: the next update lands too.
  auto again = c.update(2, Checkpoint(c.manifest(), 2));
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

// Issue case 5: with FERRY_TOKEN set, a process that never joined connects to a rank's data port
// and sends well-formed buckets of the open update, claiming to be each of the first members with a
// credential it cannot compute. None is admitted: the update lands exactly as a clean one does.
TEST_F(FailClosed, DataPortRefusesAStrangerWithoutTheKey) {
  setenv("FERRY_TOKEN", "correct horse", 1);
  setenv("FERRY_TRANSPORT", "tcp", 1);
  struct Unset {
    ~Unset() {
      unsetenv("FERRY_TOKEN");
      unsetenv("FERRY_TRANSPORT");
    }
  } unset;
  Cluster c(1, "none"), clean(1, "none");
  ASSERT_TRUE(c.start().ok());
  ASSERT_TRUE(clean.start().ok());
  const auto manifest = c.manifest();
  Checkpoint ck(manifest, 2);
  ASSERT_TRUE(clean.update(2, ck).ok());
  ASSERT_TRUE(c.trainer().start_weight_update(2, manifest).ok());
  std::string blob;
  for (const auto& e : c.rank(0).worker->data_endpoints()) {
    if (e.transport == "tcp") blob = e.blob;
  }
  ASSERT_FALSE(blob.empty());
  auto stranger = transport::create_transport("tcp");
  ASSERT_TRUE(stranger.ok());
  dataplane::BucketBuilder forged(1 << 16);
  size_t admitted = 0;
  for (int claimed = 1; claimed <= 6; ++claimed) {
    forged.reset(2, claimed, 0);
    uint8_t* p = forged.add_piece(0, Region{{0}, {16}}, DType::kBF16, 32);
    std::memset(p, 0x7f, 32);
    auto n = forged.seal(false);
    ASSERT_TRUE(n.ok());
    std::string credential(dataplane::kDataCredentialBytes - 32, '\0');
    credential[0] = static_cast<char>(claimed);
    credential[8] = 1;                   // a 4 GiB bucket announced
    credential += std::string(32, 'x');  // no key: an HMAC it cannot compute
    auto conn = (*stranger)->connect(blob, Clock::now() + std::chrono::seconds(2), credential);
    if (!conn.ok()) continue;
    auto region = (*stranger)->register_memory(forged.data(), *n, Device::cpu());
    ASSERT_TRUE(region.ok());
    auto h = (*conn)->post(**region, 0, *n);
    if (h.ok() && (*h)->wait(Clock::now() + std::chrono::seconds(2)).ok()) ++admitted;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  coordinator::MapSource src(ck.views);
  ASSERT_TRUE(c.trainer().update_weights(src).ok());
  auto r = c.trainer().finish_weight_update();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(c.rank(0).fingerprint(), clean.rank(0).fingerprint());
  (void)admitted;  // a post may complete into the socket before the refusal closes it
}

// Issue case 7: the trainer that embeds the coordinator is killed mid-update; each rank exits
// non-zero saying it is paused on an incomplete version (before: exit 0, nothing printed).
TEST_F(FailClosed, RankTellsALostCoordinatorFromTheEndOfTheJob) {
  const std::string file = temp("addr");
  Child trainer({sibling_binary(FERRY_FAULT_PEER), "embedded", file, "2", "7"});
  const std::string addr = published(file);
  ASSERT_FALSE(addr.empty());
  const std::string log0 = temp("rank0.log"), log1 = temp("rank1.log");
  auto r0 = rollout(addr, 0, 2, log0);
  auto r1 = rollout(addr, 1, 2, log1);
  ASSERT_TRUE(trainer.wait_stopped());
  trainer.signal(SIGKILL);
  EXPECT_EQ(r0->wait_exit(10'000), 4);
  EXPECT_EQ(r1->wait_exit(10'000), 4);
  for (const auto& log : {log0, log1}) {
    const std::string text = read_file(log);
    EXPECT_THAT(text, HasSubstr("lost the coordinator"));
    EXPECT_THAT(text, HasSubstr("paused on an incomplete version (update v2 was under way"));
    std::filesystem::remove(log);
  }
  std::filesystem::remove(file);
}

// The normal end: the trainer (and its coordinator) closes; the ranks say goodbye with status 0.
TEST_F(FailClosed, RanksEndCleanlyWhenTheJobEnds) {
  auto trainer = coordinator::Trainer::create({});
  ASSERT_TRUE(trainer.ok());
  const std::string addr = (*trainer)->coordinator_address();
  auto r0 = rollout(addr, 0, 1);
  ASSERT_TRUE((*trainer)->wait_for_ranks(1, 20'000).ok());
  auto replica1 = full_update(**trainer, 1);
  ASSERT_TRUE(replica1.ok());
  trainer->reset();
  EXPECT_EQ(r0->wait_exit(10'000), 0);
}

}  // namespace
}  // namespace ferry::testutil
