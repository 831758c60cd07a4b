// `ferry plan`: plans a weight update for a model on a cluster and prints the schedule and the
// predicted update time, comparing a broadcast from trainer rank 0 with ferry's balanced plan; with
// `--layout fsdp|hsdp|pipeline|ep` the trainer ranks hold shards (sharding/trainer_layouts.h), each
// sends its own, beside gathering everything onto rank 0 and sending from there.
#pragma once

#include <iosfwd>

#include <CLI/CLI.hpp>

namespace ferry::cli {

// Registers the `plan` subcommand on `app`; its output goes to `out` (errors to std::cerr, and a
// CLI::RuntimeError(1) for the caller's CLI11_PARSE to turn into the exit code).
void add_plan_command(CLI::App& app);
void add_plan_command(CLI::App& app, std::ostream& out);

}  // namespace ferry::cli

// The CLI main may call it unqualified.
using ferry::cli::add_plan_command;
