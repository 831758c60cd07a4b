#include <csignal>
#include <iostream>

#include "cli/commands.h"
#include "coordinator/coordinator.h"

namespace ferry::cli {

void add_coordinator_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("coordinator", "run a coordinator alone until SIGINT or SIGTERM");
  static std::string host;
  static uint16_t port = 0;
  static int metrics_port = -1;
  cmd->add_option("--host", host, "address to listen on (default FERRY_LISTEN_HOST)");
  cmd->add_option("--port", port, "port to listen on (default: any free port)");
  cmd->add_option("--metrics-port", metrics_port, "serve Prometheus text on /metrics (default FERRY_METRICS_PORT)")
      ->check(CLI::Range(0, 65535));
  cmd->callback([] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts, so sigwait gets them
    coordinator::CoordinatorOptions o;
    o.host = host;
    o.port = port;
    if (metrics_port >= 0) o.metrics_port = static_cast<uint16_t>(metrics_port);
    auto c = coordinator::Coordinator::start(o);
    if (!c.ok()) {
      std::cerr << "ferry coordinator: " << c.status().to_string() << "\n";
      throw CLI::RuntimeError(1);
    }
    std::cout << "coordinator listening on " << (*c)->address() << std::endl;
    if ((*c)->metrics_port()) std::cout << "metrics on port " << (*c)->metrics_port() << std::endl;
    int sig = 0;
    sigwait(&set, &sig);
    (*c)->stop();
  });
}

}  // namespace ferry::cli
