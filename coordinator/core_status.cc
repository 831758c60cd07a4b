// What the coordinator tells `ferry status` and /metrics: members, replicas, updates.
#include <map>

#include <fmt/format.h>

#include "coordinator/coordinator_core.h"

namespace ferry::coordinator {
namespace {

// A replica's state from its ranks': serving only with every rank present and serving one version.
wire::ReplicaStatus summarize(int replica, const ReplicaInfo& info, const MemberTable& members) {
  wire::ReplicaStatus r;
  r.set_replica(replica);
  r.set_tp_size(info.tp_size);
  const auto ranks = replica_ranks(members, replica);
  for (int k = 0; k < info.tp_size; ++k) {
    if (!ranks.count(k)) r.add_missing_ranks(k);
  }
  bool serving = r.missing_ranks().empty(), consistent = true, resume_failed = false, updating = false;
  std::set<uint64_t> versions;
  for (const auto& [k, id] : ranks) {
    const Member& m = members.at(id);
    versions.insert(m.version);
    consistent = consistent && m.consistent;
    resume_failed = resume_failed || m.state == "resume-failed";
    updating = updating || m.state == "pausing" || m.state == "paused" || m.state == "transferring" ||
               m.state == "finalizing" || m.state == "complete" || m.state == "applying";
    // A rank staging an update while serving still serves the version it holds.
    serving = serving && (m.state == "serving" || m.state == "staging" || m.state == "staged");
  }
  serving = serving && versions.size() == 1;
  if (versions.size() == 1) r.set_version(*versions.begin());
  r.set_serving(serving);
  r.set_state(serving                          ? "serving"
              : !r.missing_ranks().empty()     ? "incomplete"
              : resume_failed                  ? "resume-failed"
              : updating                       ? "updating"
              : !consistent                    ? "inconsistent"
                                               : "paused");
  return r;
}

}  // namespace

wire::StatusReply CoordinatorCore::status() const {
  wire::StatusReply r;
  r.set_phase(updates_.phase());
  uint64_t v = 0;
  for (const auto& [id, m] : members_) {
    auto* s = r.add_members();
    s->set_member_id(id);
    s->set_role(m.role);
    s->set_peer(m.channel->peer());
    s->set_replica(m.role == "rollout" ? m.spec.replica : -1);
    s->set_tp_rank(m.role == "rollout" ? m.spec.tp_rank : -1);
    s->set_version(m.version);
    s->set_state(m.state);
    s->set_consistent(m.consistent);
    if (m.role == "rollout") v = std::max(v, m.version);
  }
  r.set_version(v);
  for (const auto& [replica, info] : replicas_) *r.add_replicas() = summarize(replica, info, members_);
  for (const auto& u : updates_.history()) *r.add_updates() = u;
  return r;
}

// Prometheus text exposition of members, replicas, versions and updates.
std::string CoordinatorCore::metrics() const {
  std::map<std::string, int> roles;
  for (const auto& [id, m] : members_) roles[m.role]++;
  std::string out = "# HELP ferry_members Members joined, by role.\n# TYPE ferry_members gauge\n";
  for (const char* r : {"trainer", "rollout", "observer"}) out += fmt::format("ferry_members{{role=\"{}\"}} {}\n", r, roles[r]);
  out += "# HELP ferry_updates_total Weight updates finished, by result.\n# TYPE ferry_updates_total counter\n";
  out += fmt::format("ferry_updates_total{{result=\"ok\"}} {}\n", updates_.updates_ok());
  out += fmt::format("ferry_updates_total{{result=\"failed\"}} {}\n", updates_.updates_failed());
  out += "# HELP ferry_update_in_progress 1 while an update runs.\n# TYPE ferry_update_in_progress gauge\n";
  out += fmt::format("ferry_update_in_progress {}\n", updates_.in_update() ? 1 : 0);
  out += "# HELP ferry_weight_version Weight version each rollout rank holds.\n# TYPE ferry_weight_version gauge\n";
  std::string consistent =
      "# HELP ferry_rank_consistent 1 when the rank holds one complete version.\n# TYPE ferry_rank_consistent gauge\n";
  for (const auto& [id, m] : members_) {
    if (m.role != "rollout") continue;
    const std::string labels = fmt::format("replica=\"{}\",rank=\"{}\"", m.spec.replica, m.spec.tp_rank);
    out += fmt::format("ferry_weight_version{{{}}} {}\n", labels, m.version);
    consistent += fmt::format("ferry_rank_consistent{{{}}} {}\n", labels, m.consistent ? 1 : 0);
  }
  out += consistent;
  out += "# HELP ferry_replica_serving 1 when every rank of the replica is present and serving one version.\n"
         "# TYPE ferry_replica_serving gauge\n";
  std::string missing = "# HELP ferry_replica_missing_ranks Ranks of the replica that are not members.\n"
                        "# TYPE ferry_replica_missing_ranks gauge\n";
  for (const auto& [replica, info] : replicas_) {
    const auto s = summarize(replica, info, members_);
    out += fmt::format("ferry_replica_serving{{replica=\"{}\"}} {}\n", replica, s.serving() ? 1 : 0);
    missing += fmt::format("ferry_replica_missing_ranks{{replica=\"{}\"}} {}\n", replica, s.missing_ranks_size());
  }
  out += missing;
  if (!updates_.history().empty()) {
    const auto& u = updates_.history().back();
    out += "# HELP ferry_last_update_seconds Duration of the last update.\n# TYPE ferry_last_update_seconds gauge\n";
    out += fmt::format("ferry_last_update_seconds {}\n", u.seconds());
    out += "# HELP ferry_last_update_bytes Bytes the last update moved.\n# TYPE ferry_last_update_bytes gauge\n";
    out += fmt::format("ferry_last_update_bytes {}\n", u.bytes());
  }
  return out;
}

}  // namespace ferry::coordinator
