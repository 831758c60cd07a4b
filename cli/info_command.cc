#include <cstdlib>
#include <iostream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/buffer.h"
#include "core/settings.h"
#include "core/version.h"
#include "transport/transport.h"

namespace ferry::cli {

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "version, backends built in, and every FERRY_* setting");
  cmd->callback([] {
    std::cout << fmt::format("ferry {} (protocol {})\n", kVersion, kProtocolVersion);
    std::string transports;
    for (const auto& f : transport::transport_factories()) transports += " " + std::string(f.name);
    std::cout << "transports:" << transports << "\n";
#ifdef FERRY_HAVE_CUDA
    std::cout << fmt::format("cuda: built (sm_90); device visible: {}\n", cuda_device_available() ? "yes" : "no");
#else
    std::cout << "cuda: not built\n";
#endif
    std::cout << "settings:\n";
    bool bad = false;
    for (const SettingInfo& s : all_settings()) {
      const char* env = std::getenv(std::string(s.name).c_str());
      auto value = setting_string(s.name);
      std::string shown = value.ok() ? *value : std::string(env ? env : "");
      if (s.name == "FERRY_TOKEN" && !shown.empty()) shown = "(set)";
      std::cout << fmt::format("  {:<26} = {:<12} default {:<10} {}{}\n", s.name, shown.empty() ? "\"\"" : shown,
                               s.default_value.empty() ? "\"\"" : s.default_value, s.help,
                               value.ok() ? "" : "  <-- " + value.status().message());
      bad = bad || !value.ok();
    }
    if (bad) throw CLI::RuntimeError(2);
  });
}

}  // namespace ferry::cli
