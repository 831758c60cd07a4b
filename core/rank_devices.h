// Where a replica's ranks keep their storage, as tools and examples take it on the command line.
#pragma once

#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

// The devices of a replica's `ranks` ranks: one device for all ("cuda:1") or one per rank
// ("cuda:1,cuda:2"); InvalidArgument naming `text` for any other count or a bad entry.
Result<std::vector<Device>> parse_rank_devices(std::string_view text, int ranks);

}  // namespace ferry
