// What the cost model and the bench's lines take from the measured links (bench/e2e_links.h).
#include "bench/e2e_links.h"

#include <fmt/format.h>

namespace ferry::e2e {

PackDeltas pack_deltas(const Settings& s) {
  // The bench's ranks share the trainer's host, where "auto" sends dense.
  if (s.delta == "off" || s.delta == "auto") return {};
  return {s.delta_max_bytes, s.delta == "always", static_cast<int>(s.delta_zstd)};
}

void cost_inputs(const Links& links, sharding::Topology* topo, sharding::CostOptions* options, bool many) {
  topo->placement = sharding::Placement::kOneHost;
  topo->host_gbps = links.host_bytes_per_second * 8 / 1e9;
  topo->seconds_per_bucket = links.seconds_per_bucket;
  options->stages.pack_bytes_per_second = links.pack_bytes_per_second;
  options->stages.process_bytes_per_second = many && links.process_many_bytes_per_second > 0
                                                 ? links.process_many_bytes_per_second
                                                 : links.process_bytes_per_second;
  options->stages.round_trip_seconds = links.round_trip_seconds;
  topo->host_parallelism =
      many && links.host_parallelism_many > 0 ? links.host_parallelism_many : links.host_parallelism;
}

std::string predicted_json(const sharding::CostReport& c) {
  return fmt::format(
      "{{\"control\":{:.9f},\"pipeline\":{:.9f},\"critical\":\"{}\",\"fill\":{:.9f},\"busy\":{:.9f},"
      "\"drain\":{:.9f},\"pack\":{:.9f},\"process\":{:.9f},\"host\":{:.9f}}}",
      c.control_seconds, c.pipeline_seconds, c.critical, c.fill_seconds, c.busy_seconds, c.drain_seconds,
      c.pack_seconds, c.process_seconds, c.host_seconds);
}

std::string links_json(const Links& l) {
  return fmt::format(
      "{{\"round_trip_seconds\":{:.9f},\"host_gbps\":{:.3f},\"seconds_per_bucket\":{:.9f},\"pack_gbps\":{:.3f},"
      "\"process_gbps\":{:.3f},\"process_many_gbps\":{:.3f},\"host_parallelism\":{:.3f},"
      "\"host_parallelism_many\":{:.3f},\"overlap_seconds\":{:.9f},\"overlap_many_seconds\":{:.9f}}}",
      l.round_trip_seconds, l.host_bytes_per_second / 1e9, l.seconds_per_bucket, l.pack_bytes_per_second / 1e9,
      l.process_bytes_per_second / 1e9, l.process_many_bytes_per_second / 1e9, l.host_parallelism,
      l.host_parallelism_many, l.overlap_seconds, l.overlap_many_seconds);
}

}  // namespace ferry::e2e
