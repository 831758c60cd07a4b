#include <csignal>
#include <iostream>

#include "cli/commands.h"
#include "coordinator/coordinator.h"

namespace ferry::cli {

void add_coordinator_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("coordinator", "run a coordinator alone until SIGINT or SIGTERM");
  static std::string host;
  static uint16_t port = 0;
  cmd->add_option("--host", host, "address to listen on (default FERRY_LISTEN_HOST)");
  cmd->add_option("--port", port, "port to listen on (default: any free port)");
  cmd->callback([] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts, so sigwait gets them
    auto c = coordinator::Coordinator::start({host, port});
    if (!c.ok()) {
      std::cerr << "ferry coordinator: " << c.status().to_string() << "\n";
      throw CLI::RuntimeError(1);
    }
    std::cout << "coordinator listening on " << (*c)->address() << std::endl;
    int sig = 0;
    sigwait(&set, &sig);
    (*c)->stop();
  });
}

}  // namespace ferry::cli
