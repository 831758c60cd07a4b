// Predicted update time of a plan on a cluster: every bucket crosses the links between its sender's
// GPU and its receiver's GPU (NVLink inside a node; PCIe and the NIC at both ends across nodes); a
// link's time is its bytes over its bandwidth plus a fixed cost per bucket; the update takes as long
// as the busiest link. docs/cost_model.md derives it and works the Kimi-K2 case.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "sharding/planner.h"

namespace ferry::sharding {

// Bandwidths are per GPU and per direction, in Gb/s (gigabits), as measured or as sold.
struct Topology {
  int gpus_per_node = 8;
  double nvlink_gbps = 3600;  // 450 GB/s per direction (H100/H200 NVLink 4)
  double pcie_gbps = 512;     // PCIe 5.0 x16, GPU to NIC
  double nic_gbps = 400;      // one 400 Gb/s NIC per GPU
  // True: rollout rank d runs on the node of trainer GPU d (one shared cluster); false: rollouts
  // start on the first node after the trainers'.
  bool colocated = false;
  double seconds_per_bucket = 10e-6;  // posting and completing one bucket on a link
};

struct CostOptions {
  // True: the sender quantizes before sending, so a quantized parameter crosses the wire at its
  // scheme's width (fp8: 8 bits) instead of the source dtype's.
  bool quantize_on_sender = false;
};

struct LinkLoad {
  std::string link;  // "nic_rx gpu 260"
  uint64_t bytes = 0;
  uint64_t buckets = 0;
  double seconds = 0;
};

struct CostReport {
  double predicted_seconds = 0;
  uint64_t bytes_moved = 0;      // bytes on the wire, every copy counted
  uint64_t max_link_bytes = 0;
  uint64_t max_sender_bytes = 0;
  uint64_t max_receiver_bytes = 0;
  int senders_used = 0;
  size_t pieces = 0;
  size_t buckets = 0;
  // Lower bound that no schedule beats: the busiest receiver's bytes over its fastest inbound path.
  double receiver_bound_seconds = 0;
  std::vector<LinkLoad> busiest;  // the busiest links, most loaded first (at most 5)
};

// `num_senders` trainer GPUs send `plan` to ranks.size() rollout GPUs.
Result<CostReport> estimate_cost(const Plan& plan, const std::vector<RankSpec>& ranks, int num_senders,
                                 const Topology& topo, const CostOptions& options = {});

}  // namespace ferry::sharding
