// Subcommands of the `ferry` tool; each registers itself on the app.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void add_info_command(CLI::App& app);
void add_coordinator_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_status_command(CLI::App& app);

}  // namespace ferry::cli
