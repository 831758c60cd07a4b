#pragma once

namespace ferry {

// The one place the version is written: CMakeLists.txt (project VERSION, the CMake package's
// version file, ferry.pc) and pyproject.toml (the wheel's) read it from this line.
inline constexpr const char* kVersion = "0.1.0";
// Bumped whenever a control-plane message changes incompatibly; checked on join.
inline constexpr int kProtocolVersion = 3;  // 3: delta pieces may carry kDeltaXor / kDeltaZstd

}  // namespace ferry
