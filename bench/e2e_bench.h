// `ferry bench e2e`: whole updates of a model (demo or delta) from a trainer into a TP replica whose ranks
// are separate processes, over one transport, beside the cost model's prediction for the same plan
// from links measured between the same processes in the same run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

struct E2eOptions {
  std::string transport = "tcp";  // tcp, shm, ucx, or "all": every one of them built in
  std::string scheme = "fp8_per_channel";  // an online scheme: the trainer sends full precision
  int updates = 10;               // timed rounds (links, then an update), after one warm-up round
  int tp = 2;
  std::string bucket_bytes;       // empty: FERRY_BUCKET_BYTES
  bool json = false;
  // The model updated: "demo" (5.49 MB of bf16), or "delta" (117M parameters, 234 MB: links and
  // senders matter more than the fixed costs of an update). --delta always uses "delta".
  std::string model = "demo";
  // Non-empty: a sharded trainer of each of these sizes beside gather-then-send (e2e_trainers.h)
  // instead of the one-trainer update.
  std::vector<int> trainers;
  // Delta updates and staging (e2e_delta.h) instead of the one-trainer update.
  bool delta = false;
};

// The trainer (with the embedded coordinator) runs in this process; the TP ranks are this binary
// re-run as `ferry bench e2e-rank`. Per transport it runs one warm-up round and `updates` timed
// rounds; a round measures the links between these processes and then makes one update with new
// weights. The links:
//   round_trip_seconds: a control message and its answer over ferry's control channel between this
//     process and a rank process (answered on the rank's I/O thread, awaited here by a waiting
//     thread, as the trainer awaits the coordinator);
//   host_gbps and seconds_per_bucket: the transport from this process to every rank at once, with
//     FERRY_BUCKETS_IN_FLIGHT per rank: 64 buckets of 4 KiB per rank, and the plan's buckets
//     (repeated to at least 32 MiB), solved for bytes per second and seconds per bucket;
//   pack_gbps: this process packing a new version's weights into bucket buffers, as the trainer does;
//   process_gbps: each rank, one after another, processing its own pieces (new values each time)
//     through a reload engine of its own, as it processes a bucket;
//   host_parallelism: those stages run at once (this process packing the plan's buckets and sending
//     each as it is packed, while every rank processes), their one-at-a-time sum over that time
//     (overlap_seconds); the cost model takes at least 1.
// Each is the median over the timed rounds, and feeds the cost model (sharding/cost_model.h) for the
// same plan: one host, one sender, FERRY_BUCKET_BYTES. One line per transport:
//   {"bench":"e2e","case":"<transport>/<scheme>","device":"cpu","tp":T,"updates":N,"bytes":B,
//    "buckets":K,"seconds":S,"predicted_seconds":P,"ratio":P/S,
//    "measured":{"pause":..,"plan":..,"transfer":..,"process":..,"resume":..,"other":..},
//    "predicted":{"control":..,"pipeline":..,"critical":"..","fill":..,"busy":..,"drain":..,
//                 "pack":..,"process":..,"host":..},
//    "links":{"round_trip_seconds":..,"host_gbps":..,"seconds_per_bucket":..,"pack_gbps":..,
//             "process_gbps":..,"process_many_gbps":..,"host_parallelism":..,
//             "host_parallelism_many":..,"overlap_seconds":..,"overlap_many_seconds":..}}
// seconds and every "measured" entry: medians over the timed updates of UpdateReport's seconds and
// its parts ("other": seconds minus pause, plan, transfer and resume: the finish round trip and the
// ranks' last processing). "predicted": the cost model's terms (CostReport). gbps: bytes / s / 1e9.
// Returns 0, or 1 after printing the error.
int run_e2e_bench(const E2eOptions& options);

// The rank process (hidden subcommand `ferry bench e2e-rank`).
int run_e2e_rank(uint16_t probe_port, const std::string& coordinator, int rank, int tp, const std::string& scheme,
                 const std::string& transport, const std::string& model);

}  // namespace ferry
