// Reading a coordinator's status from a test, over its real port.
#pragma once

#include <chrono>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/status_client.h"

namespace ferry::testutil {

inline wire::StatusReply status(const std::string& address) {
  auto r = coordinator::query_status(address, 5000, load_settings().value());
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : wire::StatusReply{};
}

// The member that is TP rank `tp_rank` of a rollout replica, or null.
inline const wire::MemberStatus* rank(const wire::StatusReply& s, int tp_rank) {
  for (const auto& m : s.members()) {
    if (m.role() == "rollout" && m.tp_rank() == tp_rank) return &m;
  }
  return nullptr;
}

inline const wire::ReplicaStatus* replica(const wire::StatusReply& s, int id) {
  for (const auto& r : s.replicas()) {
    if (r.replica() == id) return &r;
  }
  return nullptr;
}

// Waits until the coordinator has seen rank `tp_rank` leave: a rank started again before that
// would replace it, failing whatever update the old one was still part of.
inline void wait_gone(const std::string& address, int tp_rank) {
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10); std::chrono::steady_clock::now() < until;) {
    if (rank(status(address), tp_rank) == nullptr) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "rank " << tp_rank << " is still a member";
}

}  // namespace ferry::testutil
