// The start of an update: a trainer's start (or every trainer rank's), the checks made before any
// replica pauses, and the pause.
#include <algorithm>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/log.h"
#include "coordinator/update_machine.h"
#include "coordinator/wire.h"
#include "sharding/holdings.h"

namespace ferry::coordinator {
namespace {

using Clock = std::chrono::steady_clock;

bool same_update(const wire::StartUpdate& a, const wire::StartUpdate& b) {
  return a.version() == b.version() && a.manifest_digest() == b.manifest_digest() && a.pause_mode() == b.pause_mode() &&
         a.clear_cache() == b.clear_cache() && a.trainer_ranks() == b.trainer_ranks() &&
         std::equal(a.replicas().begin(), a.replicas().end(), b.replicas().begin(), b.replicas().end());
}

}  // namespace

bool UpdateMachine::is_trainer(int id) const {
  return phase_ != Phase::kIdle && std::find(trainers_.begin(), trainers_.end(), id) != trainers_.end();
}

std::string UpdateMachine::trainer_name(int id) const {
  auto it = std::find(trainers_.begin(), trainers_.end(), id);
  if (trainers_.size() < 2 || it == trainers_.end()) return fmt::format("trainer member {}", id);
  return fmt::format("trainer rank {} (member {})", it - trainers_.begin(), id);
}

void UpdateMachine::on_start(Member& trainer, const wire::StartUpdate& s) {
  auto refuse = [&](const Status& st) {
    wire::Envelope reply;
    to_wire(st, reply.mutable_start_reply()->mutable_status());
    reply.mutable_start_reply()->set_version(s.version());
    trainer.channel->send(reply);
  };
  if (trainer.role != "trainer" || trainer.data_key.empty()) {
    return refuse(Status::failed_precondition(fmt::format("{} may not start an update; only trainers do", trainer.describe())));
  }
  const int n = std::max(s.trainer_ranks(), 1);
  if (s.trainer_ranks() < 0 || s.trainer_rank() < 0 || s.trainer_rank() >= n) {
    return refuse(Status::invalid_argument(
        fmt::format("trainer rank {} of {} trainer ranks does not exist", s.trainer_rank(), s.trainer_ranks())));
  }
  // A trainer rank late for an update that was refused before it started learns why at once, not
  // after waiting alone for ranks that have moved on (a rank that did start it starts afresh: a retry).
  if (phase_ == Phase::kIdle && n > 1 && s.version() == refused_version_ && refused_late_.erase(s.trainer_rank())) {
    return refuse(refused_);
  }
  if (phase_ == Phase::kStarting && n > 1) {
    // One more trainer rank of the update being started: it must start the same update, once.
    const size_t rank = static_cast<size_t>(s.trainer_rank());
    const bool taken = rank < trainers_.size() && trainers_[rank] != 0;
    const bool twice = std::find(trainers_.begin(), trainers_.end(), trainer.id) != trainers_.end();
    if (!same_update(s, group_start_) || taken || twice) {
      const Status why = Status::invalid_argument(fmt::format(
          "trainer rank {} (member {}) started v{} of {} trainer ranks (manifest {:016x}, pause {}, replicas {}), but "
          "v{} of {} trainer ranks (manifest {:016x}, pause {}, replicas {}) is starting{}; every trainer rank must "
          "start the same update once. Nothing was paused",
          rank, trainer.id, s.version(), s.trainer_ranks(), s.manifest_digest(), s.pause_mode(), s.replicas_size(),
          version_, group_start_.trainer_ranks(), group_start_.manifest_digest(), group_start_.pause_mode(),
          group_start_.replicas_size(),
          taken ? fmt::format(" and rank {} has started it already", rank)
                : twice ? " and this member has started it already as another rank" : ""));
      refuse(why);
      return refuse_start(why);
    }
  } else if (phase_ != Phase::kIdle) {
    return refuse(Status::failed_precondition(
        fmt::format("update v{} is {}; a second update cannot start", version_, phase())));
  }
  if (!s.pause_mode().empty() && s.pause_mode() != "abort" && s.pause_mode() != "wait" && s.pause_mode() != "keep") {
    return refuse(Status::invalid_argument(
        fmt::format("pause mode '{}' is not one of abort, wait, keep", s.pause_mode())));
  }
  if (Status st = accept_manifest(trainer, s); !st.ok()) {
    refuse(st);
    if (phase_ == Phase::kStarting) refuse_start(st);
    return;
  }
  if (phase_ == Phase::kIdle) {
    version_ = s.version();
    group_start_ = s;
    group_start_.clear_manifest();
    group_start_.clear_holdings();
    trainers_.assign(static_cast<size_t>(n), 0);
    starts_.assign(static_cast<size_t>(n), wire::StartUpdate{});
    phase_ = Phase::kStarting;
    if (n > 1) arm_start_timer();
  }
  trainers_[static_cast<size_t>(s.trainer_rank())] = trainer.id;
  starts_[static_cast<size_t>(s.trainer_rank())].mutable_holdings()->CopyFrom(s.holdings());
  starts_[static_cast<size_t>(s.trainer_rank())].set_senders_digest_held(s.senders_digest_held());
  if (std::count(trainers_.begin(), trainers_.end(), 0) == 0) open_update();
}

Status UpdateMachine::accept_manifest(Member& trainer, const wire::StartUpdate& s) {
  StartCache& cache = start_caches_[trainer.id];
  if (s.manifest_omitted()) {
    if (s.manifest_digest() == 0 || s.manifest_digest() != cache.digest) {
      return Status::failed_precondition(
          fmt::format("the start omits its manifest (digest {:016x}) but this coordinator holds {:016x}: resend it",
                      s.manifest_digest(), cache.digest));
    }
    return ok_status();
  }
  FERRY_ASSIGN_OR_RETURN(cache.manifest, manifest_from_wire(s.manifest()));
  cache.digest = s.manifest_digest();
  cache.checked_for.clear();
  return ok_status();
}

void UpdateMachine::arm_start_timer() {
  timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
  const uint64_t v = version_;
  timer_.async_wait([this, v](boost::system::error_code ec) {
    if (ec || phase_ != Phase::kStarting || version_ != v) return;
    std::string late;
    for (size_t r = 0; r < trainers_.size(); ++r) {
      if (trainers_[r] == 0) late += fmt::format("{}{}", late.empty() ? "" : ", ", r);
    }
    refuse_start(Status::deadline_exceeded(fmt::format(
        "trainer rank(s) {} of {} did not start update v{} within FERRY_TIMEOUT_MS={} of the first; nothing was paused",
        late, trainers_.size(), v, timeout_ms_)));
  });
}

void UpdateMachine::refuse_start(const Status& why) {
  if (phase_ != Phase::kStarting) return;
  timer_.cancel();
  if (trainers_.size() > 1) {
    // Remembered for the trainer ranks of this update still to start (answered at once).
    FERRY_LOG_WARN("update v{} did not start: {}", version_, why.message());
    refused_ = why;
    refused_version_ = version_;
    refused_late_.clear();
    for (size_t r = 0; r < trainers_.size(); ++r) {
      if (trainers_[r] == 0) refused_late_.insert(static_cast<int>(r));
    }
  }
  wire::Envelope reply;
  to_wire(why, reply.mutable_start_reply()->mutable_status());
  reply.mutable_start_reply()->set_version(version_);
  send_to_trainers(reply);
  phase_ = Phase::kIdle;
  trainers_.clear();
}

void UpdateMachine::open_update() {
  timer_.cancel();
  StartCache& cache = start_caches_[trainers_.front()];
  // The trainer ranks' holdings must tile every tensor before anything pauses (a trainer of one
  // rank that declares none holds everything: nothing to check, and its plan has one sender).
  // Holdings that did not change since the last update that opened, for the same manifest, were
  // checked then.
  const bool one_whole = trainers_.size() == 1 && starts_[0].holdings().owns().empty() && starts_[0].holdings().holds().empty();
  std::string held = one_whole ? std::string() : fmt::format("{:016x}", cache.digest);
  for (size_t r = 0; r < trainers_.size() && !one_whole; ++r) held += starts_[r].holdings().SerializeAsString();
  if (one_whole) {
    senders_.clear();
    senders_digest_ = 0;
  } else if (held != checked_holdings_) {
    senders_.clear();
    checked_holdings_.clear();
    for (size_t r = 0; r < trainers_.size(); ++r) {
      auto info = from_wire(starts_[r].holdings());
      if (!info.ok()) return refuse_start(info.status().with_context(fmt::format("trainer rank {}", r)));
      senders_.push_back(std::move(*info));
    }
    if (auto resolved = sharding::resolve_holdings(cache.manifest, senders_); !resolved.ok()) {
      return refuse_start(Status::invalid_argument(fmt::format(
          "the holdings of {} trainer rank(s) do not cover the manifest exactly{}: {}. Nothing was paused",
          trainers_.size(), trainers_.size() > 1 ? " (sender k is trainer rank k)" : "", resolved.status().message())));
    }
    checked_holdings_ = std::move(held);
    senders_digest_ = std::max<uint64_t>(XXH3_64bits(checked_holdings_.data(), checked_holdings_.size()), 1);
  }
  auto who = participants_for(group_start_);
  if (!who.ok()) return refuse_start(who.status());
  // Every mismatch fails here, before any rank pauses and before one byte moves. A member's spec
  // never changes (a rejoining rank is a new member), so a manifest checked against these members
  // (same digest) needs no second check.
  if (cache.digest == 0 || *who != cache.checked_for) {
    std::vector<sharding::RankSpec> specs;
    for (int id : *who) specs.push_back(members_.at(id).spec);
    if (Status st = sharding::check_manifest(cache.manifest, specs); !st.ok()) return refuse_start(st);
    cache.checked_for = *who;
  }

  participants_ = std::move(*who);
  refused_late_.clear();
  started_ = Clock::now();
  pending_failure_ = Status();
  owed_failure_.clear();
  finished_.clear();
  bucket_sums_.assign(participants_.size(), 0);
  acked_.clear();
  resume_failures_.clear();
  phase_ = Phase::kPausing;
  phase_start_ = Clock::now();
  report_ = wire::FinishReply{};
  stage_ = group_start_.stage() && can_stage();
  staged_.clear();
  apply_sent_.clear();
  wire::Envelope pause;
  pause.mutable_pause()->set_stage(stage_);
  pause.mutable_pause()->set_version(version_);
  pause.mutable_pause()->set_mode(group_start_.pause_mode().empty() ? "abort" : group_start_.pause_mode());
  pause.mutable_pause()->set_clear_cache(group_start_.clear_cache());
  for (int id : trainers_) {
    auto* sender = pause.mutable_pause()->add_senders();
    sender->set_member_id(id);
    sender->set_key(members_.at(id).data_key);
  }
  for (int id : participants_) {
    members_.at(id).state = "pausing";
    members_.at(id).channel->send(pause);
  }
  arm_timer("pause");
}

// Staging while serving holds a rank's whole full-precision input until the apply: every rank's
// staging bound must take it, or the update pauses first (warned, naming the bound).
bool UpdateMachine::can_stage() const {
  for (int id : participants_) {
    const Member& m = members_.at(id);
    if (!m.consistent || m.state != "serving") {
      // A rank that serves nothing (paused, inconsistent, resume-failed) has nothing to keep
      // serving: the update pauses first, and the rank's state stays what it is.
      FERRY_LOG_WARN("update v{} pauses first instead of staging while serving: {} is {}", version_, m.describe(),
                     m.state);
      return false;
    }
    if (m.max_staging_bytes == 0) continue;
    uint64_t input = 0;
    for (const auto& p : m.spec.params) input += dtype_bytes(p.source_dtype, shape_numel(p.shape));
    if (input > m.max_staging_bytes) {
      FERRY_LOG_WARN("update v{} pauses first instead of staging while serving: {} would stage {} bytes, over its "
                     "FERRY_MAX_STAGING_BYTES={} bytes",
                     version_, m.describe(), input, m.max_staging_bytes);
      return false;
    }
  }
  return true;
}

Result<std::set<int>> UpdateMachine::participants_for(const wire::StartUpdate& s) const {
  std::set<int> wanted(s.replicas().begin(), s.replicas().end());
  if (wanted.empty()) {
    for (const auto& [replica, info] : replicas_) wanted.insert(replica);
  }
  std::set<int> participants;
  for (int replica : wanted) {
    auto info = replicas_.find(replica);
    if (info == replicas_.end()) {
      return Status::failed_precondition(fmt::format("replica {} has no rank that ever joined; nothing was paused", replica));
    }
    const auto ranks = replica_ranks(members_, replica);
    for (int k = 0; k < info->second.tp_size; ++k) {
      auto it = ranks.find(k);
      if (it == ranks.end()) {
        auto why = info->second.left.find(k);
        return Status::failed_precondition(fmt::format(
            "replica {} is missing rank {} of {} ({}); nothing was paused. Start the rank again, or update the other "
            "replicas alone (UpdateOptions.replicas)",
            replica, k, info->second.tp_size,
            why == info->second.left.end() ? "it has not joined" : "it left: " + why->second));
      }
      const Member& m = members_.at(it->second);
      if (s.version() <= m.version) {
        return Status::invalid_argument(
            fmt::format("version {} is not above the current version {} of {}", s.version(), m.version, m.describe()));
      }
      participants.insert(it->second);
    }
  }
  if (participants.empty()) return Status::failed_precondition("no rollout rank has joined");
  return participants;
}

// Every trainer rank gets its own start reply: the specs it has not been sent before.
void UpdateMachine::send_start_replies() {
  for (size_t r = 0; r < trainers_.size(); ++r) {
    wire::Envelope reply;
    auto* out = reply.mutable_start_reply();
    to_wire(ok_status(), out->mutable_status());
    out->set_version(version_);
    StartCache& cache = start_caches_[trainers_[r]];
    for (int id : participants_) {
      const Member& p = members_.at(id);
      auto* w = out->add_ranks();
      w->set_member_id(id);
      if (cache.specs_sent.insert(id).second) to_wire(p.spec, w->mutable_spec());  // kept there
      for (const auto& e : p.endpoints) *w->add_endpoints() = e;
      w->set_storage_device(p.storage_device);
      w->set_delta_base(p.delta_base);
    }
    out->set_senders_digest(senders_digest_);
    if (senders_digest_ == 0 || starts_[r].senders_digest_held() != senders_digest_) {
      for (const auto& s : senders_) to_wire(s, out->add_senders());
    }
    auto it = members_.find(trainers_[r]);
    if (it != members_.end()) it->second.channel->send(reply);
  }
  // Deltas of this update go against these bases; the shadows hold none again until it finalizes.
  for (int id : participants_) members_.at(id).delta_base = 0;
}

}  // namespace ferry::coordinator
