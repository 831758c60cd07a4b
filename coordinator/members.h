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
  std::string state = "joined";
  std::chrono::steady_clock::time_point last_seen;

  std::string describe() const;
};

using MemberTable = std::map<int, Member>;

}  // namespace ferry::coordinator
