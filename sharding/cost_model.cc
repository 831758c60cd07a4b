#include "sharding/cost_model.h"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "sharding/scheme_check.h"

namespace ferry::sharding {
namespace {

enum Link : int { kNicTx, kNicRx, kPcieTx, kPcieRx, kNvlTx, kNvlRx, kLinks };
constexpr std::array<const char*, kLinks> kLinkNames = {"nic_tx", "nic_rx", "pcie_tx", "pcie_rx", "nvlink_tx", "nvlink_rx"};

struct Use {
  uint64_t bytes = 0;
  uint64_t buckets = 0;
};

}  // namespace

Result<CostReport> estimate_cost(const Plan& plan, const std::vector<RankSpec>& ranks, int num_senders,
                                 const Topology& topo, const CostOptions& options) {
  if (num_senders <= 0) return Status::invalid_argument("cost model: needs at least one sender");
  if (topo.gpus_per_node <= 0 || topo.nvlink_gbps <= 0 || topo.pcie_gbps <= 0 || topo.nic_gbps <= 0) {
    return Status::invalid_argument("cost model: GPUs per node and link bandwidths must be positive");
  }
  const int64_t gpn = topo.gpus_per_node;
  const int64_t first_rollout = topo.colocated ? 0 : (num_senders + gpn - 1) / gpn * gpn;
  const int64_t gpus = std::max<int64_t>(num_senders, first_rollout + static_cast<int64_t>(ranks.size()));
  std::vector<std::array<Use, kLinks>> use(static_cast<size_t>(gpus));

  // Wire bytes of each piece: the source's, or the scheme's width when the sender quantizes.
  auto wire_bytes = [&](const Piece& pc) -> uint64_t {
    if (!options.quantize_on_sender) return pc.bytes;
    const ParamSpec& p = ranks[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)];
    const int src_bits = dtype_bits(p.source_dtype);
    return pc.bytes * static_cast<uint64_t>(scheme_weight_bits(p.scheme, p.source_dtype)) / static_cast<uint64_t>(src_bits);
  };

  CostReport rep;
  rep.pieces = plan.pieces.size();
  rep.buckets = plan.buckets.size();
  std::vector<uint64_t> sent(static_cast<size_t>(num_senders), 0), received(ranks.size(), 0);
  for (const Bucket& b : plan.buckets) {
    if (b.sender < 0 || b.sender >= num_senders || b.dst < 0 || static_cast<size_t>(b.dst) >= ranks.size()) {
      return Status::invalid_argument(fmt::format("cost model: bucket from sender {} to rank {} is outside the cluster", b.sender, b.dst));
    }
    uint64_t bytes = 0;
    for (int i : b.pieces) bytes += wire_bytes(plan.pieces[static_cast<size_t>(i)]);
    rep.bytes_moved += bytes;
    sent[static_cast<size_t>(b.sender)] += bytes;
    received[static_cast<size_t>(b.dst)] += bytes;
    const int64_t from = b.sender, to = first_rollout + b.dst;
    auto add = [&](int64_t gpu, Link l) {
      Use& u = use[static_cast<size_t>(gpu)][l];
      u.bytes += bytes;
      ++u.buckets;
    };
    if (from == to) continue;  // a copy on one GPU crosses no link
    if (from / gpn == to / gpn) {
      add(from, kNvlTx);
      add(to, kNvlRx);
    } else {
      add(from, kNicTx);
      add(from, kPcieTx);
      add(to, kNicRx);
      add(to, kPcieRx);
    }
  }

  auto gbps = [&](int l) {
    if (l == kNicTx || l == kNicRx) return topo.nic_gbps;
    if (l == kPcieTx || l == kPcieRx) return topo.pcie_gbps;
    return topo.nvlink_gbps;
  };
  std::vector<LinkLoad> loads;
  for (int64_t g = 0; g < gpus; ++g) {
    for (int l = 0; l < kLinks; ++l) {
      const Use& u = use[static_cast<size_t>(g)][l];
      if (u.buckets == 0) continue;
      const double s = static_cast<double>(u.bytes) * 8.0 / (gbps(l) * 1e9) + static_cast<double>(u.buckets) * topo.seconds_per_bucket;
      const std::string role = g >= first_rollout && g - first_rollout < static_cast<int64_t>(ranks.size())
                                   ? fmt::format("rollout rank {}", g - first_rollout)
                                   : fmt::format("trainer {}", g);
      loads.push_back({fmt::format("{} gpu {} ({})", kLinkNames[static_cast<size_t>(l)], g, role), u.bytes, u.buckets, s});
      rep.max_link_bytes = std::max(rep.max_link_bytes, u.bytes);
    }
  }
  std::stable_sort(loads.begin(), loads.end(), [](const LinkLoad& a, const LinkLoad& b) { return a.seconds > b.seconds; });
  if (!loads.empty()) rep.predicted_seconds = loads.front().seconds;
  loads.resize(std::min<size_t>(loads.size(), 5));
  rep.busiest = std::move(loads);
  for (uint64_t s : sent) {
    rep.max_sender_bytes = std::max(rep.max_sender_bytes, s);
    rep.senders_used += s > 0;
  }
  for (uint64_t r : received) rep.max_receiver_bytes = std::max(rep.max_receiver_bytes, r);
  // Apart, every byte enters a rollout GPU through its NIC and PCIe; colocated, NVLink may carry it.
  const double nic_path = std::min(topo.nic_gbps, topo.pcie_gbps);
  const double best_in = topo.colocated ? std::max(nic_path, topo.nvlink_gbps) : nic_path;
  rep.receiver_bound_seconds = static_cast<double>(rep.max_receiver_bytes) * 8.0 / (best_in * 1e9);
  return rep;
}

}  // namespace ferry::sharding
