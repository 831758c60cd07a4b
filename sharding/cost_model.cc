#include "sharding/cost_model.h"

#include <algorithm>
#include <array>
#include <unordered_map>

#include <fmt/format.h>

#include "core/scheme.h"

namespace ferry::sharding {
namespace {

enum Link : int { kNicTx, kNicRx, kPcieTx, kPcieRx, kNvlTx, kNvlRx, kHostTx, kHostRx, kLinks };
constexpr std::array<const char*, kLinks> kLinkNames = {"nic_tx",    "nic_rx",    "pcie_tx", "pcie_rx",
                                                        "nvlink_tx", "nvlink_rx", "host_tx", "host_rx"};

struct Use {
  uint64_t bytes = 0;
  uint64_t buckets = 0;
};

// A resource of the pipeline (a sender's packer, a link, a rank's processor) and the buckets it
// handles: when the first can reach it at the earliest, how long it works, and what is left of its
// last bucket after it.
struct Chain {
  double first = -1;      // earliest arrival of any of its buckets (-1: none yet)
  double busy = 0;
  double last_arrival = -1;
  double drain = 0;       // later stages of the bucket that arrives last
  void add(double arrival, double work, double after) {
    first = first < 0 ? arrival : std::min(first, arrival);
    busy += work;
    if (arrival >= last_arrival) {
      last_arrival = arrival;
      drain = after;
    }
  }
  double seconds() const { return first < 0 ? 0 : first + busy + drain; }
};

}  // namespace

Result<CostReport> estimate_cost(const Plan& plan, const std::vector<RankSpec>& ranks, int num_senders,
                                 const Topology& topo, const CostOptions& options) {
  if (num_senders <= 0) return Status::invalid_argument("cost model: needs at least one sender");
  if (topo.gpus_per_node <= 0 || topo.nvlink_gbps <= 0 || topo.pcie_gbps <= 0 || topo.nic_gbps <= 0) {
    return Status::invalid_argument("cost model: GPUs per node and link bandwidths must be positive");
  }
  const bool one_host = topo.placement == Placement::kOneHost;
  if (one_host && topo.host_gbps <= 0) {
    return Status::invalid_argument("cost model: one host needs the host transport's bandwidth");
  }
  const Stages& st = options.stages;
  if (st.pack_bytes_per_second < 0 || st.process_bytes_per_second < 0 || st.round_trip_seconds < 0) {
    return Status::invalid_argument("cost model: stage rates and the round trip cannot be negative");
  }
  const int64_t gpn = topo.gpus_per_node;
  // One host: senders are processes 0..S-1 and ranks S..S+R-1.
  const int64_t first_rollout = one_host ? num_senders : topo.colocated ? 0 : (num_senders + gpn - 1) / gpn * gpn;
  const bool placed = !one_host && !topo.rank_gpus.empty();
  if (placed && topo.rank_gpus.size() != ranks.size()) {
    return Status::invalid_argument(fmt::format("cost model: {} rank GPUs given for {} ranks", topo.rank_gpus.size(), ranks.size()));
  }
  auto gpu_of_rank = [&](int64_t d) { return placed ? topo.rank_gpus[static_cast<size_t>(d)] : first_rollout + d; };
  int64_t gpus = std::max<int64_t>(num_senders, first_rollout + static_cast<int64_t>(ranks.size()));
  for (int64_t g : topo.rank_gpus) {
    if (placed && (g < 0 || g >= (int64_t{1} << 20))) return Status::invalid_argument(fmt::format("cost model: rank GPU {}", g));
    if (placed) gpus = std::max(gpus, g + 1);
  }
  // Who uses GPU (or process) g, for the names of its links.
  auto role_of = [&](int64_t g) {
    std::string ranks_here;
    for (int64_t d = 0; d < static_cast<int64_t>(ranks.size()); ++d) {
      if (gpu_of_rank(d) == g) ranks_here += (ranks_here.empty() ? "" : ",") + std::to_string(d);
    }
    if (ranks_here.empty()) return fmt::format("trainer {}", g);
    return fmt::format("rollout rank{} {}", ranks_here.find(',') == std::string::npos ? "" : "s", ranks_here);
  };
  std::vector<std::array<Use, kLinks>> use(static_cast<size_t>(gpus));

  // Wire bytes of each piece: the source's, or the scheme's width when the sender quantizes.
  auto wire_bytes = [&](const Piece& pc) -> uint64_t {
    if (!options.quantize_on_sender) return pc.bytes;
    const ParamSpec& p = ranks[static_cast<size_t>(pc.dst)].params[static_cast<size_t>(pc.param)];
    const int src_bits = dtype_bits(p.source_dtype);
    return pc.bytes * static_cast<uint64_t>(scheme_weight_bits(p.scheme, p.source_dtype)) / static_cast<uint64_t>(src_bits);
  };

  // A part's share of its piece's wire bytes.
  auto part_wire_bytes = [&](const BucketPart& part) -> uint64_t {
    const Piece& pc = plan.pieces[static_cast<size_t>(part.piece)];
    if (pc.bytes == 0) return 0;
    return static_cast<uint64_t>(static_cast<double>(wire_bytes(pc)) * static_cast<double>(part.bytes) / static_cast<double>(pc.bytes));
  };

  CostReport rep;
  rep.pieces = plan.pieces.size();
  rep.buckets = plan.buckets.size();
  std::vector<uint64_t> sent(static_cast<size_t>(num_senders), 0), received(ranks.size(), 0);
  std::vector<uint64_t> bucket_bytes(plan.buckets.size(), 0);
  std::vector<std::vector<Link>> paths(plan.buckets.size());   // the links each bucket crosses
  std::vector<std::vector<int64_t>> path_ends(plan.buckets.size());  // and whose (GPU or process)
  for (size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const Bucket& b = plan.buckets[bi];
    if (b.sender < 0 || b.sender >= num_senders || b.dst < 0 || static_cast<size_t>(b.dst) >= ranks.size()) {
      return Status::invalid_argument(fmt::format("cost model: bucket from sender {} to rank {} is outside the cluster", b.sender, b.dst));
    }
    uint64_t bytes = 0;
    for (const BucketPart& part : b.parts) bytes += part_wire_bytes(part);
    bucket_bytes[bi] = bytes;
    rep.bytes_moved += bytes;
    sent[static_cast<size_t>(b.sender)] += bytes;
    received[static_cast<size_t>(b.dst)] += bytes;
    const int64_t from = b.sender, to = gpu_of_rank(b.dst);
    auto add = [&](int64_t gpu, Link l) {
      Use& u = use[static_cast<size_t>(gpu)][l];
      u.bytes += bytes;
      ++u.buckets;
      paths[bi].push_back(l);
      path_ends[bi].push_back(gpu);
    };
    if (one_host) {
      add(from, kHostTx);
      add(to, kHostRx);
    } else if (from == to) {
      continue;  // a copy on one GPU crosses no link
    } else if (from / gpn == to / gpn) {
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
    if (l == kHostTx || l == kHostRx) return topo.host_gbps;
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
      const std::string role = role_of(g);
      const std::string name = one_host ? fmt::format("{} ({})", kLinkNames[static_cast<size_t>(l)], role)
                                        : fmt::format("{} gpu {} ({})", kLinkNames[static_cast<size_t>(l)], g, role);
      loads.push_back({name, u.bytes, u.buckets, s});
      rep.max_link_bytes = std::max(rep.max_link_bytes, u.bytes);
    }
  }
  std::stable_sort(loads.begin(), loads.end(), [](const LinkLoad& a, const LinkLoad& b) { return a.seconds > b.seconds; });
  const std::string busiest_link = loads.empty() ? std::string() : loads.front().link;
  loads.resize(std::min<size_t>(loads.size(), 5));
  rep.busiest = std::move(loads);

  // The pipeline. A sender packs its pieces one after another in plan order; a bucket leaves when
  // it is full (sharding/buckets.h) or, for the pair's last bucket, when the sender has packed
  // everything. It then crosses its links together (paced
  // by the slowest) and is processed by its rank. Every resource works on one bucket at a time;
  // the update's pipeline lasts as long as the longest chain: a resource's first arrival, its own
  // work, and its last bucket's later stages.
  const double pack_rate = st.pack_bytes_per_second, proc_rate = st.process_bytes_per_second;
  std::vector<double> ready(plan.buckets.size(), 0.0);
  {
    // Bytes each sender has packed before each piece, in plan order.
    std::vector<uint64_t> packed(static_cast<size_t>(num_senders), 0);
    std::vector<double> before(plan.pieces.size(), 0.0);
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      const Piece& pc = plan.pieces[i];
      if (pc.sender < 0 || pc.sender >= num_senders) continue;
      before[i] = static_cast<double>(packed[static_cast<size_t>(pc.sender)]);
      packed[static_cast<size_t>(pc.sender)] += wire_bytes(pc);
    }
    // Where the sender is (wire bytes packed) when it starts a part.
    auto start_of = [&](const BucketPart& part) {
      const Piece& pc = plan.pieces[static_cast<size_t>(part.piece)];
      if (pc.bytes == 0 || part.first_row == 0) return before[static_cast<size_t>(part.piece)];
      const uint64_t offset = static_cast<uint64_t>(part.first_row) * piece_rows(pc.src.size, pc.bytes).row_bytes;
      return before[static_cast<size_t>(part.piece)] +
             static_cast<double>(wire_bytes(pc)) * static_cast<double>(offset) / static_cast<double>(pc.bytes);
    };
    // A bucket leaves when it is full (BucketCutter): as its last part is packed, or when the next
    // piece of its stream does not fit, or when the sender is done (its stream's last bucket).
    std::unordered_map<uint64_t, int> next_of_pair;  // pair -> the later bucket seen so far
    for (size_t k = plan.buckets.size(); k-- > 0;) {
      const Bucket& b = plan.buckets[k];
      const uint64_t key = uint64_t{static_cast<uint32_t>(b.sender)} << 32 | static_cast<uint32_t>(b.dst);
      auto it = next_of_pair.find(key);
      double at = static_cast<double>(packed[static_cast<size_t>(b.sender)]);
      const bool full = b.bytes >= plan.bucket_bytes || b.parts.size() >= kMaxPiecesPerBucket;
      if (full && !b.parts.empty()) {
        at = start_of(b.parts.back()) + static_cast<double>(part_wire_bytes(b.parts.back()));
      } else if (it != next_of_pair.end()) {
        const auto& nb = plan.buckets[static_cast<size_t>(it->second)];
        if (!nb.parts.empty()) at = start_of(nb.parts.front());
      }
      ready[k] = pack_rate > 0 ? at / pack_rate : 0.0;
      next_of_pair[key] = static_cast<int>(k);
    }
    for (uint64_t p : packed) {
      rep.pack_seconds = std::max(rep.pack_seconds, pack_rate > 0 ? static_cast<double>(p) / pack_rate : 0.0);
    }
  }
  // A sender's chain is the latest of its buckets to be done on its own: packed (with everything
  // before it), across its links, processed.
  std::vector<double> packer_chain(static_cast<size_t>(num_senders), 0.0);
  std::vector<Chain> processors(ranks.size());
  std::vector<Chain> link_chains(static_cast<size_t>(gpus) * kLinks);  // GPU (or process) * kLinks + link
  for (size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const Bucket& b = plan.buckets[bi];
    const double bytes = static_cast<double>(bucket_bytes[bi]);
    double wire = 0;
    if (!paths[bi].empty()) {
      double slowest = gbps(paths[bi].front());
      for (Link l : paths[bi]) slowest = std::min(slowest, gbps(l));
      wire = bytes * 8.0 / (slowest * 1e9) + topo.seconds_per_bucket;
    }
    const double proc = proc_rate > 0 ? bytes / proc_rate : 0.0;
    double& pc = packer_chain[static_cast<size_t>(b.sender)];
    pc = std::max(pc, ready[bi] + wire + proc);
    for (size_t k = 0; k < paths[bi].size(); ++k) {
      // A link's own time counts every byte at its own bandwidth, as the busiest-link bound does.
      const double own = bytes * 8.0 / (gbps(paths[bi][k]) * 1e9) + topo.seconds_per_bucket;
      link_chains[static_cast<size_t>(path_ends[bi][k]) * kLinks + paths[bi][k]].add(ready[bi], own, proc);
    }
    processors[static_cast<size_t>(b.dst)].add(ready[bi] + wire, proc, 0.0);
  }
  auto consider = [&](const Chain& c, const std::string& name) {
    if (c.first < 0 || c.seconds() <= rep.pipeline_seconds) return;
    rep.pipeline_seconds = c.seconds();
    rep.critical = name;
    rep.fill_seconds = c.first;
    rep.busy_seconds = c.busy;
    rep.drain_seconds = c.drain;
  };
  // Links first: with the stages left out, the pipeline is exactly the busiest link.
  for (size_t i = 0; i < link_chains.size(); ++i) {
    Chain& c = link_chains[i];
    if (c.first < 0) continue;  // no bucket crosses this link
    const auto g = static_cast<int64_t>(i / kLinks);
    const auto l = static_cast<size_t>(i % kLinks);
    // The same sum as the link's load above, so that without stages the two agree to the bit.
    const Use& u = use[static_cast<size_t>(g)][l];
    c.busy = static_cast<double>(u.bytes) * 8.0 / (gbps(static_cast<int>(l)) * 1e9) +
             static_cast<double>(u.buckets) * topo.seconds_per_bucket;
    if (c.seconds() <= rep.pipeline_seconds) continue;  // consider() keeps the earlier one; no name needed
    const std::string role = role_of(g);
    consider(c, one_host ? fmt::format("{} ({})", kLinkNames[l], role) : fmt::format("{} gpu {} ({})", kLinkNames[l], g, role));
  }
  if (rep.critical.empty()) rep.critical = busiest_link;
  for (size_t s = 0; s < packer_chain.size(); ++s) {
    if (pack_rate <= 0 || packer_chain[s] <= rep.pipeline_seconds) continue;
    const double busy = static_cast<double>(sent[s]) / pack_rate;
    rep.pipeline_seconds = packer_chain[s];
    rep.critical = fmt::format("pack trainer {}", s);
    rep.fill_seconds = 0;
    rep.busy_seconds = busy;
    rep.drain_seconds = packer_chain[s] - busy;
  }
  for (size_t d = 0; d < processors.size(); ++d) {
    consider(processors[d], fmt::format("process rollout rank {}", d));
    rep.process_seconds = std::max(rep.process_seconds, processors[d].busy);
  }
  // One host: every stage is work for the same cores and memory, and each rate was measured with
  // the host to itself, so the pipeline lasts at least all of its work over the number of stages
  // the host does at once (measured; below 1 taken as 1). Sender processes pack side by side (each its
  // own share, on a core of its own), so packing counts once, as the busiest sender's.
  if (one_host) {
    double host = rep.pack_seconds;
    for (size_t i = kHostTx; i < link_chains.size(); i += kLinks) host += link_chains[i].busy;
    for (const auto& c : processors) host += c.busy;
    rep.host_seconds = host;
    const double parallelism = std::max(1.0, topo.host_parallelism);
    if (host / parallelism > rep.pipeline_seconds) {
      rep.pipeline_seconds = host / parallelism;
      rep.critical = parallelism > 1 ? fmt::format("host ({:.2f} stages at a time)", parallelism)
                                     : "host (every stage, one at a time)";
      rep.fill_seconds = 0;
      rep.busy_seconds = rep.pipeline_seconds;
      rep.drain_seconds = 0;
    }
  }
  rep.control_seconds = kControlRoundTrips * st.round_trip_seconds;
  rep.predicted_seconds = rep.control_seconds + rep.pipeline_seconds;
  for (uint64_t s : sent) {
    rep.max_sender_bytes = std::max(rep.max_sender_bytes, s);
    rep.senders_used += s > 0;
  }
  for (uint64_t r : received) rep.max_receiver_bytes = std::max(rep.max_receiver_bytes, r);
  // Apart, every byte enters a rollout GPU through its NIC and PCIe; colocated, NVLink may carry it;
  // on one host, the host transport.
  const double nic_path = std::min(topo.nic_gbps, topo.pcie_gbps);
  const double best_in =
      one_host ? topo.host_gbps : topo.colocated || placed ? std::max(nic_path, topo.nvlink_gbps) : nic_path;
  rep.receiver_bound_seconds = static_cast<double>(rep.max_receiver_bytes) * 8.0 / (best_in * 1e9);
  return rep;
}

Result<LinkFit> fit_link(double big_bytes, double big_buckets, double big_seconds, double small_bytes,
                         double small_buckets, double small_seconds) {
  if (!(big_buckets > 0 && small_buckets > 0 && big_seconds > 0 && small_seconds > 0)) {
    return Status::invalid_argument("fit_link: every run needs buckets and a positive time");
  }
  // Scale the small run to the large run's bucket count; what remains is bytes at the link's rate.
  const double k = big_buckets / small_buckets;
  const double per_byte = (big_seconds - small_seconds * k) / (big_bytes - small_bytes * k);
  const double fixed = (small_seconds - small_bytes * per_byte) / small_buckets;
  if (!(per_byte > 0 && fixed >= 0)) {
    return Status::unavailable(fmt::format("fit_link: noise left {} s per byte and {} s per bucket", per_byte, fixed));
  }
  return LinkFit{1.0 / per_byte, fixed};
}

}  // namespace ferry::sharding
