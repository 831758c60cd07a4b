// A helper binary the tests start (ferry-fault-peer): where the build put it, else, when the test
// binaries were moved (bench/gpu/package.sh packs them into one folder for a GPU machine), the same
// name beside this test's own binary.
#pragma once

#include <filesystem>
#include <string>

namespace ferry::testutil {

inline std::string sibling_binary(const char* built) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(built, ec)) return built;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return built;
  const fs::path beside = self.parent_path() / fs::path(built).filename();
  return fs::exists(beside, ec) ? beside.string() : std::string(built);
}

}  // namespace ferry::testutil
