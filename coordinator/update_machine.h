// One weight update at a time, as a state machine on the coordinator's I/O thread:
//   idle -> [starting] -> pausing -> transferring -> finalizing -> resuming -> idle, or -> aborted
// (then idle). Versions only increase per replica; a second concurrent update is refused
// (FailedPrecondition); every rank of the updated replicas resumes together, only after all hold the
// complete version.
//
// A sharded trainer is several trainer members, one per trainer rank. Its update is collective: it
// is starting until every trainer rank has sent its start (same version, manifest and options;
// within FERRY_TIMEOUT_MS of the first), then the holdings of all of them must tile every manifest
// tensor before any replica pauses; it finalizes once every trainer rank has finished, each rank
// told the sum of the buckets sent to it; a trainer rank that leaves or aborts fails it for all.
// The start path is update_start.cc.
#pragma once

#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/asio.h"
#include "coordinator/members.h"
#include "sharding/planner.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

class UpdateMachine {
 public:
  UpdateMachine(boost::asio::io_context& io, MemberTable& members, const ReplicaTable& replicas, int64_t timeout_ms);

  void on_start(Member& trainer, const wire::StartUpdate& s);
  void on_pause_ack(Member& m, const wire::PauseAck& a);
  void on_finish(Member& trainer, const wire::FinishUpdate& f);
  // The trainer ends its open update (Trainer::abort_weight_update): the ranks get an Abort as for
  // any failure, and the trainer a FinishReply carrying Aborted.
  void on_abort_request(Member& trainer, const wire::AbortUpdate& a);
  void on_finalized(Member& m, const wire::Finalized& f);
  // A rank whose resume hook fails holds the complete version but does not serve: the update fails
  // (naming it) once every rank answered, and its replica is not serving until a later update, or
  // the rank's own retry (an unasked ResumeAck), succeeds.
  void on_resume_ack(Member& m, const wire::ResumeAck& a);
  // After an abort: ranks that restored their previous version (FERRY_ROLLBACK=host) resume it
  // together, replica by replica, once every rank of the replica has.
  void on_abort_ack(Member& m, const wire::AbortAck& a);
  // A member left (or went silent): aborts the update if it takes part in it.
  void on_member_lost(const Member& m, const Status& why);

  const char* phase() const;
  bool in_update() const { return phase_ != Phase::kIdle; }
  const std::deque<wire::UpdateRecord>& history() const { return history_; }
  uint64_t updates_ok() const { return updates_ok_; }
  uint64_t updates_failed() const { return updates_failed_; }

 private:
  enum class Phase { kIdle, kStarting, kPausing, kTransferring, kFinalizing, kResuming };

  void arm_timer(const char* what);
  void fail(const Status& why);
  void record(bool ok, const std::string& error);
  // To every trainer rank of the update (those that have started, while starting).
  void send_to_trainers(wire::Envelope& env);
  bool is_trainer(int id) const;
  std::string trainer_name(int id) const;  // "trainer rank 2 (trainer member 7)"
  // The start path (update_start.cc).
  Status accept_manifest(Member& trainer, const wire::StartUpdate& s);
  void open_update();
  void arm_start_timer();
  void arm_finish_timer();
  // The update cannot open (nothing was paused): every trainer rank that started it is told.
  void refuse_start(const Status& why);
  void send_start_replies();
  // Staging needs every participant serving a complete version, and room for its whole input.
  bool can_stage() const;
  // A staged rank holds every byte: once all ranks of its replica do, the replica applies.
  void on_staged(Member& m);

  boost::asio::io_context& io_;
  // The participants of an update starting now, or why it cannot: every rank of every replica it
  // names (all known replicas when it names none) must be a member.
  Result<std::set<int>> participants_for(const wire::StartUpdate& s) const;

  MemberTable& members_;
  const ReplicaTable& replicas_;
  int64_t timeout_ms_;
  boost::asio::steady_timer timer_;

  Phase phase_ = Phase::kIdle;
  uint64_t version_ = 0;          // the update in progress (or the last attempted)
  uint64_t aborted_version_ = 0;  // an update aborted during the transfer, reported at its finish
  // Told to the trainer ranks that learn of a failure at their finish (or abort): those still
  // sending when it failed.
  Status pending_failure_;
  std::set<int> owed_failure_;
  // The trainer ranks of this update: member ids by trainer rank (0 while a rank has not started).
  std::vector<int> trainers_;
  Status refused_;                  // why the last start of several trainer ranks was refused,
  uint64_t refused_version_ = 0;    // its version,
  std::set<int> refused_late_;      // and the trainer ranks that had not started it yet
  wire::StartUpdate group_start_;              // the update's options (the first start, less its manifest)
  std::vector<wire::StartUpdate> starts_;      // each trainer rank's start (holdings), by trainer rank
  std::vector<sharding::SenderInfo> senders_;  // their holdings; empty for a trainer of one rank holding all
  std::string checked_holdings_;               // the manifest digest and holdings senders_ were checked for
  uint64_t senders_digest_ = 0;                // XXH3 of that (StartReply.senders_digest)
  std::set<int> finished_;                     // trainer members that sent their finish
  std::vector<uint64_t> bucket_sums_;          // buckets to each participant, over the trainer ranks
  std::set<int> participants_;
  std::set<int> acked_;
  std::vector<std::string> resume_failures_;  // of this update, one line per rank
  std::set<int> aborted_;      // participants of the last aborted update, still to answer
  std::set<int> rolled_back_;  // of those, the ranks that restored their previous version
  std::chrono::steady_clock::time_point started_, phase_start_;
  wire::FinishReply report_;
  // Stage while serving (StartUpdate.stage, when every rank can hold its input): the ranks that
  // hold every byte and serve on, and when each replica was told to apply (its pause began).
  bool stage_ = false;
  std::set<int> staged_;
  std::map<int, std::chrono::steady_clock::time_point> apply_sent_;  // by replica
  // What the start path need not redo per update, per trainer: the last manifest it sent (by
  // digest), the participants it was checked against, and the members whose specs it holds.
  struct StartCache {
    uint64_t digest = 0;
    sharding::Manifest manifest;
    std::set<int> checked_for;
    std::set<int> specs_sent;
  };
  std::map<int, StartCache> start_caches_;  // by trainer member id
  std::deque<wire::UpdateRecord> history_;
  uint64_t updates_ok_ = 0, updates_failed_ = 0;
};

}  // namespace ferry::coordinator
