// The coordinator's view of its members, shared by membership handling and the update machine.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include <vector>

#include "coordinator/channel.h"
#include "sharding/model_spec.h"

namespace ferry::coordinator {

struct Member {
  int id = 0;
  std::shared_ptr<Channel> channel;
  std::string role;  // trainer, rollout, observer
  sharding::RankSpec spec;
  std::vector<wire::Endpoint> endpoints;
  std::string storage_device;  // rollout ranks: "cpu", "cuda:0", ...
  uint64_t version = 0;     // the version its storage holds complete
  bool consistent = false;  // false until a complete version lands, and after an aborted update
  // The version its delta shadow holds complete (Finalized.delta_base); 0 when its PauseAck reports
  // another base, and from the moment an update is handed out to it until that update finalizes,
  // so a failed one leaves none.
  uint64_t delta_base = 0;
  uint64_t max_staging_bytes = 0;  // what it may stage (0: no bound): a staged update must fit
  std::string state = "joined";
  std::chrono::steady_clock::time_point last_seen;
  std::string data_key;  // trainers: proves their data connections to ranks (auth.h)

  std::string describe() const;
};

using MemberTable = std::map<int, Member>;

// Every replica that ever had a rank join, with its TP size and why each absent rank left. An update
// of all replicas needs every rank of each: a replica short of ranks fails it before anything
// pauses, unless the update names the replicas it takes (a rolling update without that one).
struct ReplicaInfo {
  int tp_size = 0;
  std::map<int, std::string> left;  // tp rank -> why it left (absent ranks only)
};
using ReplicaTable = std::map<int, ReplicaInfo>;

// The member ids of `replica`'s ranks, by tp rank.
std::map<int, int> replica_ranks(const MemberTable& members, int replica);

}  // namespace ferry::coordinator
