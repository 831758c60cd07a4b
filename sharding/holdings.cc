#include "sharding/holdings.h"

#include <algorithm>
#include <map>
#include <string_view>
#include <unordered_map>

#include <fmt/format.h>

#include "sharding/planner.h"

namespace ferry::sharding {
namespace {

std::string senders_text(const std::vector<int>& s) {
  if (s.empty()) return "every sender that declared no holdings";
  std::string out;
  for (int i : s) out += (out.empty() ? "" : ", ") + std::to_string(i);
  return (s.size() == 1 ? "sender " : "senders ") + out;
}

// Rows no box holds, when every box spans whole rows (the Shard(0) case): "rows [a, b)", else "".
std::string missing_rows(const Shape& shape, const std::vector<HeldBox>& boxes) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (const HeldBox& b : boxes) {
    for (size_t d = 1; d < shape.size(); ++d) {
      if (b.region.offset[d] != 0 || b.region.size[d] != shape[d]) return "";
    }
    rows.emplace_back(b.region.offset[0], b.region.offset[0] + b.region.size[0]);
  }
  std::sort(rows.begin(), rows.end());
  int64_t at = 0;
  for (const auto& [from, to] : rows) {
    if (from > at) return fmt::format("rows [{}, {})", at, from);
    at = std::max(at, to);
  }
  return at < shape[0] ? fmt::format("rows [{}, {})", at, shape[0]) : "";
}

// Checks that `boxes` (distinct, inside `t`) tile it: no two overlap, and their elements add up.
Status check_tiling(const SourceTensor& t, std::vector<HeldBox>& boxes) {
  std::sort(boxes.begin(), boxes.end(), [](const HeldBox& a, const HeldBox& b) {
    return a.region.offset < b.region.offset || (a.region.offset == b.region.offset && a.region.size < b.region.size);
  });
  const bool scalar = t.shape.empty();
  int64_t held = 0;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Region& a = boxes[i].region;
    held += a.numel();
    // Sorted by first offset: only boxes starting before `a` ends along dimension 0 can meet it.
    for (size_t j = i + 1; j < boxes.size(); ++j) {
      const Region& b = boxes[j].region;
      if (!scalar && b.offset[0] >= a.offset[0] + a.size[0]) break;
      if (scalar || a.overlaps(b)) {
        return Status::invalid_argument(fmt::format(
            "{}: {} holds {} and {} holds {}, which overlap without being the same box", t.name,
            senders_text(boxes[i].holders), a.to_string(), senders_text(boxes[j].holders), b.to_string()));
      }
    }
  }
  const int64_t total = shape_numel(t.shape);
  if (held != total) {
    const std::string rows = scalar ? "" : missing_rows(t.shape, boxes);
    return Status::invalid_argument(fmt::format("{}: the senders hold {} of its {} elements{}", t.name, held, total,
                                                rows.empty() ? "" : "; nothing holds " + rows));
  }
  return ok_status();
}

}  // namespace

std::optional<Region> intersect(const Region& a, const Region& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Region out;
  for (size_t d = 0; d < a.size.size(); ++d) {
    const int64_t from = std::max(a.offset[d], b.offset[d]);
    const int64_t to = std::min(a.offset[d] + a.size[d], b.offset[d] + b.size[d]);
    if (to <= from) return std::nullopt;
    out.offset.push_back(from);
    out.size.push_back(to - from);
  }
  return out;
}

Result<Holdings> resolve_holdings(const Manifest& manifest, const std::vector<SenderInfo>& senders) {
  if (senders.empty()) return Status::invalid_argument("a plan needs at least one sender");
  std::unordered_map<std::string_view, size_t> index;
  index.reserve(manifest.size());
  for (size_t i = 0; i < manifest.size(); ++i) index[manifest[i].name] = i;
  Holdings out;
  out.boxes.resize(manifest.size());
  // Each distinct (tensor, box), found by its bytes: 256 FSDP ranks declare 256 boxes of each of
  // tens of thousands of tensors, and a scan of a tensor's boxes per declaration is quadratic.
  std::unordered_map<std::string, size_t> seen;
  std::string key;
  auto add = [&](size_t t, const Region& r, int sender) {
    key.assign(reinterpret_cast<const char*>(&t), sizeof t);
    key.append(reinterpret_cast<const char*>(r.offset.data()), r.offset.size() * sizeof(int64_t));
    key.append(reinterpret_cast<const char*>(r.size.data()), r.size.size() * sizeof(int64_t));
    auto [it, fresh] = seen.try_emplace(key, out.boxes[t].size());
    if (fresh) {
      out.boxes[t].push_back(HeldBox{r, {sender}});
      return;
    }
    auto& holders = out.boxes[t][it->second].holders;
    if (holders.empty() || holders.back() != sender) holders.push_back(sender);
  };
  for (size_t s = 0; s < senders.size(); ++s) {
    const SenderInfo& info = senders[s];
    if (info.owns.empty() && info.holds.empty()) {
      out.everyone.push_back(static_cast<int>(s));
      continue;
    }
    for (const std::string& n : info.owns) {
      auto it = index.find(n);
      if (it == index.end()) return Status::invalid_argument(fmt::format("sender {} owns unknown tensor {}", s, n));
      add(it->second, Region::whole(manifest[it->second].shape), static_cast<int>(s));
    }
    for (const Holding& h : info.holds) {
      auto it = index.find(h.name);
      if (it == index.end()) return Status::invalid_argument(fmt::format("sender {} holds unknown tensor {}", s, h.name));
      const SourceTensor& t = manifest[it->second];
      if (!h.region.inside(t.shape)) {
        return Status::invalid_argument(fmt::format("{}: sender {} holds {}, outside its shape {}", t.name, s,
                                                    h.region.to_string(), shape_to_string(t.shape)));
      }
      if (h.region.numel() > 0) add(it->second, h.region, static_cast<int>(s));
    }
  }
  for (size_t t = 0; t < manifest.size(); ++t) {
    auto& boxes = out.boxes[t];
    if (!out.everyone.empty()) {
      // Senders holding everything hold each tensor whole: its whole box gains them (holders kept
      // ascending); a tensor no one else declared is that box alone (holders: everyone).
      const Region whole = Region::whole(manifest[t].shape);
      auto it = std::find_if(boxes.begin(), boxes.end(), [&](const HeldBox& b) { return b.region == whole; });
      if (it == boxes.end()) {
        boxes.push_back(HeldBox{whole, {}});
      } else {
        it->holders.insert(it->holders.end(), out.everyone.begin(), out.everyone.end());
        std::sort(it->holders.begin(), it->holders.end());
      }
    }
    if (boxes.empty()) return Status::invalid_argument(fmt::format("tensor {}: no sender holds it", manifest[t].name));
    FERRY_RETURN_IF_ERROR(check_tiling(manifest[t], boxes));
  }
  return out;
}

}  // namespace ferry::sharding
