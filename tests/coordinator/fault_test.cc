// Faults on real processes and sockets: dead and stopped peers, garbage and oversized frames, a
// wrong token, a protocol mismatch. Each asserts no hang past the deadline, a surviving coordinator,
// no replica resuming with mixed versions, a clear error, and a successful update after recovery.
#include <chrono>
#include <cstdlib>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/coordinator.h"
#include "coordinator/status_client.h"
#include "core/version.h"
#include "tests/common/sibling_binary.h"
#include "tests/coordinator/cluster.h"
#include "tests/coordinator/process.h"
#include "tests/coordinator/raw_socket.h"
#include "tests/coordinator/status_util.h"

namespace ferry::testutil {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

constexpr int64_t kTimeoutMs = 1500;

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override { setenv("FERRY_TIMEOUT_MS", std::to_string(kTimeoutMs).c_str(), 1); }
  void TearDown() override {
    unsetenv("FERRY_TIMEOUT_MS");
    unsetenv("FERRY_TOKEN");
  }

 public:
  static std::unique_ptr<Child> rollout(const std::string& address, int rank, int tp) {
    return std::make_unique<Child>(std::vector<std::string>{sibling_binary(FERRY_FAULT_PEER), "rollout", address,
                                                            std::to_string(rank), std::to_string(tp)});
  }
};

Result<coordinator::UpdateReport> full_update(coordinator::Trainer& t, uint64_t v) {
  const auto manifest = sharding::llama_manifest(tiny_llama());
  Checkpoint ck(manifest, v);
  FERRY_RETURN_IF_ERROR(t.start_weight_update(v, manifest));
  coordinator::MapSource src(ck.views);
  FERRY_RETURN_IF_ERROR(t.update_weights(src));
  return t.finish_weight_update();
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A trainer with the embedded coordinator, two rollout ranks as child processes, and version 1 landed.
struct Replica2 {
  Result<std::unique_ptr<coordinator::Trainer>> trainer = Status::internal("not started");
  std::string addr;
  std::unique_ptr<Child> r0, r1;

  void start() {
    trainer = coordinator::Trainer::create({});
    ASSERT_TRUE(trainer.ok());
    addr = (*trainer)->coordinator_address();
    r0 = FaultTest::rollout(addr, 0, 2);
    r1 = FaultTest::rollout(addr, 1, 2);
    ASSERT_TRUE((*trainer)->wait_for_ranks(2, 10'000).ok());
    ASSERT_TRUE(full_update(**trainer, 1).ok());
  }
};

TEST_F(FaultTest, RolloutKilledMidTransfer) {
  Replica2 c;
  ASSERT_NO_FATAL_FAILURE(c.start());
  auto& trainer = c.trainer;
  auto& r1 = c.r1;
  const std::string addr = c.addr;

  const auto manifest = sharding::llama_manifest(tiny_llama());
  Checkpoint ck(manifest, 2);
  ASSERT_TRUE((*trainer)->start_weight_update(2, manifest).ok());
  size_t i = 0;
  for (const auto& t : manifest) {
    if (i++ == manifest.size() / 2) {
      r1->signal(SIGKILL);
      ASSERT_EQ(r1->wait_exit(5000), 128 + SIGKILL);
    }
    (*trainer)->send(t.name, ck.views.at(t.name)).ignore_error();  // sends to the dead rank may fail
  }
  const auto t0 = Clock::now();
  auto r = (*trainer)->finish_weight_update();
  ASSERT_FALSE(r.ok());
  EXPECT_LT(seconds_since(t0), 4.0 * kTimeoutMs / 1000);
  EXPECT_THAT(r.status().message(), HasSubstr("rank 1"));
  // The survivor stays paused and inconsistent at its old version: no mixed model is served.
  auto s = status(addr);
  const auto* m0 = rank(s, 0);
  ASSERT_NE(m0, nullptr);
  EXPECT_FALSE(m0->consistent());
  EXPECT_EQ(m0->version(), 1u);
  EXPECT_EQ(rank(s, 1), nullptr);

  auto r1b = rollout(addr, 1, 2);  // a restarted rank rejoins and gets a full update
  ASSERT_TRUE((*trainer)->wait_for_ranks(2, 10'000).ok());
  auto ok = full_update(**trainer, 3);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  s = status(addr);
  for (int k = 0; k < 2; ++k) {
    ASSERT_NE(rank(s, k), nullptr);
    EXPECT_TRUE(rank(s, k)->consistent());
    EXPECT_EQ(rank(s, k)->version(), 3u);
  }
}

TEST_F(FaultTest, TrainerKilledMidTransfer) {
  auto coord = coordinator::Coordinator::start({});
  ASSERT_TRUE(coord.ok());
  const std::string addr = (*coord)->address();
  auto r0 = rollout(addr, 0, 2);
  auto r1 = rollout(addr, 1, 2);
  ASSERT_TRUE((*coord)->wait_for_ranks(2, 10'000).ok());
  Child trainer({sibling_binary(FERRY_FAULT_PEER), "trainer", addr, "1", "7"});
  ASSERT_TRUE(trainer.wait_stopped());
  trainer.signal(SIGKILL);
  ASSERT_EQ(trainer.wait_exit(5000), 128 + SIGKILL);

  // The coordinator survives, aborts the update and keeps the ranks paused and inconsistent.
  const auto t0 = Clock::now();
  wire::StatusReply s;
  do {
    s = status(addr);
  } while (s.phase() != "idle" && seconds_since(t0) < 4.0 * kTimeoutMs / 1000);
  EXPECT_EQ(s.phase(), "idle");
  ASSERT_GE(s.updates_size(), 1);
  EXPECT_FALSE(s.updates(s.updates_size() - 1).ok());
  EXPECT_THAT(s.updates(s.updates_size() - 1).error(), HasSubstr("trainer"));
  for (int k = 0; k < 2; ++k) {
    ASSERT_NE(rank(s, k), nullptr);
    EXPECT_FALSE(rank(s, k)->consistent());
    EXPECT_EQ(rank(s, k)->version(), 0u);
  }
  coordinator::TrainerOptions o;
  o.coordinator = addr;
  auto next = coordinator::Trainer::create(o);
  ASSERT_TRUE(next.ok());
  auto ok = full_update(**next, 2);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST_F(FaultTest, StoppedRankMeetsTheDeadline) {
  Replica2 c;
  ASSERT_NO_FATAL_FAILURE(c.start());
  auto& trainer = c.trainer;
  auto& r1 = c.r1;
  const std::string addr = c.addr;
  r1->signal(SIGSTOP);
  const auto t0 = Clock::now();
  auto r = full_update(**trainer, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(seconds_since(t0), 4.0 * kTimeoutMs / 1000);
  EXPECT_THAT(r.status().code(), AnyOf(StatusCode::kDeadlineExceeded, StatusCode::kUnavailable));
  EXPECT_THAT(r.status().message(), HasSubstr("rank 1"));
  r1->signal(SIGKILL);
  r1->wait_exit(5000);
  wait_gone(addr, 1);
  auto r1b = rollout(addr, 1, 2);
  ASSERT_TRUE((*trainer)->wait_for_ranks(2, 10'000).ok());
  auto ok = full_update(**trainer, 3);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST_F(FaultTest, BadFramesCloseOnlyTheirConnection) {
  Cluster c(2);
  ASSERT_TRUE(c.start().ok());
  const std::string addr = c.trainer().coordinator_address();
  {
    RawSocket garbage(addr);  // a well-sized frame that is not an Envelope
    ASSERT_TRUE(garbage.ok());
    ASSERT_TRUE(garbage.write(frame_header(12) + std::string("\xff\xff\xff\xff garbage", 12)));
    EXPECT_TRUE(garbage.closed_by_peer());
  }
  {
    RawSocket oversized(addr);  // a length far over FERRY_MAX_FRAME_BYTES
    ASSERT_TRUE(oversized.ok());
    ASSERT_TRUE(oversized.write(frame_header(0xfffffff0u)));
    EXPECT_TRUE(oversized.closed_by_peer());
  }
  {
    RawSocket truncated(addr);  // a frame cut off mid-way by a closed socket
    ASSERT_TRUE(truncated.ok());
    ASSERT_TRUE(truncated.write(frame_header(100) + std::string(10, 'x')));
  }
  {
    RawSocket early(addr);  // a valid message before hello
    ASSERT_TRUE(early.ok());
    wire::Envelope env;
    env.mutable_finish_update()->set_version(9);
    ASSERT_TRUE(early.write(coordinator::encode_frame(env)));
    EXPECT_TRUE(early.closed_by_peer());
  }
  Checkpoint ck(c.manifest(), 1);
  auto r = c.update(1, ck);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
}

TEST_F(FaultTest, ProtocolMismatchIsRefused) {
  auto coord = coordinator::Coordinator::start({});
  ASSERT_TRUE(coord.ok());
  RawSocket s((*coord)->address());
  ASSERT_TRUE(s.ok());
  wire::Envelope challenge;
  ASSERT_TRUE(s.read_frame(&challenge));
  ASSERT_TRUE(challenge.has_challenge());
  EXPECT_EQ(challenge.challenge().protocol_version(), kProtocolVersion);
  wire::Envelope hello;
  hello.mutable_hello()->set_protocol_version(kProtocolVersion + 100);
  hello.mutable_hello()->set_role("trainer");
  ASSERT_TRUE(s.write(coordinator::encode_frame(hello)));
  wire::Envelope welcome;
  ASSERT_TRUE(s.read_frame(&welcome));
  ASSERT_TRUE(welcome.has_welcome());
  EXPECT_EQ(welcome.welcome().status().code(), static_cast<int>(StatusCode::kFailedPrecondition));
  EXPECT_THAT(welcome.welcome().status().message(), HasSubstr("protocol version"));
  EXPECT_TRUE(s.closed_by_peer());
}

TEST_F(FaultTest, TokenIsRequiredAndChecked) {
  setenv("FERRY_TOKEN", "correct horse", 1);
  auto coord = coordinator::Coordinator::start({});
  ASSERT_TRUE(coord.ok());
  coordinator::TrainerOptions o;
  o.coordinator = (*coord)->address();
  {
    auto t = coordinator::Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
  }
  setenv("FERRY_TOKEN", "battery staple", 1);
  auto wrong = coordinator::Trainer::create(o);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnauthenticated);
  unsetenv("FERRY_TOKEN");
  auto missing = coordinator::Trainer::create(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kUnauthenticated);
  // A raw client that answers with garbage is refused too, and the coordinator still serves.
  RawSocket s((*coord)->address());
  wire::Envelope challenge;
  ASSERT_TRUE(s.read_frame(&challenge));
  EXPECT_TRUE(challenge.challenge().token_required());
  EXPECT_EQ(challenge.challenge().nonce().size(), 32u);
  wire::Envelope hello;
  hello.mutable_hello()->set_protocol_version(kProtocolVersion);
  hello.mutable_hello()->set_role("observer");
  hello.mutable_hello()->set_auth(std::string(32, 'x'));
  ASSERT_TRUE(s.write(coordinator::encode_frame(hello)));
  wire::Envelope welcome;
  ASSERT_TRUE(s.read_frame(&welcome));
  EXPECT_EQ(welcome.welcome().status().code(), static_cast<int>(StatusCode::kUnauthenticated));
  setenv("FERRY_TOKEN", "correct horse", 1);
  auto again = coordinator::Trainer::create(o);
  EXPECT_TRUE(again.ok());
}

}  // namespace
}  // namespace ferry::testutil
