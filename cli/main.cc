// ferry: the command-line tool. `ferry info`, `ferry coordinator`, `ferry plan`, `ferry bench`.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/plan_command.h"
#include "core/version.h"

int main(int argc, char** argv) {
  CLI::App app{"ferry: moves fresh weights from RL trainers into live rollout engines"};
  app.set_version_flag("--version", std::string("ferry ") + ferry::kVersion);
  app.require_subcommand(1);
  ferry::cli::add_info_command(app);
  ferry::cli::add_coordinator_command(app);
  ferry::cli::add_plan_command(app);
  ferry::cli::add_bench_command(app);
  ferry::cli::add_status_command(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
