// Async RL on ferry: replicas of the tiny decoder generate continuously, each on its own thread,
// every token tagged with the weight version it was generated with (RolloutWorker::weight_version());
// a trainer publishes new weights every few steps with pause mode `keep`: the pause hook freezes
// generation in place between two tokens, the update lands, and resume continues the same
// sequences on the new weights. Trainer and replicas talk over real sockets on 127.0.0.1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/scheme.h"
#include "core/status.h"

namespace async_rl {

struct Options {
  int replicas = 2;
  int updates = 4;           // versions published after the first (v1 is the initial load)
  int steps_per_update = 2;  // trainer steps between two updates
  int tokens_per_step = 6;   // tokens every replica generates per trainer step
  bool clear_cache = false;  // told to the pause hook: restart sequences after resume
  ferry::Scheme scheme = ferry::Scheme::kFp8PerChannel;
  int64_t timeout_ms = 30'000;  // every wait of the trainer
};

// What happened, in order, on one replica.
struct Event {
  enum Kind : uint8_t { kToken, kPause, kResume };
  Kind kind = kToken;
  uint64_t version = 0;  // token: its tag; pause: the version about to load; resume: the new one
  uint64_t seq = 0;      // a global order over every replica's events
  int32_t token = 0;
  // Token only: the version the resume hook announced last; differs from `version` only when
  // a token was tagged with a version the storage did not hold.
  uint64_t hook_version = 0;
};

struct UpdateStats {
  uint64_t version = 0;
  double pause_seconds = 0;               // the trainer's report: pause barrier closed
  double seconds = 0;                     // start to finish of the update
  std::vector<double> frozen_seconds;     // per replica: pause hook to resume hook
};

struct RunLog {
  std::vector<uint64_t> published;             // versions the trainer completed, in order
  std::vector<std::vector<Event>> replicas;    // per replica
  std::vector<UpdateStats> updates;
};

// Runs the trainer and `options.replicas` replicas in this process and returns the log.
ferry::Result<RunLog> run(const Options& options);

// Prints pause time per update and tokens generated per version and replica.
void print_summary(const RunLog& log);

}  // namespace async_rl
