// The link measurements of `ferry bench e2e`, made from the bench's process to its rank processes
// in rounds between the updates (bench/e2e_bench.h says what each one is).
#pragma once

#include "sharding/cost_model.h"
#include "sharding/llama.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/e2e_probe.h"
#include "bench/e2e_setup.h"
#include "core/settings.h"
#include "core/status.h"
#include "core/tensor.h"
#include "sharding/planner.h"

namespace ferry::e2e {

struct Links {
  double round_trip_seconds = 0;
  double host_bytes_per_second = 0;
  double seconds_per_bucket = 0;
  double pack_bytes_per_second = 0;
  double process_bytes_per_second = 0;  // the slowest rank's, its pieces as one trainer sends them
  // The same, its pieces as `senders` trainer ranks cut them (each holding Shard(0) rows of every
  // tensor), their buckets arriving in turn; 0 when not measured (one sender).
  double process_many_bytes_per_second = 0;
  // How many stages' worth of work the host does at a time (sharding::Topology::host_parallelism):
  // the stages timed alone and added up as the cost model adds them, over their time run at once
  // (one sender packing its buckets and sending each over its connections as it is packed, while
  // the ranks process). Below 1 where doing them at once cost more than one after another (the
  // cost model takes at least 1).
  double host_parallelism = 1;
  // The same with `senders` trainer ranks packing and sending their shares at once, each over a
  // transport and connections of its own, and the ranks' pieces cut as theirs; 0 when not measured
  // (one sender).
  double host_parallelism_many = 0;
  // The medians of those runs of the stages at once (seconds; 0 when not measured).
  double overlap_seconds = 0;
  double overlap_many_seconds = 0;
};

// How the trainer packs with FERRY_DELTA on: each part compared with its copy of the version sent
// before, and a copy of each tensor kept after it, which every byte pays whether or not a delta is
// sent. max_bytes 0: deltas off (FERRY_DELTA=off, or auto: the bench's ranks are on this host).
struct PackDeltas {
  uint64_t max_bytes = 0;  // FERRY_DELTA_MAX_BYTES
  bool prefer = false;     // FERRY_DELTA=always
  int zstd = 0;            // FERRY_DELTA_ZSTD
};
PackDeltas pack_deltas(const Settings& s);

class LinkProbe {
 public:
  // Opens a control channel to every rank (`ranks` in rank order) and connects to each over
  // `transport`. The packing measurement packs as the trainer does under `deltas`. Every round also
  // runs the host's stages at once (Links::host_parallelism). `senders` > 1: the ranks' processing
  // is measured again with their pieces as that many trainer ranks cut them, and the stages at once
  // again with that many threads packing and those pieces.
  static Result<std::unique_ptr<LinkProbe>> open(std::vector<ProbeSocket>& ranks, const std::string& transport,
                                                 const sharding::Plan& plan,
                                                 const std::vector<sharding::RankSpec>& specs,
                                                 const sharding::Manifest& manifest, int in_flight,
                                                 const PackDeltas& deltas, int senders = 1);
  virtual ~LinkProbe() = default;
  // One round of every measurement; `keep` false for a warm-up round.
  virtual Status round(bool keep) = 0;
  // Medians over the kept rounds.
  virtual Links links() const = 0;
};

// The cost model's inputs from measured links: one host, its transport at the measured rate. `many`:
// for the plan of several senders (the ranks' processing and the host's parallelism as measured for
// it, where they were).
void cost_inputs(const Links& links, sharding::Topology* topo, sharding::CostOptions* options, bool many = false);

// JSON objects of a prediction's parts and of the links it came from, as the benches print them:
// {"control":..,"pipeline":..,"critical":"..","fill":..,"busy":..,"drain":..,"pack":..,"process":..,"host":..}
// {"round_trip_seconds":..,"host_gbps":..,"seconds_per_bucket":..,"pack_gbps":..,"process_gbps":..,
//  "process_many_gbps":..,"host_parallelism":..,"host_parallelism_many":..,"overlap_seconds":..,
//  "overlap_many_seconds":..}
std::string predicted_json(const sharding::CostReport& c);
std::string links_json(const Links& l);

}  // namespace ferry::e2e
