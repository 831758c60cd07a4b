// The link measurements of `ferry bench e2e`, made from the bench's process to its rank processes
// in rounds between the updates (bench/e2e_bench.h says what each one is).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/e2e_probe.h"
#include "core/status.h"
#include "core/tensor.h"
#include "sharding/planner.h"

namespace ferry::e2e {

// Full-precision weights of one version: every tensor differs from the previous version's.
struct Weights {
  std::vector<std::vector<uint16_t>> data;  // manifest order
  std::vector<TensorView> views;
  std::map<std::string, TensorView> by_name;

  Weights(const sharding::Manifest& m, uint64_t version);
};

// bf16 values in about [-0.06, 0.06] from a xorshift state.
uint16_t next_bf16(uint64_t& state);

struct Links {
  double round_trip_seconds = 0;
  double host_bytes_per_second = 0;
  double seconds_per_bucket = 0;
  double pack_bytes_per_second = 0;
  double process_bytes_per_second = 0;  // the slowest rank's
};

class LinkProbe {
 public:
  // Opens a control channel to every rank (`ranks` in rank order) and connects to each over
  // `transport`.
  static Result<std::unique_ptr<LinkProbe>> open(std::vector<ProbeSocket>& ranks, const std::string& transport,
                                                 const sharding::Plan& plan, const std::vector<sharding::RankSpec>& specs,
                                                 const sharding::Manifest& manifest, int in_flight);
  virtual ~LinkProbe() = default;
  // One round of every measurement; `keep` false for a warm-up round.
  virtual Status round(bool keep) = 0;
  // Medians over the kept rounds.
  virtual Links links() const = 0;
};

double median(std::vector<double> v);

}  // namespace ferry::e2e
