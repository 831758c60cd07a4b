// `ferry bench e2e --trainers N`: whole updates of the demo model from a sharded trainer of N
// processes, each holding FSDP2 Shard(0) rows of every tensor and sending only those, beside the
// same N processes gathering their rows to the first (over loopback TCP, as an all-gather onto one
// rank would) which then sends whole tensors alone; both into one TP replica of rank processes, over
// one transport, beside the cost model's prediction of each from links measured in the same run
// (e2e_bench.h). One line per (transport, N):
//   {"bench":"e2e-trainers","case":"<transport>/<scheme>","trainers":N,"tp":T,"updates":U,"bytes":B,
//    "sharded_seconds":S,"sharded_predicted_seconds":..,"gather_seconds":G,
//    "gather_predicted_seconds":..,"speedup":G/S,"sharded_predicted":{..},"one_sender_predicted":{..},
//    "gather_path":{"own_seconds":..,"frame_seconds":..},"sharded_measured":{"pause":..,"transfer":..,
//    "process":..},"gather_measured":{..},"links":{..}}
// (the predictions' parts and the links as e2e_links.h's predicted_json / links_json print them;
// one_sender_predicted: the plan of one sender, which the gather prediction adds the gather path's
// frames and copy to; *_measured: trainer rank 0's UpdateReport, medians).
// Seconds are medians over the timed updates (after one warm-up) as trainer rank 0 sees them, from
// the moment it has the version's weights (its rows; gathering: before it asks the other ranks for
// theirs) until finish_weight_update returns. The gather prediction adds the bytes rank 0 does not hold at the host
// link's rate to the one-sender prediction.
#pragma once

#include <cstdint>
#include <string>

#include "bench/e2e_bench.h"
#include "core/status.h"

namespace ferry {

Status run_trainers_case(const E2eOptions& options, const std::string& transport, int trainers);

// The trainer processes (hidden subcommand `ferry bench e2e-trainer`).
int run_e2e_trainer(uint16_t probe_port, const std::string& coordinator, int rank, int trainers, const std::string& mode,
                    int updates, uint64_t first_version, const std::string& model);

}  // namespace ferry
