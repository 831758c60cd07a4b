#include "coordinator/coordinator_core.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "core/log.h"
#include "core/version.h"
#include "coordinator/auth.h"
#include "coordinator/wire.h"

namespace ferry::coordinator {

std::map<int, int> replica_ranks(const MemberTable& members, int replica) {
  std::map<int, int> out;
  for (const auto& [id, m] : members) {
    if (m.role == "rollout" && m.spec.replica == replica) out[m.spec.tp_rank] = id;
  }
  return out;
}

CoordinatorCore::CoordinatorCore(boost::asio::io_context& io, CoreOptions options)
    : options_(std::move(options)), updates_(io, members_, replicas_, options_.timeout_ms) {}

Result<wire::Envelope> CoordinatorCore::on_connect(const std::shared_ptr<Channel>& c) {
  c->set_max_frame(kPreAuthFrameBytes);
  if (pending_.size() >= options_.max_pending) {
    // The oldest unauthenticated connection makes room: a flood delays a real member's join by at
    // most `max_pending` connections instead of locking it out.
    auto oldest = std::min_element(pending_.begin(), pending_.end(),
                                   [](const auto& a, const auto& b) { return a.second.since < b.second.since; });
    oldest->first->close(Status::resource_exhausted("too many connections that have not joined"));
    pending_.erase(oldest);
    ++evicted_;
  }
  wire::Envelope challenge;
  auto* ch = challenge.mutable_challenge();
  ch->set_protocol_version(kProtocolVersion);
  ch->set_token_required(!options_.token.empty());
  if (!options_.token.empty()) {
    FERRY_ASSIGN_OR_RETURN(std::string nonce, options_.nonce());
    ch->set_nonce(nonce);
  }
  pending_[c] = Pending{ch->nonce(), Clock::now(), std::nullopt};
  return challenge;
}

Member* CoordinatorCore::member_of(const std::shared_ptr<Channel>& c) {
  for (auto& [id, m] : members_) {
    if (m.channel == c) return &m;
  }
  return nullptr;
}

void CoordinatorCore::on_message(const std::shared_ptr<Channel>& c, wire::Envelope& env) {
  if (auto it = pending_.find(c); it != pending_.end()) {
    Pending& p = it->second;
    if (!p.hello) {
      if (env.body_case() != wire::Envelope::kHello) {
        FERRY_LOG_WARN("{} sent message {} before hello; closing it", c->peer(), static_cast<int>(env.body_case()));
        pending_.erase(it);
        return c->close(Status::failed_precondition("hello expected"));
      }
      return on_hello(c, p, env.hello());
    }
    if (env.body_case() != wire::Envelope::kRegistration) {
      pending_.erase(it);
      return refuse(c, Status::failed_precondition("a rollout rank's hello must be followed by its registration"));
    }
    const wire::Hello hello = *p.hello;
    pending_.erase(it);
    return on_registration(c, hello, env.registration());
  }
  Member* m = member_of(c);
  if (!m) return;  // closed, or refused: its frames already read are dropped
  m->last_seen = Clock::now();
  switch (env.body_case()) {
    case wire::Envelope::kHeartbeat: return;
    case wire::Envelope::kStatusRequest: {
      wire::Envelope reply;
      *reply.mutable_status_reply() = status();
      return c->send(reply);
    }
    case wire::Envelope::kStartUpdate: return updates_.on_start(*m, env.start_update());
    case wire::Envelope::kPauseAck: return updates_.on_pause_ack(*m, env.pause_ack());
    case wire::Envelope::kFinishUpdate: return updates_.on_finish(*m, env.finish_update());
    case wire::Envelope::kAbortUpdate: return updates_.on_abort_request(*m, env.abort_update());
    case wire::Envelope::kFinalized: return updates_.on_finalized(*m, env.finalized());
    case wire::Envelope::kResumeAck: return updates_.on_resume_ack(*m, env.resume_ack());
    case wire::Envelope::kAbortAck: return updates_.on_abort_ack(*m, env.abort_ack());
    default:
      FERRY_LOG_WARN("unexpected message {} from {} ({}); closing it", static_cast<int>(env.body_case()), m->describe(),
                     c->peer());
      c->close(Status::invalid_argument("unexpected message"));
  }
}

void CoordinatorCore::refuse(const std::shared_ptr<Channel>& c, const Status& st) {
  FERRY_LOG_WARN("refused {}: {}", c->peer(), st.message());
  wire::Envelope reply;
  to_wire(st, reply.mutable_welcome()->mutable_status());
  c->send(reply);
  c->close(st);
}

void CoordinatorCore::on_hello(const std::shared_ptr<Channel>& c, Pending& p, const wire::Hello& h) {
  Status st;
  if (h.protocol_version() != kProtocolVersion) {
    st = Status::failed_precondition(fmt::format("protocol version {} from {}; this coordinator speaks {}",
                                                 h.protocol_version(), c->peer(), kProtocolVersion));
  } else if (!options_.token.empty() && !check_answer(options_.token, p.nonce, h.auth())) {
    st = Status::unauthenticated(
        fmt::format("{} answered the token challenge {}", c->peer(), h.auth().empty() ? "with nothing" : "wrongly"));
  } else if (h.role() != "rollout" && h.role() != "trainer" && h.role() != "observer") {
    st = Status::invalid_argument(fmt::format("unknown role '{}'", h.role()));
  }
  if (!st.ok()) {
    pending_.erase(c);
    return refuse(c, st);
  }
  // Authenticated: from here the connection may send frames of any size up to FERRY_MAX_FRAME_BYTES.
  c->set_max_frame(options_.max_frame);
  if (h.role() == "rollout") {
    p.hello = h;  // its registration follows
    return;
  }
  pending_.erase(c);
  Member m;
  m.role = h.role();
  m.channel = c;
  m.state = "connected";
  if (m.role == "trainer") {
    auto key = options_.nonce();
    if (!key.ok()) return refuse(c, key.status());
    m.data_key = std::move(*key);
  }
  admit(c, std::move(m));
}

Status CoordinatorCore::check_registration(const sharding::RankSpec& spec) const {
  // Bounded: a replica is remembered for good and listed rank by rank in every status.
  constexpr int kMaxTpSize = 4096, kMaxReplica = 1 << 20;
  if (spec.tp_size < 1 || spec.tp_size > kMaxTpSize || spec.tp_rank < 0 || spec.tp_rank >= spec.tp_size ||
      spec.replica < 0 || spec.replica > kMaxReplica) {
    return Status::invalid_argument(fmt::format("a rank of replica {} says it is rank {} of TP {}", spec.replica,
                                                spec.tp_rank, spec.tp_size));
  }
  auto it = replicas_.find(spec.replica);
  if (it != replicas_.end() && it->second.tp_size != spec.tp_size) {
    return Status::invalid_argument(fmt::format("replica {} has TP {}; a rank joined saying TP {}", spec.replica,
                                                it->second.tp_size, spec.tp_size));
  }
  return ok_status();
}

void CoordinatorCore::on_registration(const std::shared_ptr<Channel>& c, const wire::Hello& h,
                                      const wire::Registration& r) {
  auto spec = from_wire(r.spec());
  if (!spec.ok()) return refuse(c, spec.status());
  if (Status st = check_registration(*spec); !st.ok()) return refuse(c, st);
  if (r.endpoints().empty()) return refuse(c, Status::invalid_argument("a rollout rank must listen on a data transport"));
  // A rank that restarts may rejoin before its old connection is found dead: the new one replaces it
  // (and fails any update the old one was part of).
  const auto ranks = replica_ranks(members_, spec->replica);
  if (auto old = ranks.find(spec->tp_rank); old != ranks.end()) {
    Member& o = members_.at(old->second);
    FERRY_LOG_WARN("{} joined again from {}; closing its old connection from {}", o.describe(), c->peer(),
                   o.channel->peer());
    const std::shared_ptr<Channel> old_channel = o.channel;  // outlives the member's erasure below
    old_channel->close(Status::unavailable("replaced by a rejoining rank"));
    on_closed(old_channel, Status::unavailable("replaced by a rejoining rank"));
  }
  // The ranks of identical replicas share one copy of their layout: each start's checks read it once.
  std::vector<const sharding::RankSpec*> known;
  for (const auto& [id, x] : members_) {
    if (x.role == "rollout") known.push_back(&x.spec);
  }
  sharding::share_with_alike(*spec, known);
  Member m;
  m.role = h.role();
  m.channel = c;
  m.spec = std::move(*spec);
  m.endpoints.assign(r.endpoints().begin(), r.endpoints().end());
  m.storage_device = r.storage_device();
  m.max_staging_bytes = r.max_staging_bytes();
  ReplicaInfo& info = replicas_[m.spec.replica];
  info.tp_size = m.spec.tp_size;
  info.left.erase(m.spec.tp_rank);
  admit(c, std::move(m));
}

void CoordinatorCore::admit(const std::shared_ptr<Channel>& c, Member m) {
  m.id = next_id_++;
  m.last_seen = Clock::now();
  wire::Envelope reply;
  reply.mutable_welcome()->set_member_id(m.id);
  reply.mutable_welcome()->set_data_key(m.data_key);
  c->send(reply);
  FERRY_LOG_INFO("{} joined from {}", m.describe(), c->peer());
  members_.emplace(m.id, std::move(m));
  changed();
}

void CoordinatorCore::changed() {
  if (on_members_changed_) on_members_changed_();
}

void CoordinatorCore::on_closed(const std::shared_ptr<Channel>& c, const Status& why) {
  pending_.erase(c);
  Member* m = member_of(c);
  if (!m) return;
  FERRY_LOG_INFO("{} left: {}", m->describe(), why.message());
  if (m->role == "rollout") {
    if (auto it = replicas_.find(m->spec.replica); it != replicas_.end()) it->second.left[m->spec.tp_rank] = why.message();
  }
  updates_.on_member_lost(*m, why);
  members_.erase(m->id);
  changed();
}

void CoordinatorCore::reap(Clock::time_point now) {
  const auto limit = std::chrono::milliseconds(options_.timeout_ms);
  for (auto& [id, m] : members_) {
    if (now - m.last_seen > limit) {
      FERRY_LOG_WARN("{} sent nothing for over FERRY_TIMEOUT_MS={}; dropping it", m.describe(), options_.timeout_ms);
      m.channel->close(Status::deadline_exceeded(fmt::format("no heartbeat for over {} ms", options_.timeout_ms)));
    }
  }
  size_t late = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (now - it->second.since > limit) {
      it->first->close(Status::deadline_exceeded("did not join within FERRY_TIMEOUT_MS"));
      it = pending_.erase(it);
      ++late;
    } else {
      ++it;
    }
  }
  if (late > 0 || evicted_ > 0) {
    FERRY_LOG_WARN("closed {} connections that did not join within FERRY_TIMEOUT_MS={} and {} over the bound of {} "
                   "waiting to join",
                   late, options_.timeout_ms, evicted_, options_.max_pending);
    evicted_ = 0;
  }
}

void CoordinatorCore::stop(const std::string& reason) {
  wire::Envelope bye;
  bye.mutable_goodbye()->set_reason(reason);
  for (auto& [id, m] : members_) {
    m.channel->send(bye);
    m.channel->close(Status::unavailable(reason));
  }
  for (auto& [c, p] : pending_) c->close(Status::unavailable(reason));
  pending_.clear();
}

int CoordinatorCore::rollout_ranks() const {
  int n = 0;
  for (const auto& [id, m] : members_) n += m.role == "rollout";
  return n;
}

}  // namespace ferry::coordinator
