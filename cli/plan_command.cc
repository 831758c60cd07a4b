#include "cli/plan_command.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/scheme.h"
#include "core/settings.h"
#include "sharding/cost_model.h"
#include "sharding/layout.h"
#include "sharding/model_config.h"
#include "sharding/planner.h"
#include "sharding/presets.h"
#include "sharding/source_layout.h"
#include "sharding/trainer_layouts.h"

namespace ferry::cli {
namespace {

using sharding::CostReport;

struct PlanArgs {
  std::string model;
  std::string config;
  int trainers = 8;
  std::string layout = "whole";
  std::string experts = "per-expert";
  int shard_group = 0;  // hsdp: ranks per shard group (0: GPUs per node)
  bool per_sender = false;
  int replicas = 1;
  int tp = 1;
  int ep = 1;
  std::string scheme = "fp8_block";
  std::string bucket_bytes;
  sharding::Topology topo;
  bool quantize_on_sender = false;
  bool json = false;
};

struct Side {
  CostReport cost;
  double planning_seconds = 0;
  std::vector<uint64_t> bytes_per_sender;  // the plan's payload per sender, in the source dtype
  uint64_t min_sender_bytes = 0;           // of bytes_per_sender
  uint64_t max_sender_bytes = 0;
};

std::string gb(uint64_t bytes) { return fmt::format("{:.2f} GB", static_cast<double>(bytes) / 1e9); }

Result<Side> plan_and_cost(const sharding::Manifest& manifest, const std::vector<sharding::RankSpec>& ranks,
                           const std::vector<sharding::SenderInfo>& senders, const sharding::PlanOptions& opts,
                           const PlanArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  FERRY_ASSIGN_OR_RETURN(sharding::Plan plan, sharding::make_plan(manifest, ranks, senders, opts));
  Side side;
  side.planning_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  FERRY_ASSIGN_OR_RETURN(side.cost, sharding::estimate_cost(plan, ranks, static_cast<int>(senders.size()), a.topo,
                                                            {a.quantize_on_sender}));
  side.bytes_per_sender = plan.bytes_per_sender;
  if (!plan.bytes_per_sender.empty()) {
    const auto [lo, hi] = std::minmax_element(plan.bytes_per_sender.begin(), plan.bytes_per_sender.end());
    side.min_sender_bytes = *lo;
    side.max_sender_bytes = *hi;
  }
  return side;
}

// Megatron-Core's parallel sizes in a layout name.
struct MegatronSizes {
  int tp = 1, pp = 1, ep = 1;
  int etp = 0;  // 0: the TP size, as Megatron-Core's expert_tensor_parallel_size defaults
};

// `megatron-tpT[-ppP][-epE][-etpX]` (each from 1 to 9999; PP and EP 1 and expert TP T when
// absent); nullopt for another layout name.
std::optional<MegatronSizes> megatron_sizes(std::string_view layout) {
  // A positive number of up to four digits at the front of `s`, which it consumes.
  auto number = [](std::string_view& s) -> std::optional<int> {
    size_t n = 0;
    while (n < s.size() && n < 5 && s[n] >= '0' && s[n] <= '9') ++n;
    if (n == 0 || n > 4 || s[0] == '0') return std::nullopt;
    int v = 0;
    for (size_t i = 0; i < n; ++i) v = v * 10 + (s[i] - '0');
    s.remove_prefix(n);
    return v;
  };
  // "-KEYn" at the front of `s`, when there: n, which it consumes.
  auto part = [&number](std::string_view& s, std::string_view key, int* out) {
    if (!s.starts_with(key)) return true;
    s.remove_prefix(key.size());
    const auto v = number(s);
    if (v) *out = *v;
    return v.has_value();
  };
  if (!layout.starts_with("megatron")) return std::nullopt;
  layout.remove_prefix(std::string_view("megatron").size());
  MegatronSizes m;
  if (!layout.starts_with("-tp") || !part(layout, "-tp", &m.tp) || !part(layout, "-pp", &m.pp) ||
      !part(layout, "-ep", &m.ep)) {
    return std::nullopt;
  }
  if (!part(layout, "-etp", &m.etp) || !layout.empty()) return std::nullopt;
  return m;
}

// Megatron-Core's trainer: the N ranks in Megatron's default order "tp-cp-ep-dp-pp" (TP innermost,
// then data parallel, pipeline stages outermost; experts: expert TP innermost, then EP; no context
// parallelism here), each holding its TP shard of its stage's layers and its experts in Megatron's
// fused tensors (sharding::megatron_layout); the data-parallel groups hold copies.
Result<std::vector<sharding::SenderInfo>> megatron_senders(const PlanArgs& a, const MegatronSizes& m) {
  sharding::ModelConfig cfg;
  if (!a.model.empty()) {
    FERRY_ASSIGN_OR_RETURN(const std::string text, sharding::preset_text(a.model));
    FERRY_ASSIGN_OR_RETURN(cfg, sharding::parse_hf_config(text));
  } else {
    auto loaded = sharding::load_hf_config(a.config);
    if (!loaded.ok()) {
      return loaded.status().with_context(fmt::format("--layout {} needs the model's config.json", a.layout));
    }
    cfg = *loaded;
  }
  std::vector<sharding::SenderInfo> out;
  for (int r = 0; r < a.trainers; ++r) {
    auto layout = sharding::megatron_rank_layout(cfg, r, a.trainers, m.tp, m.pp, m.ep, m.etp);
    if (!layout.ok()) return layout.status().with_context(fmt::format("--layout {}", a.layout));
    out.push_back(sharding::layout_holdings(*layout));
  }
  return out;
}

// The N trainer ranks' holdings under `--layout` (sharding/trainer_layouts.h); `whole`: every rank
// holds every tensor whole (after its own gather), and the plan balances them freely.
Result<std::vector<sharding::SenderInfo>> layout_senders(const PlanArgs& a, const sharding::Manifest& manifest) {
  const int n = a.trainers;
  std::vector<sharding::SenderInfo> out(static_cast<size_t>(n));
  if (a.layout == "whole") return out;
  if (const auto sizes = megatron_sizes(a.layout)) return megatron_senders(a, *sizes);
  const int group = a.shard_group > 0 ? a.shard_group : std::min(a.topo.gpus_per_node, n);
  if (a.layout == "hsdp" && (group <= 0 || n % group != 0)) {
    return Status::invalid_argument(fmt::format("--layout hsdp: {} trainers are not groups of {}", n, group));
  }
  if (a.layout == "ep" && std::none_of(manifest.begin(), manifest.end(), [](const auto& t) {
        return sharding::expert_index_of(t.name) >= 0 || sharding::stacked_experts_of(t) > 0;
      })) {
    return Status::invalid_argument("--layout ep: the model has no routed experts");
  }
  for (int r = 0; r < n; ++r) {
    auto& s = out[static_cast<size_t>(r)];
    if (a.layout == "fsdp") {
      s = sharding::fsdp_holdings(manifest, r, n);
    } else if (a.layout == "hsdp") {
      s = sharding::hsdp_holdings(manifest, r, n, group);
    } else if (a.layout == "pipeline") {
      s = sharding::pipeline_holdings(manifest, r, n);
    } else if (a.layout == "ep") {
      s = sharding::expert_holdings(manifest, r, n);
    } else {
      return Status::invalid_argument(fmt::format(
          "unknown --layout {}: whole, fsdp, hsdp, pipeline, ep or megatron-tpT[-ppP][-epE][-etpX]", a.layout));
    }
  }
  return out;
}

// Gathering every tensor onto trainer rank 0 before it sends alone: the bytes rank 0 does not hold
// come in over NVLink from its node and over its NIC (through PCIe) from the others, both at once;
// each part from the nearest of its holders.
struct Gather {
  uint64_t nvlink_bytes = 0;
  uint64_t nic_bytes = 0;
  double seconds = 0;
};

Result<Gather> gather_to_rank0(const sharding::Manifest& manifest, const std::vector<sharding::SenderInfo>& senders,
                               const sharding::Topology& topo) {
  FERRY_ASSIGN_OR_RETURN(const sharding::Holdings held, sharding::resolve_holdings(manifest, senders));
  Gather g;
  for (size_t t = 0; t < manifest.size(); ++t) {
    for (size_t b = 0; b < held.boxes[t].size(); ++b) {
      const auto& holders = held.holders(t, b);
      if (holders.empty() || holders.front() == 0) continue;  // ascending: rank 0 holds it
      const uint64_t bytes = dtype_bytes(manifest[t].dtype, held.boxes[t][b].region.numel());
      (holders.front() < topo.gpus_per_node ? g.nvlink_bytes : g.nic_bytes) += bytes;
    }
  }
  const double nic = std::min(topo.nic_gbps, topo.pcie_gbps) * 1e9 / 8;
  g.seconds = std::max(static_cast<double>(g.nvlink_bytes) / (topo.nvlink_gbps * 1e9 / 8),
                       static_cast<double>(g.nic_bytes) / nic);
  return g;
}

nlohmann::json side_json(const Side& s) {
  nlohmann::json j;
  j["predicted_seconds"] = s.cost.predicted_seconds;
  j["bytes_moved"] = s.cost.bytes_moved;
  j["max_link_bytes"] = s.cost.max_link_bytes;
  j["max_sender_bytes"] = s.cost.max_sender_bytes;
  j["max_receiver_bytes"] = s.cost.max_receiver_bytes;
  j["senders_used"] = s.cost.senders_used;
  j["pieces"] = s.cost.pieces;
  j["buckets"] = s.cost.buckets;
  j["receiver_bound_seconds"] = s.cost.receiver_bound_seconds;
  j["planning_seconds"] = s.planning_seconds;
  j["bottleneck"] = s.cost.busiest.empty() ? std::string() : s.cost.busiest.front().link;
  return j;
}

Status run_plan(const PlanArgs& a, std::ostream& out) {
  if (a.model.empty() == a.config.empty()) return Status::invalid_argument("give one of --model PRESET or --config FILE");
  sharding::ModelDesc model;
  if (!a.model.empty()) {
    FERRY_ASSIGN_OR_RETURN(model, sharding::preset_model(a.model));
  } else {
    FERRY_ASSIGN_OR_RETURN(model, sharding::model_from_file(a.config));
  }
  if (a.experts == "stacked") FERRY_RETURN_IF_ERROR(sharding::stack_experts(model));
  sharding::PlanOptions opts;
  SettingOverrides flags;
  if (!a.bucket_bytes.empty()) flags["bucket_bytes"] = a.bucket_bytes;  // --bucket-bytes beats FERRY_BUCKET_BYTES
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings(flags));
  opts.bucket_bytes = settings.bucket_bytes;
  if (a.trainers <= 0) return Status::invalid_argument("--trainers must be positive");
  FERRY_ASSIGN_OR_RETURN(const Scheme scheme, parse_scheme(a.scheme));
  FERRY_ASSIGN_OR_RETURN(auto ranks, sharding::model_rank_specs(model, a.replicas, a.tp, a.ep, scheme));
  const sharding::Manifest manifest = sharding::model_manifest(model);
  int64_t params = 0;
  uint64_t model_bytes = 0;
  for (const auto& t : manifest) {
    params += shape_numel(t.shape);
    model_bytes += dtype_bytes(t.dtype, shape_numel(t.shape));
  }

  // The one-sender plan: rank 0 sends everything (after a gather, unless the layout is `whole`,
  // where every rank holds full tensors already).
  FERRY_ASSIGN_OR_RETURN(Side bcast, plan_and_cost(manifest, ranks, std::vector<sharding::SenderInfo>(1), opts, a));
  FERRY_ASSIGN_OR_RETURN(const auto senders, layout_senders(a, manifest));
  FERRY_ASSIGN_OR_RETURN(Side bal, plan_and_cost(manifest, ranks, senders, opts, a));
  const bool whole = a.layout == "whole";
  Gather gather;
  if (!whole) {
    FERRY_ASSIGN_OR_RETURN(gather, gather_to_rank0(manifest, senders, a.topo));
  }
  const double ideal = static_cast<double>(bal.cost.bytes_moved) / a.trainers;
  const double imbalance = ideal > 0 ? static_cast<double>(bal.cost.max_sender_bytes) / ideal - 1.0 : 0.0;
  const double gather_then_send = bcast.cost.predicted_seconds + gather.seconds;

  if (a.json) {
    nlohmann::json j = side_json(bal);
    j["model"] = model.name;
    j["parameters"] = params;
    j["model_bytes"] = model_bytes;
    j["tensors"] = manifest.size();
    j["trainers"] = a.trainers;
    j["layout"] = a.layout;
    j["replicas"] = a.replicas;
    j["tp"] = a.tp;
    j["ep"] = a.ep;
    j["rollout_gpus"] = ranks.size();
    j["scheme"] = a.scheme;
    j["quantize_on_sender"] = a.quantize_on_sender;
    j["bucket_bytes"] = opts.bucket_bytes;
    j["sender_imbalance"] = imbalance;
    // The plan's payload per sender in the source dtype (max_sender_bytes above is on the wire).
    j["bytes_per_sender"] = bal.bytes_per_sender;
    j["sender_payload"] = {{"min", bal.min_sender_bytes}, {"max", bal.max_sender_bytes}};
    j["broadcast"] = side_json(bcast);
    j["speedup_over_broadcast"] = bal.cost.predicted_seconds > 0 ? bcast.cost.predicted_seconds / bal.cost.predicted_seconds : 0.0;
    if (!whole) {
      j["gather"] = {{"seconds", gather.seconds}, {"nvlink_bytes", gather.nvlink_bytes}, {"nic_bytes", gather.nic_bytes}};
      j["gather_then_send_seconds"] = gather_then_send;
      j["speedup_over_gather_then_send"] = bal.cost.predicted_seconds > 0 ? gather_then_send / bal.cost.predicted_seconds : 0.0;
    }
    out << j.dump() << "\n";
    return ok_status();
  }
  out << fmt::format("model {}: {:.3g} parameters in {} tensors\n", model.name, static_cast<double>(params), manifest.size());
  out << fmt::format("rollouts: {} replica(s) x TP {} (EP {}) = {} GPUs, scheme {}; trainers: {} GPUs{}\n", a.replicas, a.tp,
                     a.ep, ranks.size(), a.scheme, a.trainers, whole ? "" : ", layout " + a.layout);
  out << fmt::format("links per GPU: NVLink {} Gb/s, PCIe {} Gb/s, NIC {} Gb/s; {} GPUs per node{}; wire: {}\n",
                     a.topo.nvlink_gbps, a.topo.pcie_gbps, a.topo.nic_gbps, a.topo.gpus_per_node,
                     a.topo.colocated ? ", colocated" : "", a.quantize_on_sender ? "quantized by the sender" : "source dtype");
  const std::string sharded = "sharded (" + a.layout + ")";
  out << fmt::format("{:<22}{:>30}{:>30}\n", "", whole ? "broadcast from rank 0" : "gather to rank 0, send",
                     whole ? "ferry balanced" : sharded);
  auto row = [&](const char* what, const std::string& x, const std::string& y) {
    out << fmt::format("{:<22}{:>30}{:>30}\n", what, x, y);
  };
  row("bytes moved", gb(bcast.cost.bytes_moved), gb(bal.cost.bytes_moved));
  row("senders used", std::to_string(bcast.cost.senders_used), std::to_string(bal.cost.senders_used));
  row("max bytes per sender", gb(bcast.cost.max_sender_bytes), gb(bal.cost.max_sender_bytes));
  row("max bytes per receiver", gb(bcast.cost.max_receiver_bytes), gb(bal.cost.max_receiver_bytes));
  row("max link bytes", gb(bcast.cost.max_link_bytes), gb(bal.cost.max_link_bytes));
  row("pieces / buckets", fmt::format("{} / {}", bcast.cost.pieces, bcast.cost.buckets),
      fmt::format("{} / {}", bal.cost.pieces, bal.cost.buckets));
  row("planning time", fmt::format("{:.3f} s", bcast.planning_seconds), fmt::format("{:.3f} s", bal.planning_seconds));
  if (!whole) {
    row("gather onto rank 0", fmt::format("{:.3f} s", gather.seconds), "-");
    row("send", fmt::format("{:.3f} s", bcast.cost.predicted_seconds), fmt::format("{:.3f} s", bal.cost.predicted_seconds));
  }
  row("predicted update", fmt::format("{:.3f} s", gather_then_send), fmt::format("{:.3f} s", bal.cost.predicted_seconds));
  out << fmt::format("sender balance: max {} vs ideal {} ({:+.2f}%)\n", gb(bal.cost.max_sender_bytes),
                     gb(static_cast<uint64_t>(ideal)), imbalance * 100);
  out << fmt::format("per-sender payload (source dtype): min {}, max {}{}\n", gb(bal.min_sender_bytes),
                     gb(bal.max_sender_bytes), a.per_sender ? "" : " (each with --per-sender)");
  if (!whole) {
    out << fmt::format("gather: {} over NVLink and {} over the NIC into rank 0, which then holds the whole model, {}\n",
                       gb(gather.nvlink_bytes), gb(gather.nic_bytes), gb(model_bytes));
  }
  out << fmt::format("receiver bound (busiest rollout GPU through its NIC): {:.3f} s\n", bal.cost.receiver_bound_seconds);
  out << fmt::format("busiest links ({}):\n", whole ? "balanced" : sharded);
  for (const auto& l : bal.cost.busiest) {
    out << fmt::format("  {:<40} {:>12} {:>8} buckets {:>9.3f} s\n", l.link, gb(l.bytes), l.buckets, l.seconds);
  }
  if (a.per_sender) {
    out << "payload per sender (source dtype):\n";
    for (size_t k = 0; k < bal.bytes_per_sender.size(); ++k) out << fmt::format("  {:>5} {:>12}\n", k, gb(bal.bytes_per_sender[k]));
  }
  return ok_status();
}

}  // namespace

void add_plan_command(CLI::App& app) { add_plan_command(app, std::cout); }

void add_plan_command(CLI::App& app, std::ostream& out) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "plan a weight update and predict its time on a cluster");
  cmd->add_option("--model", args->model, "preset model: " + [] {
    std::string s;
    for (const auto& n : sharding::preset_names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }());
  cmd->add_option("--config", args->config, "a Hugging Face config.json, or a ferry mapping file");
  cmd->add_option("--trainers", args->trainers, "trainer (sender) GPUs")->capture_default_str();
  cmd->add_option(
         "--layout", args->layout,
         "what each trainer rank holds: whole (every tensor, after its gather), fsdp (Shard(0) rows), hsdp "
         "(Shard(0) in groups of --shard-group, replicated across them), pipeline (layers split into stages), "
         "ep (routed experts split by index, the rest Shard(0)), megatron-tpT[-ppP][-epE][-etpX] (Megatron-Core's "
         "fused linear_qkv / linear_fc1 and grouped experts, TP T, P pipeline stages, E expert-parallel "
         "ranks, expert TP X (T when absent), the rest data-parallel copies)")
      ->check([](const std::string& v) {
        const bool known = v == "whole" || v == "fsdp" || v == "hsdp" || v == "pipeline" || v == "ep" ||
                           megatron_sizes(v).has_value();
        return known ? std::string()
                     : "expected whole, fsdp, hsdp, pipeline, ep or megatron-tpT[-ppP][-epE][-etpX], got " + v;
      })
      ->capture_default_str();
  cmd->add_option("--experts", args->experts,
                  "how the trainer holds routed experts: per-expert (a tensor per expert, as checkpoints name them) "
                  "or stacked (one [experts, rows, cols] tensor per layer and projection, transformers' gate_up_proj "
                  "and down_proj)")
      ->check(CLI::IsMember({"per-expert", "stacked"}))
      ->capture_default_str();
  cmd->add_option("--shard-group", args->shard_group, "hsdp: trainer ranks per shard group (default: GPUs per node)");
  cmd->add_flag("--per-sender", args->per_sender, "print every sender's bytes (--json always lists them)");
  cmd->add_option("--replicas", args->replicas, "rollout replicas")->capture_default_str();
  cmd->add_option("--tp", args->tp, "tensor-parallel ranks per replica")->capture_default_str();
  cmd->add_option("--ep", args->ep, "expert-parallel groups inside a replica's TP ranks")->capture_default_str();
  cmd->add_option("--scheme", args->scheme, "quantization of the rollouts' linear layers")->capture_default_str();
  cmd->add_option("--bucket-bytes", args->bucket_bytes, "bytes per bucket (default FERRY_BUCKET_BYTES)");
  cmd->add_option("--nvlink-gbps", args->topo.nvlink_gbps, "NVLink Gb/s per GPU per direction")->capture_default_str();
  cmd->add_option("--pcie-gbps", args->topo.pcie_gbps, "PCIe Gb/s per GPU per direction")->capture_default_str();
  cmd->add_option("--nic-gbps", args->topo.nic_gbps, "NIC Gb/s per GPU per direction")->capture_default_str();
  cmd->add_option("--gpus-per-node", args->topo.gpus_per_node, "GPUs per node")->capture_default_str();
  cmd->add_option("--seconds-per-bucket", args->topo.seconds_per_bucket, "fixed cost of one bucket on a link")
      ->capture_default_str();
  cmd->add_flag("--colocated", args->topo.colocated, "rollout ranks share the trainers' nodes");
  cmd->add_flag("--quantize-on-sender", args->quantize_on_sender, "quantized parameters cross the wire at scheme width");
  cmd->add_flag("--json", args->json, "print one JSON object");
  std::ostream* sink = &out;
  cmd->callback([args, sink] {
    Status s = run_plan(*args, *sink);
    if (!s.ok()) {
      std::cerr << "ferry plan: " << s.to_string() << "\n";
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace ferry::cli
