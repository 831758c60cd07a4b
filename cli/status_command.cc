#include <iostream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "coordinator/status_client.h"

namespace ferry::cli {

void add_status_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("status", "a coordinator's members, their versions and states, and the last updates");
  static std::string address;
  static int64_t timeout_ms = 5000;
  cmd->add_option("address", address, "coordinator host:port")->required();
  cmd->add_option("--timeout-ms", timeout_ms, "deadline for the answer");
  cmd->callback([] {
    auto settings = load_settings();
    auto r = settings.ok() ? coordinator::query_status(address, timeout_ms, *settings)
                           : Result<wire::StatusReply>(settings.status());
    if (!r.ok()) {
      std::cerr << "ferry status: " << r.status().to_string() << "\n";
      throw CLI::RuntimeError(1);
    }
    std::cout << fmt::format("coordinator {}: phase {}, serving version {}\n", address, r->phase(), r->version());
    std::cout << fmt::format("{:>4}  {:<8} {:<22} {:>7} {:>4} {:>8}  {}\n", "id", "role", "peer", "replica", "rank",
                             "version", "state");
    for (const auto& m : r->members()) {
      std::cout << fmt::format("{:>4}  {:<8} {:<22} {:>7} {:>4} {:>8}  {}{}\n", m.member_id(), m.role(), m.peer(),
                               m.replica() < 0 ? "-" : std::to_string(m.replica()),
                               m.tp_rank() < 0 ? "-" : std::to_string(m.tp_rank()), m.version(), m.state(),
                               m.role() == "rollout" && !m.consistent() ? " (inconsistent)" : "");
    }
    if (r->replicas_size()) std::cout << "replicas:\n";
    for (const auto& rep : r->replicas()) {
      std::string missing;
      for (int k : rep.missing_ranks()) missing += (missing.empty() ? " missing rank " : ", ") + std::to_string(k);
      std::cout << fmt::format("  replica {}: {} (TP {}{}){}\n", rep.replica(), rep.state(), rep.tp_size(),
                               rep.serving() || rep.version() ? fmt::format(", v{}", rep.version()) : "", missing);
    }
    if (r->updates_size()) std::cout << "last updates:\n";
    for (const auto& u : r->updates()) {
      std::cout << fmt::format("  v{}: {} ranks={} bytes={} seconds={:.4f}{}\n", u.version(), u.ok() ? "ok" : "FAILED",
                               u.ranks(), u.bytes(), u.seconds(), u.ok() ? "" : " " + u.error());
    }
  });
}

}  // namespace ferry::cli
