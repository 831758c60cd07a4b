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
    // Every setting, its value and where it came from (a command line has no keywords: the
    // environment or the default).
    std::cout << "settings:\n";
    auto values = resolve_settings();
    if (!values.ok()) throw CLI::RuntimeError(2);
    bool bad = false;
    for (const SettingValue& v : *values) {
      const SettingInfo& s = *v.info;
      std::string shown = v.text;
      if (s.name == "FERRY_TOKEN" && !shown.empty()) shown = "(set)";
      std::cout << fmt::format("  {:<26} = {:<12} {:<14} default {:<10} {}{}\n", s.name,
                               shown.empty() ? "\"\"" : shown, fmt::format("({})", source_name(v.source)),
                               s.default_value.empty() ? "\"\"" : s.default_value, s.help,
                               v.status.ok() ? "" : "  <-- " + v.status.message());
      bad = bad || !v.status.ok();
    }
    if (bad) throw CLI::RuntimeError(2);
  });
}

}  // namespace ferry::cli
