#pragma once

namespace ferry {

inline constexpr const char* kVersion = "0.1.0";
// Bumped whenever a control-plane message changes incompatibly; checked on join.
inline constexpr int kProtocolVersion = 2;

}  // namespace ferry
