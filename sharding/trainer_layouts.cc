#include "sharding/trainer_layouts.h"

#include <algorithm>
#include <string_view>

namespace ferry::sharding {
namespace {

// Shard(0) of `t` for rank `rank` of `ranks`, added to `out`. A 0-d tensor cannot be cut: rank 0
// holds it whole, the others nothing of it.
void add_shard(const SourceTensor& t, int rank, int ranks, SenderInfo& out) {
  Region box = Region::whole(t.shape);
  if (box.rank() == 0) {
    if (rank == 0) out.holds.push_back({t.name, box});
    return;
  }
  const auto [from, to] = shard_rows(t.shape[0], rank, ranks);
  box.offset[0] = from;
  box.size[0] = to - from;
  out.holds.push_back({t.name, box});
}

// A rank that holds nothing declares an empty box, so that it is not read as holding everything.
void mark_declared(const Manifest& manifest, SenderInfo& info) {
  if (!info.owns.empty() || !info.holds.empty()) return;
  for (const auto& t : manifest) {
    if (t.shape.empty()) continue;
    Region none = Region::whole(t.shape);
    none.size[0] = 0;
    info.holds.push_back({t.name, none});
    return;
  }
}

}  // namespace

std::pair<int64_t, int64_t> shard_rows(int64_t n, int rank, int ranks) {
  if (ranks <= 0 || rank < 0 || rank >= ranks) return {0, 0};
  const int64_t chunk = (n + ranks - 1) / ranks;
  return {std::min(n, chunk * rank), std::min(n, chunk * (rank + 1))};
}

SenderInfo fsdp_holdings(const Manifest& manifest, int rank, int ranks) {
  SenderInfo out;
  for (const auto& t : manifest) add_shard(t, rank, ranks, out);
  mark_declared(manifest, out);
  return out;
}

SenderInfo hsdp_holdings(const Manifest& manifest, int rank, int ranks, int shard_group) {
  const int group = std::clamp(shard_group, 1, std::max(ranks, 1));
  return fsdp_holdings(manifest, rank % group, group);
}

SenderInfo pipeline_holdings(const Manifest& manifest, int stage, int stages) {
  int64_t layers = 0;
  for (const auto& t : manifest) layers = std::max<int64_t>(layers, layer_index_of(t.name) + 1);
  const int64_t first = layers * stage / std::max(stages, 1);
  const int64_t last = layers * (stage + 1) / std::max(stages, 1);
  SenderInfo out;
  for (const auto& t : manifest) {
    const int layer = layer_index_of(t.name);
    const bool mine = layer >= 0 ? (layer >= first && layer < last)
                                 : (t.name.find("embed_tokens") != std::string::npos ? stage == 0 : stage == stages - 1);
    if (mine) out.owns.push_back(t.name);
  }
  mark_declared(manifest, out);
  return out;
}

int expert_index_of(const std::string& name) {
  constexpr std::string_view kKey = ".experts.";
  const size_t at = name.find(kKey);
  if (at == std::string::npos) return -1;
  size_t i = at + kKey.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  int v = 0;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) v = v * 10 + (name[i] - '0');
  return i < name.size() && name[i] == '.' ? v : -1;
}

int64_t stacked_experts_of(const SourceTensor& t) {
  const bool named = t.name.ends_with(".experts.gate_up_proj") || t.name.ends_with(".experts.down_proj");
  return named && t.shape.size() == 3 ? t.shape[0] : 0;
}

SenderInfo expert_holdings(const Manifest& manifest, int ep_rank, int ep_size) {
  int64_t experts = 0;
  for (const auto& t : manifest) {
    experts = std::max<int64_t>({experts, expert_index_of(t.name) + 1, stacked_experts_of(t)});
  }
  const int64_t ranks = std::max(ep_size, 1);
  const int64_t from = experts * ep_rank / ranks, to = experts * (ep_rank + 1) / ranks;
  SenderInfo out;
  for (const auto& t : manifest) {
    const int e = expert_index_of(t.name);
    if (experts > 0 && stacked_experts_of(t) == experts) {  // the experts, as per-expert tensors
      Region box = Region::whole(t.shape);
      box.offset[0] = from;
      box.size[0] = to - from;
      out.holds.push_back({t.name, box});
    } else if (e < 0) {
      add_shard(t, ep_rank, ep_size, out);
    } else if (e >= from && e < to) {
      out.owns.push_back(t.name);
    }
  }
  mark_declared(manifest, out);
  return out;
}

}  // namespace ferry::sharding
