// CoordinatorCore without sockets: conversations of members through the real admission, membership
// and update machine, checked by the replies each member would read.
#include <gtest/gtest.h>

#include "core/version.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/wire.h"

namespace ferry::coordinator {
namespace {

// Frames sent to a member are written to a socket that is not connected; what matters here is the
// coordinator's state, read through status().
class Conversation {
 public:
  Conversation() : core_(io_, options()) {}
  ~Conversation() {
    core_.stop("test ended");
    io_.restart();
    io_.poll();
  }

  static CoreOptions options() {
    CoreOptions o;
    o.timeout_ms = 3'600'000;
    o.nonce = [] { return Result<std::string>(std::string(32, 'n')); };
    return o;
  }

  std::shared_ptr<Channel> join(const std::string& role, int replica = 0, int tp_rank = 0, int tp = 2) {
    auto c = std::make_shared<Channel>(boost::asio::ip::tcp::socket(io_), kPreAuthFrameBytes);
    EXPECT_TRUE(core_.on_connect(c).ok());
    wire::Envelope hello;
    hello.mutable_hello()->set_protocol_version(kProtocolVersion);
    hello.mutable_hello()->set_role(role);
    core_.on_message(c, hello);
    if (role == "rollout") {
      wire::Envelope reg;
      auto* s = reg.mutable_registration()->mutable_spec();
      s->set_replica(replica);
      s->set_tp_rank(tp_rank);
      s->set_tp_size(tp);
      reg.mutable_registration()->add_endpoints()->set_transport("tcp");
      core_.on_message(c, reg);
    }
    return c;
  }

  void send(const std::shared_ptr<Channel>& c, wire::Envelope env) { core_.on_message(c, env); }

  wire::StatusReply status() const { return core_.status(); }

 private:
  boost::asio::io_context io_;
  CoordinatorCore core_;
};

wire::Envelope ack(wire::Envelope::BodyCase kind, uint64_t version, int code = 0) {
  wire::Envelope e;
  wire::Status* st = nullptr;
  switch (kind) {
    case wire::Envelope::kPauseAck:
      e.mutable_pause_ack()->set_version(version);
      st = e.mutable_pause_ack()->mutable_status();
      break;
    case wire::Envelope::kFinalized:
      e.mutable_finalized()->set_version(version);
      st = e.mutable_finalized()->mutable_status();
      break;
    default:
      e.mutable_resume_ack()->set_version(version);
      st = e.mutable_resume_ack()->mutable_status();
  }
  st->set_code(code);
  if (code) st->set_message("the engine could not restart");
  return e;
}

// A rank whose resume hook failed and that retries it successfully before the replica's other rank
// answers: the update ends ok and the replica serves (the retry used to be dropped as a duplicate).
TEST(CoordinatorCore, ResumeRetriedBeforeTheOtherRanksAnswerCounts) {
  Conversation conv;
  auto trainer = conv.join("trainer");
  auto r0 = conv.join("rollout", 0, 0);
  auto r1 = conv.join("rollout", 0, 1);
  wire::Envelope start;
  start.mutable_start_update()->set_version(1);
  conv.send(trainer, start);  // an empty manifest checks against empty specs
  for (auto& r : {r0, r1}) conv.send(r, ack(wire::Envelope::kPauseAck, 1));
  ASSERT_EQ(conv.status().phase(), "transferring");
  wire::Envelope finish;
  finish.mutable_finish_update()->set_version(1);
  finish.mutable_finish_update()->add_buckets(0);
  finish.mutable_finish_update()->add_buckets(0);
  conv.send(trainer, finish);
  for (auto& r : {r0, r1}) conv.send(r, ack(wire::Envelope::kFinalized, 1));
  ASSERT_EQ(conv.status().phase(), "resuming");
  conv.send(r0, ack(wire::Envelope::kResumeAck, 1, static_cast<int>(StatusCode::kInternal)));
  conv.send(r0, ack(wire::Envelope::kResumeAck, 1));  // its own retry
  conv.send(r1, ack(wire::Envelope::kResumeAck, 1));
  const auto s = conv.status();
  EXPECT_EQ(s.phase(), "idle");
  ASSERT_EQ(s.updates_size(), 1);
  EXPECT_TRUE(s.updates(0).ok()) << s.updates(0).error();
  ASSERT_EQ(s.replicas_size(), 1);
  EXPECT_TRUE(s.replicas(0).serving()) << s.replicas(0).state();
}

// A hook that fails after a rollback's resume is reported: the replica is not serving.
TEST(CoordinatorCore, FailedHookAfterARollbackResumeMarksTheReplica) {
  Conversation conv;
  auto trainer = conv.join("trainer");
  auto r0 = conv.join("rollout", 0, 0, 1);
  wire::Envelope start;
  start.mutable_start_update()->set_version(1);
  conv.send(trainer, start);
  conv.send(r0, ack(wire::Envelope::kPauseAck, 1, static_cast<int>(StatusCode::kInternal)));  // aborts
  wire::Envelope aborted;
  aborted.mutable_abort_ack()->set_version(1);
  aborted.mutable_abort_ack()->set_rolled_back(true);
  aborted.mutable_abort_ack()->set_serving_version(0);
  conv.send(r0, aborted);
  ASSERT_TRUE(conv.status().replicas(0).serving());
  conv.send(r0, ack(wire::Envelope::kResumeAck, 0, static_cast<int>(StatusCode::kInternal)));
  EXPECT_FALSE(conv.status().replicas(0).serving());
  EXPECT_EQ(conv.status().replicas(0).state(), "resume-failed");
}

TEST(CoordinatorCore, OnlyTrainersStartUpdatesAndHugeReplicasAreRefused) {
  Conversation conv;
  auto observer = conv.join("observer");
  auto r0 = conv.join("rollout", 0, 0, 1);
  auto huge = conv.join("rollout", 0, 0, 1 << 30);
  wire::Envelope start;
  start.mutable_start_update()->set_version(1);
  conv.send(observer, start);
  const auto s = conv.status();
  EXPECT_EQ(s.phase(), "idle");
  ASSERT_EQ(s.replicas_size(), 1);
  EXPECT_EQ(s.replicas(0).tp_size(), 1);  // the TP 2^30 rank was refused
}

}  // namespace
}  // namespace ferry::coordinator
