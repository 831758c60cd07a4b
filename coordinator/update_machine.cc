#include "coordinator/update_machine.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/log.h"
#include "coordinator/wire.h"
#include "sharding/planner.h"

namespace ferry::coordinator {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kHistory = 32;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A rank's error, cause first, then where it happened.
Status on_rank(const Status& st, const Member& m, const char* step) {
  return Status(st.code(), fmt::format("{} ({}, {})", st.message(), m.describe(), step));
}

}  // namespace

std::string Member::describe() const {
  if (role == "rollout") return fmt::format("member {} (replica {} rank {})", id, spec.replica, spec.tp_rank);
  return fmt::format("{} member {}", role, id);
}

UpdateMachine::UpdateMachine(boost::asio::io_context& io, MemberTable& members, const ReplicaTable& replicas,
                             int64_t timeout_ms)
    : io_(io), members_(members), replicas_(replicas), timeout_ms_(timeout_ms), timer_(io) {}

const char* UpdateMachine::phase() const {
  switch (phase_) {
    case Phase::kIdle: return "idle";
    case Phase::kStarting: return "starting";
    case Phase::kPausing: return "pausing";
    case Phase::kTransferring: return "transferring";
    case Phase::kFinalizing: return "finalizing";
    case Phase::kResuming: return "resuming";
  }
  return "?";
}

void UpdateMachine::send_to_trainers(wire::Envelope& env) {
  for (int id : trainers_) {
    auto it = members_.find(id);
    if (id != 0 && it != members_.end()) it->second.channel->send(env);
  }
}

void UpdateMachine::arm_timer(const char* what) {
  timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
  const uint64_t v = version_;
  timer_.async_wait([this, what, v](boost::system::error_code ec) {
    if (ec || phase_ == Phase::kIdle || version_ != v) return;
    std::string late;
    for (int id : participants_) {
      if (!acked_.count(id)) late += " " + members_.at(id).describe();
    }
    fail(Status::deadline_exceeded(
        fmt::format("{} of update v{} passed FERRY_TIMEOUT_MS={} waiting for:{}", what, v, timeout_ms_, late)));
  });
}

void UpdateMachine::record(bool ok, const std::string& error) {
  wire::UpdateRecord r;
  r.set_version(version_);
  r.set_ok(ok);
  r.set_error(error);
  r.set_seconds(since(started_));
  r.set_bytes(report_.bytes());
  r.set_ranks(static_cast<int32_t>(participants_.size()));
  history_.push_back(std::move(r));
  if (history_.size() > kHistory) history_.pop_front();
  (ok ? updates_ok_ : updates_failed_) += 1;
}

void UpdateMachine::on_pause_ack(Member& m, const wire::PauseAck& a) {
  if (phase_ != Phase::kPausing || a.version() != version_ || !participants_.count(m.id)) return;
  if (Status st = from_wire(a.status()); !st.ok()) return fail(on_rank(st, m, "pause"));
  if (a.delta_base() != m.delta_base) {
    // Its shadow lost the version it reported at the end of its last update (or it never held one
    // the coordinator trusts): its senders send it dense bytes in this update, the others deltas.
    if (m.delta_base != 0) {
      FERRY_LOG_WARN(
          "{} reported delta base v{} after its last update but holds {} as v{} begins; it gets dense "
          "bytes",
          m.describe(), m.delta_base, a.delta_base() ? fmt::format("v{}", a.delta_base()) : "none", version_);
    }
    m.delta_base = 0;
  }
  if (stage_) {
    m.state = "staging";  // it serves on while the version arrives
  } else {
    m.state = "paused";
    m.consistent = false;  // its storage is about to be rewritten
  }
  acked_.insert(m.id);
  if (acked_.size() < participants_.size()) return;
  timer_.cancel();
  report_.set_pause_seconds(since(phase_start_));
  phase_ = Phase::kTransferring;
  for (int id : participants_) members_.at(id).state = stage_ ? "staging" : "transferring";
  send_start_replies();
}

void UpdateMachine::on_finish(Member& trainer, const wire::FinishUpdate& f) {
  if (phase_ != Phase::kTransferring || !is_trainer(trainer.id) || f.version() != version_ ||
      finished_.count(trainer.id)) {
    Status st = Status::failed_precondition(fmt::format("finish of v{} without a matching start", f.version()));
    if (f.version() == aborted_version_ && owed_failure_.erase(trainer.id)) st = pending_failure_;
    wire::Envelope reply;
    to_wire(st, reply.mutable_finish_reply()->mutable_status());
    reply.mutable_finish_reply()->set_version(f.version());
    trainer.channel->send(reply);
    return;
  }
  finished_.insert(trainer.id);  // from here it waits for the update's answer, whatever it is
  if (static_cast<size_t>(f.buckets_size()) != participants_.size()) {
    return fail(Status::invalid_argument(fmt::format("the finish of {} lists {} ranks; the update has {}",
                                                     trainer_name(trainer.id), f.buckets_size(), participants_.size())));
  }
  for (size_t i = 0; i < bucket_sums_.size(); ++i) bucket_sums_[i] += f.buckets(static_cast<int>(i));
  if (finished_.size() < trainers_.size()) {
    // Trainer ranks still sending: they have three times FERRY_TIMEOUT_MS from the first finish.
    if (finished_.size() == 1) arm_finish_timer();
    return;
  }
  phase_ = Phase::kFinalizing;
  phase_start_ = Clock::now();
  acked_.clear();
  size_t i = 0;
  for (int id : participants_) {
    wire::Envelope env;
    env.mutable_finalize()->set_version(version_);
    env.mutable_finalize()->set_buckets(bucket_sums_[i++]);
    members_.at(id).state = stage_ ? "staging" : "finalizing";
    members_.at(id).channel->send(env);
  }
  arm_timer("finalize");
}

void UpdateMachine::arm_finish_timer() {
  timer_.expires_after(std::chrono::milliseconds(3 * timeout_ms_));
  const uint64_t v = version_;
  timer_.async_wait([this, v](boost::system::error_code ec) {
    if (ec || phase_ != Phase::kTransferring || version_ != v) return;
    std::string late;
    for (size_t r = 0; r < trainers_.size(); ++r) {
      if (!finished_.count(trainers_[r])) late += fmt::format("{}{}", late.empty() ? "" : ", ", r);
    }
    fail(Status::deadline_exceeded(fmt::format(
        "trainer rank(s) {} did not finish update v{} within 3 x FERRY_TIMEOUT_MS={} of the first trainer rank's finish",
        late, v, timeout_ms_)));
  });
}

void UpdateMachine::on_finalized(Member& m, const wire::Finalized& f) {
  if (phase_ != Phase::kFinalizing || f.version() != version_ || !participants_.count(m.id)) return;
  if (Status st = from_wire(f.status()); !st.ok()) return fail(on_rank(st, m, f.staged() ? "staging" : "finalize"));
  if (f.staged()) return on_staged(m);
  acked_.insert(m.id);
  if (auto a = apply_sent_.find(m.spec.replica); a != apply_sent_.end()) {
    report_.set_apply_seconds(std::max(report_.apply_seconds(), since(a->second)));
  }
  m.state = "complete";
  m.delta_base = f.delta_base();
  report_.set_bytes(report_.bytes() + f.bytes());
  report_.set_moved(report_.moved() + f.moved());
  report_.set_registered(report_.registered() + f.registered());
  report_.set_peak_staging_bytes(std::max(report_.peak_staging_bytes(), f.peak_staging_bytes()));
  report_.set_process_seconds(std::max(report_.process_seconds(), f.process_seconds()));
  report_.set_shadow_bytes(report_.shadow_bytes() + f.shadow_bytes());
  report_.set_allocated_staging_bytes(report_.allocated_staging_bytes() + f.allocated_staging_bytes());
  if (acked_.size() < participants_.size()) return;
  timer_.cancel();
  // Every rank of every updated replica holds the complete new version: release them together.
  phase_ = Phase::kResuming;
  phase_start_ = Clock::now();
  acked_.clear();
  wire::Envelope env;
  env.mutable_resume()->set_version(version_);
  for (int id : participants_) members_.at(id).channel->send(env);
  arm_timer("resume");
}

void UpdateMachine::on_staged(Member& m) {
  if (!stage_ || !staged_.insert(m.id).second) {
    return fail(on_rank(Status::internal("staged an update that does not stage"), m, "staging"));
  }
  m.state = "staged";
  std::vector<int> replica;
  for (int id : participants_) {
    const Member& x = members_.at(id);
    if (x.spec.replica != m.spec.replica) continue;
    if (!staged_.count(id)) return;  // a rank of the replica still receiving: it serves on
    replica.push_back(id);
  }
  apply_sent_[m.spec.replica] = Clock::now();
  // Each replica's apply (its pause hook, writing every staged layer) has its own deadline.
  arm_timer("apply");
  wire::Envelope env;
  env.mutable_apply()->set_version(version_);
  for (int id : replica) {
    Member& x = members_.at(id);
    x.state = "applying";
    x.consistent = false;  // its storage is about to be rewritten
    x.channel->send(env);
  }
}

void UpdateMachine::on_resume_ack(Member& m, const wire::ResumeAck& a) {
  const Status hook = from_wire(a.status());
  const bool this_resume = phase_ == Phase::kResuming && a.version() == version_ && participants_.count(m.id);
  if (!this_resume || acked_.count(m.id)) {
    // A rank whose hook failed retried it on its own (RolloutWorker::resume()), perhaps before the
    // update's other ranks answered; or a hook failed after a rollback's resume.
    if (a.version() != m.version) return;
    if (hook.ok() && m.state == "resume-failed") {
      m.state = "serving";
      const std::string who = m.describe() + ": ";
      std::erase_if(resume_failures_, [&](const std::string& f) { return f.starts_with(who); });
      FERRY_LOG_WARN("{} resumed at v{} after its resume hook had failed", m.describe(), m.version);
    } else if (!hook.ok() && m.state == "serving") {
      m.state = "resume-failed";
      FERRY_LOG_ERROR("resume hook of {} failed at v{}: {}", m.describe(), m.version, hook.message());
    }
    return;
  }
  acked_.insert(m.id);
  m.version = version_;
  m.consistent = true;  // its storage holds the complete version either way
  m.state = hook.ok() ? "serving" : "resume-failed";
  if (!hook.ok()) {
    resume_failures_.push_back(fmt::format("{}: {}", m.describe(), hook.message()));
    FERRY_LOG_ERROR("resume hook of {} failed at v{}: {}", m.describe(), version_, hook.message());
  }
  if (acked_.size() < participants_.size()) return;
  timer_.cancel();
  report_.set_resume_seconds(since(phase_start_));
  report_.set_staged(stage_);
  // Not serving: from the pause (a staged update: the first replica's apply) to the last resume.
  auto paused = started_;
  if (stage_ && !apply_sent_.empty()) {
    paused = std::min_element(apply_sent_.begin(), apply_sent_.end(), [](const auto& a, const auto& b) {
               return a.second < b.second;
             })->second;
  }
  report_.set_pause_window_seconds(since(paused));
  report_.set_version(version_);
  report_.set_ranks(static_cast<int32_t>(participants_.size()));
  if (!resume_failures_.empty()) {
    // Every rank holds the new version; the failing ranks' replicas do not serve. The others resumed.
    std::string lines;
    for (const auto& f : resume_failures_) lines += "; " + f;
    const Status st = Status::unavailable(fmt::format(
        "the resume hook failed on {} rank(s) at v{}{}. Their replicas hold v{} but are not serving until a later "
        "update or the rank's resume() succeeds; the other replicas resumed",
        resume_failures_.size(), version_, lines, version_));
    to_wire(st, report_.mutable_status());
    record(false, st.message());
  } else {
    to_wire(ok_status(), report_.mutable_status());
    record(true, "");
  }
  wire::Envelope env;
  *env.mutable_finish_reply() = report_;
  send_to_trainers(env);
  phase_ = Phase::kIdle;
}

void UpdateMachine::on_abort_request(Member& trainer, const wire::AbortUpdate& a) {
  wire::Envelope reply;
  auto* r = reply.mutable_finish_reply();
  r->set_version(a.version());
  const bool open = phase_ == Phase::kStarting || phase_ == Phase::kPausing ||
                    (phase_ == Phase::kTransferring && !finished_.count(trainer.id));
  if (open && is_trainer(trainer.id) && a.version() == version_) {
    const Status why = Status::aborted(fmt::format("{} aborted update v{}{}{}", trainers_.size() > 1 ? trainer_name(trainer.id) : "the trainer",
                                                   version_, a.reason().empty() ? "" : ": ", a.reason()));
    fail(why);
    owed_failure_.erase(trainer.id);
    to_wire(why, r->mutable_status());
  } else if (a.version() == aborted_version_ && owed_failure_.erase(trainer.id)) {
    to_wire(pending_failure_, r->mutable_status());  // it had failed already: that is its end
  } else {
    to_wire(Status::failed_precondition(fmt::format("no open update v{} of this trainer to abort", a.version())),
            r->mutable_status());
  }
  trainer.channel->send(reply);
}

void UpdateMachine::on_abort_ack(Member& m, const wire::AbortAck& a) {
  if (a.version() != version_ || !aborted_.erase(m.id)) return;
  if (!a.rolled_back()) return;  // stays paused and inconsistent until a complete update lands
  m.version = a.serving_version();
  m.state = "rolled-back";
  rolled_back_.insert(m.id);
  // A replica resumes once all of its ranks rolled back; one that cannot, keeps all of them paused.
  const int replica = m.spec.replica;
  std::vector<int> ranks;
  for (const auto& [id, x] : members_) {
    if (x.role != "rollout" || x.spec.replica != replica) continue;
    if (!rolled_back_.count(id)) return;
    ranks.push_back(id);
  }
  wire::Envelope env;
  env.mutable_resume()->set_version(m.version);
  env.mutable_resume()->set_rollback(true);
  for (int id : ranks) {
    Member& x = members_.at(id);
    x.consistent = true;
    x.state = "serving";
    rolled_back_.erase(id);
    x.channel->send(env);
  }
  FERRY_LOG_WARN("replica {} rolled back to v{} after update v{} was aborted", replica, m.version, version_);
}

void UpdateMachine::on_member_lost(const Member& m, const Status& why) {
  start_caches_.erase(m.id);  // a trainer's manifest and specs go with it
  if (phase_ == Phase::kIdle || (!is_trainer(m.id) && !participants_.count(m.id))) return;
  const std::string who = is_trainer(m.id) ? trainer_name(m.id) : m.describe();
  const StatusCode code = why.code() == StatusCode::kDeadlineExceeded ? StatusCode::kDeadlineExceeded : StatusCode::kUnavailable;
  if (phase_ == Phase::kStarting) {
    if (!is_trainer(m.id)) return;  // the participants are chosen when every trainer rank has started
    return refuse_start(Status(code, fmt::format("{} was lost before every trainer rank started update v{}: {}; nothing "
                                                 "was paused", who, version_, why.message())));
  }
  fail(Status(code, fmt::format("{} was lost during {}: {}", who, phase(), why.message())));
}

void UpdateMachine::fail(const Status& why) {
  if (phase_ == Phase::kIdle) return;
  if (phase_ == Phase::kStarting) return refuse_start(why);
  timer_.cancel();
  FERRY_LOG_ERROR("update v{} aborted during {}: {}", version_, phase(), why.message());
  wire::Envelope abort;
  abort.mutable_abort()->set_version(version_);
  abort.mutable_abort()->set_reason(why.message());
  // Ranks that already resumed (a failure while resuming: another rank lost, or late) hold the new
  // version complete and run on it: they are not aborted.
  if (phase_ == Phase::kResuming) {
    for (int id : acked_) participants_.erase(id);
  }
  aborted_ = participants_;
  for (int id : participants_) {
    auto it = members_.find(id);
    if (it == members_.end()) continue;
    it->second.channel->send(abort);
    it->second.delta_base = 0;  // whatever its shadow held, this update's pieces went into it
    const std::string& state = it->second.state;
    if (stage_ && (state == "pausing" || state == "staging" || state == "staged")) {
      // Staging while serving, it never paused: it drops the staged version and serves on.
      it->second.state = "serving";
      aborted_.erase(id);
      continue;
    }
    it->second.consistent = false;
    it->second.state = "paused-inconsistent";
  }
  record(false, why.message());
  rolled_back_.clear();
  wire::Envelope reply;
  if (phase_ == Phase::kPausing) {
    to_wire(why, reply.mutable_start_reply()->mutable_status());
    reply.mutable_start_reply()->set_version(version_);
    send_to_trainers(reply);
  } else if (phase_ == Phase::kTransferring) {
    // Trainer ranks still sending wait on no reply: they learn at their finish (or abort). Those
    // that finished already wait for this answer.
    pending_failure_ = why;
    aborted_version_ = version_;
    to_wire(why, reply.mutable_finish_reply()->mutable_status());
    reply.mutable_finish_reply()->set_version(version_);
    for (int id : trainers_) {
      if (!finished_.count(id)) {
        owed_failure_.insert(id);
      } else if (auto it = members_.find(id); it != members_.end()) {
        it->second.channel->send(reply);
      }
    }
  } else {
    to_wire(why, reply.mutable_finish_reply()->mutable_status());
    reply.mutable_finish_reply()->set_version(version_);
    send_to_trainers(reply);
  }
  phase_ = Phase::kIdle;
}

}  // namespace ferry::coordinator
