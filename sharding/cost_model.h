// Predicted update time of a plan on a cluster: every bucket crosses the links between its sender's
// GPU and its receiver's GPU (NVLink inside a node; PCIe and the NIC at both ends across nodes), or
// between two processes of one host through the host transport; a link's time is its bytes over its
// bandwidth plus a fixed cost per bucket. With the links alone the update takes as long as the
// busiest link. Optional stages around the links (the sender packing buckets, the rank processing
// them) and the control round trips of an update add the pipeline's fill and drain and a fixed
// cost. docs/cost_model.md derives it, works the Kimi-K2 case and checks it against `ferry bench e2e`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "sharding/planner.h"

namespace ferry::sharding {

// Where senders and rollout ranks run.
enum class Placement : uint8_t {
  kGpuNodes,  // trainer GPU s and rollout GPU first + d on nodes of gpus_per_node GPUs (below)
  kOneHost,   // every sender and rank is a process on one host; a bucket crosses the host transport:
              // host_tx of its sender and host_rx of its rank, each at host_gbps
};

// Bandwidths are per GPU (or per process, on one host) and per direction, in Gb/s (gigabits), as
// measured or as sold.
struct Topology {
  int gpus_per_node = 8;
  double nvlink_gbps = 3600;  // 450 GB/s per direction (H100/H200 NVLink 4)
  double pcie_gbps = 512;     // PCIe 5.0 x16, GPU to NIC
  double nic_gbps = 400;      // one 400 Gb/s NIC per GPU
  // True: rollout rank d runs on the node of trainer GPU d (one shared cluster); false: rollouts
  // start on the first node after the trainers'.
  bool colocated = false;
  double seconds_per_bucket = 10e-6;  // posting and completing one bucket on a link
  Placement placement = Placement::kGpuNodes;
  double host_gbps = 0;  // kOneHost: the host transport between two processes
  // kOneHost: how many stages' worth of work the host does at a time (its cores and memory shared
  // between the senders packing, the transport's copies and the ranks processing), as measured
  // (`ferry bench e2e`'s overlap probe); 1: one stage at a time. Values below 1 are taken as 1.
  double host_parallelism = 1;
  // kGpuNodes: when not empty, the GPU (index over the cluster, gpus_per_node to a node) of each
  // rollout rank, instead of the placement `colocated` gives. Ranks may share a GPU (and its links).
  std::vector<int64_t> rank_gpus;
};

// Work around the links, each left out when zero. Rates in bytes per second, as measured.
struct Stages {
  // One sender copying its pieces into buckets, one after another in plan order.
  double pack_bytes_per_second = 0;
  // One rollout rank processing what it receives into storage.
  double process_bytes_per_second = 0;
  // One control round trip between the trainer's process and a rank's; an update makes
  // kControlRoundTrips of them one after another (see docs/cost_model.md).
  double round_trip_seconds = 0;
};

// A link's measured rate and fixed cost per bucket, as the model takes them: a run of B buckets
// carrying N bytes takes N / bytes_per_second + B * seconds_per_bucket.
struct LinkFit {
  double bytes_per_second = 0;
  double seconds_per_bucket = 0;
};

// The two unknowns from two timed runs, one of few large buckets and one of small ones (bytes,
// buckets and seconds of each). The rate of the large run alone (its bytes over its time) already
// holds its buckets' fixed cost, which the model then adds again. Unavailable when noise leaves the
// rate non-positive or the fixed cost negative (then keep the large run's bytes over its time,
// fixed 0).
Result<LinkFit> fit_link(double big_bytes, double big_buckets, double big_seconds, double small_bytes,
                         double small_buckets, double small_seconds);

// start -> pause -> pause ack -> start reply; finish -> finalize -> finalized; resume -> resume ack
// -> finish reply: trainer-coordinator twice, coordinator-ranks three times.
inline constexpr int kControlRoundTrips = 5;

struct CostOptions {
  // True: the sender quantizes before sending, so a quantized parameter crosses the wire at its
  // scheme's width (fp8: 8 bits) instead of the source dtype's.
  bool quantize_on_sender = false;
  Stages stages = {};
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
  // predicted_seconds = control_seconds + pipeline_seconds.
  double control_seconds = 0;   // kControlRoundTrips round trips
  double pipeline_seconds = 0;  // the longest chain: fill + busy + drain of its resource
  std::string critical;         // a link, "pack trainer 0", "process rollout rank 1" or the host
  double fill_seconds = 0;      // until the first bucket reaches it
  double busy_seconds = 0;      // its own work
  double drain_seconds = 0;     // its last bucket's later stages
  double pack_seconds = 0;      // the busiest sender's packing
  double process_seconds = 0;   // the busiest rank's processing
  // One host: the sum of every stage's work; over Topology::host_parallelism, a bound on the
  // pipeline.
  double host_seconds = 0;
};

// `num_senders` trainer GPUs send `plan` to ranks.size() rollout GPUs.
Result<CostReport> estimate_cost(const Plan& plan, const std::vector<RankSpec>& ranks, int num_senders,
                                 const Topology& topo, const CostOptions& options = {});

}  // namespace ferry::sharding
