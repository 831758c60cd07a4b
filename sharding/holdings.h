// What each trainer rank holds of the manifest, and which holder sends each part of a tensor.
// A sharded trainer (FSDP2's Shard(0) rows, Megatron's TP columns, pipeline stages) declares, per
// tensor it holds, the box of the global tensor in its memory; a whole tensor is the box of its
// shape. The boxes of all senders must tile every manifest tensor exactly: a gap, or two boxes that
// overlap without being the same box, fails before anything moves. Identical boxes (HSDP,
// Replicate()) are copies: any one holder sends each part of them, balanced by the planner.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

struct Holding {
  std::string name;  // manifest tensor
  Region region;     // the box of the global tensor held
  bool operator==(const Holding&) const = default;
};

// One distinct box of a tensor and the senders holding it.
struct HeldBox {
  Region region;
  std::vector<int> holders;  // sender indices, ascending; empty: Holdings::everyone alone
};

struct Holdings {
  std::vector<std::vector<HeldBox>> boxes;  // per manifest tensor, tiling it
  std::vector<int> everyone;                // senders that declared nothing: they hold every tensor whole
  const std::vector<int>& holders(size_t tensor, size_t box) const {
    const auto& h = boxes[tensor][box].holders;
    return h.empty() ? everyone : h;
  }
};

struct SenderInfo;

// Per manifest tensor, its distinct boxes (tiling it exactly), from every sender's `owns` (whole
// tensors), `holds` (boxes) or neither (every tensor whole). Errors name the tensor, the boxes and
// the senders: an unknown name, a box outside the tensor, a gap, a conflicting overlap.
Result<Holdings> resolve_holdings(const Manifest& manifest, const std::vector<SenderInfo>& senders);

// The part of `a` inside `b`; nullopt when they share no element.
std::optional<Region> intersect(const Region& a, const Region& b);

}  // namespace ferry::sharding
