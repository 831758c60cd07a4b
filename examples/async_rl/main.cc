// ferry-async-rl: async RL with pause(keep) and resume over the tiny decoder (see async_rl.h).
//
//   ferry-async-rl [--replicas 2] [--updates 4] [--steps-per-update 2] [--tokens-per-step 6]
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "examples/async_rl/async_rl.h"

int main(int argc, char** argv) {
  CLI::App app{"ferry async RL: replicas generate continuously while the trainer updates them in place"};
  async_rl::Options o;
  app.add_option("--replicas", o.replicas, "rollout replicas (TP 1 each)");
  app.add_option("--updates", o.updates, "versions published after the initial one");
  app.add_option("--steps-per-update", o.steps_per_update, "trainer steps between updates");
  app.add_option("--tokens-per-step", o.tokens_per_step, "tokens per replica per trainer step");
  std::string scheme(ferry::scheme_name(o.scheme));
  app.add_option("--scheme", scheme, "quantization scheme of the replicas' linear layers");
  app.add_flag("--clear-cache", o.clear_cache, "restart sequences after every update");
  CLI11_PARSE(app, argc, argv);
  auto parsed = ferry::parse_scheme(scheme);
  if (!parsed.ok()) {
    std::cerr << "ferry-async-rl: " << parsed.status().to_string() << "\n";
    return 1;
  }
  o.scheme = *parsed;
  auto log = async_rl::run(o);
  if (!log.ok()) {
    std::cerr << "ferry-async-rl: " << log.status().to_string() << "\n";
    return 1;
  }
  async_rl::print_summary(*log);
  return 0;
}
