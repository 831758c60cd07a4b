// The coordinator without its sockets: admission of new connections (challenge, hello, a rollout
// rank's registration), membership and replicas, message dispatch to the update machine, status and
// metrics. `Coordinator` runs it on an I/O thread behind a real acceptor; the fuzz target drives the
// same code with arbitrary frames.
//
// An unauthenticated connection is held on a short leash: frames of at most kPreAuthFrameBytes until
// its Hello passes (so nothing large is allocated for it), at most `max_pending` such connections at
// once (the oldest is closed first), and FERRY_TIMEOUT_MS to say hello and, for a rank, register.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "core/asio.h"
#include "core/status.h"
#include "coordinator/channel.h"
#include "coordinator/members.h"
#include "coordinator/update_machine.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

inline constexpr uint64_t kPreAuthFrameBytes = 4096;

struct CoreOptions {
  int64_t timeout_ms = 30'000;
  std::string token;             // empty: no challenge to answer
  uint64_t max_frame = 64 << 20;  // after the hello
  size_t max_pending = 128;       // connections not yet members
  std::function<Result<std::string>()> nonce;  // 32 fresh random bytes per call (auth.h's make_nonce)
};

class CoordinatorCore {
 public:
  using Clock = std::chrono::steady_clock;

  CoordinatorCore(boost::asio::io_context& io, CoreOptions options);

  // A new connection: caps its frames, records it as pending and returns the challenge to send it.
  // The caller starts the channel with on_message / on_closed.
  Result<wire::Envelope> on_connect(const std::shared_ptr<Channel>& c);
  void on_message(const std::shared_ptr<Channel>& c, wire::Envelope& env);
  void on_closed(const std::shared_ptr<Channel>& c, const Status& why);
  // Closes members silent for longer than the deadline and connections that did not join within it.
  void reap(Clock::time_point now);
  // The job ends: every member is told (Goodbye) and every connection closes.
  void stop(const std::string& reason);

  wire::StatusReply status() const;
  std::string metrics() const;
  int rollout_ranks() const;
  // Called on the I/O thread after membership changed.
  void set_on_members_changed(std::function<void()> fn) { on_members_changed_ = std::move(fn); }

 private:
  struct Pending {
    std::string nonce;
    Clock::time_point since;
    std::optional<wire::Hello> hello;  // a rank that passed its hello, awaiting its Registration
  };

  void on_hello(const std::shared_ptr<Channel>& c, Pending& p, const wire::Hello& h);
  void on_registration(const std::shared_ptr<Channel>& c, const wire::Hello& h, const wire::Registration& r);
  Status check_registration(const sharding::RankSpec& spec) const;
  void admit(const std::shared_ptr<Channel>& c, Member m);
  void refuse(const std::shared_ptr<Channel>& c, const Status& st);
  Member* member_of(const std::shared_ptr<Channel>& c);
  void changed();

  CoreOptions options_;
  MemberTable members_;
  ReplicaTable replicas_;
  std::map<std::shared_ptr<Channel>, Pending> pending_;
  UpdateMachine updates_;
  int next_id_ = 1;
  uint64_t evicted_ = 0;  // pending connections closed over the bound, logged at the next reap
  std::function<void()> on_members_changed_;
};

}  // namespace ferry::coordinator
