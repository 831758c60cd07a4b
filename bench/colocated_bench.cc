// ferry-bench-colocated: the colocated update on one GPU. A trainer process holds a Llama-3-8B
// shaped model in bf16 on cuda:N (one cudaMalloc per tensor, as PyTorch's allocator gives large
// tensors); a rollout process on the same GPU (TP 1) holds quantized storage. Each update changes
// every weight, then times start_weight_update .. finish_weight_update returning; the median over
// --updates after warm-up is printed beside the floor measured in the same run: the update's bytes
// read plus bytes written over the device-to-device copy bandwidth.
//
// With --rank-device on other GPUs (one for every rank, or one per rank) the replica is fed over the
// transport FERRY_TRANSPORT names (nccl, cuda_ipc): the update is then printed beside the link's
// floor (the bf16 bytes over a plain NCCL send/receive, or a peer copy, measured in the same run)
// and beside the cost model's prediction for the same plan from links and stages measured in the
// same run (link bandwidth and per-bucket cost, packing at device-copy speed, the ranks' processing
// rate and the control round trip from the warm-up updates).
//
//   ferry-bench-colocated [--scheme fp8_per_channel] [--layout ferry|vllm|sglang] [--layers 32] [--updates 10] [--device cuda:0] [--json]
//   ferry-bench-colocated --model qwen3-30b-a3b [--experts stacked] --scheme fp8_block --json
//     (--model: any preset or config.json)
//   FERRY_TRANSPORT=nccl ferry-bench-colocated --device cuda:0 --rank-device cuda:1 --tp 2 --json
//   FERRY_TRANSPORT=nccl ferry-bench-colocated --device cuda:0 --rank-device cuda:1,cuda:2 --tp 2 --json
//
// With --trainers N the trainer is sharded: N trainer processes on the same GPU, each holding FSDP2
// Shard(0) rows of every tensor (sharding::fsdp_holdings), update the replica together; each rank
// reads every trainer process's rows in place. The figure is the first trainer rank's.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "bench/adam_step.h"
#include "bench/colocated_rank.h"
#include "bench/colocated_weights.h"
#include "bench/transport_device.h"
#include "core/buffer.h"
#include "core/device_copy.h"
#include "core/log.h"
#include "core/rank_devices.h"
#include "core/settings.h"
#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "reload/model_storage.h"
#include "sharding/cost_model.h"
#include "sharding/llama.h"
#include "sharding/planner.h"
#include "sharding/trainer_layouts.h"
#include "transport/ipc_share.h"

extern char** environ;

namespace {

using ferry::Status;

using ferry::bench::BenchModel;
using ferry::bench::allocate_weights;
using ferry::bench::change_weights;
using ferry::bench::copy_bandwidth;

#if FERRY_HAVE_CUDA

// Trainer rank `rank` of `ranks` (not the first): its Shard(0) rows of every tensor on `device`,
// changed before each of `total` updates, sent as the first trainer rank starts each.
int run_trainer_rank(const std::string& coordinator, int rank, int ranks, const BenchModel& model, int total,
                     int device) {
  ferry::set_log_identity(fmt::format("trainer rank {}", rank));
  auto desc = ferry::bench::bench_model(model);
  if (!desc.ok()) return std::cerr << desc.status().to_string() << "\n", 1;
  const auto manifest = ferry::sharding::model_manifest(*desc);
  ferry::coordinator::UpdateOptions u;
  u.holdings = ferry::sharding::fsdp_holdings(manifest, rank, ranks);
  if (auto st = ferry::set_current_device(ferry::Device::cuda(device)); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  auto weights = allocate_weights(manifest, ferry::Device::cuda(device), &u.holdings);
  if (!weights.ok()) return std::cerr << weights.status().to_string() << "\n", 1;
  ferry::coordinator::TrainerOptions o;
  o.coordinator = coordinator;
  o.trainer_rank = rank;
  o.trainer_ranks = ranks;
  auto trainer = ferry::coordinator::Trainer::create(o);
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  for (int v = 1; v <= total; ++v) {
    Status st = change_weights(*weights, static_cast<uint64_t>(v * ranks + rank));
    ferry::coordinator::MapSource source(weights->views);
    if (st.ok()) st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest, u);
    if (st.ok()) st = (*trainer)->update_weights(source);
    if (st.ok()) st = (*trainer)->finish_weight_update().status();
    if (!st.ok()) return std::cerr << fmt::format("trainer rank {} v{}: {}\n", rank, v, st.to_string()), 1;
  }
  return 0;
}

#endif

#if FERRY_HAVE_CUDA
// Links and stages of a cross-GPU update, measured in this run, for the cost model.
struct Measured {
  double plain_bytes_per_second = 0;  // plain NCCL send/receive (or a peer copy) of one bucket to each rank GPU
  double link_bytes_per_second = 0;   // the link's rate and fixed cost per bucket, fitted from that
  double seconds_per_bucket = 0;      // and the same for 4 KiB (sharding::fit_link)
  std::string link_baseline;
};

// The link from the trainer's GPU to the ranks' GPUs other than its own, all fed at once (a replica
// spread over GPUs loads the trainer's NVLink egress with every rank's share): a plain send of one
// bucket to each of them, and of 4 KiB to each, give the link's rate and its fixed cost per bucket
// (sharding::fit_link). The rate is not the bucket's bytes over its time: that time holds the
// bucket's fixed cost, which the model adds again for every bucket.
ferry::Result<Measured> measure_link(const std::string& transport, int from, const std::vector<int>& rank_gpus,
                                     uint64_t bucket) {
  Measured m;
  const bool nccl = transport == "nccl";
  m.link_baseline = nccl ? "nccl" : "device_copy";
  std::vector<int> to;
  for (int g : rank_gpus) {
    if (g != from && std::find(to.begin(), to.end(), g) == to.end()) to.push_back(g);
  }
  if (to.size() > 1) m.link_baseline += fmt::format("_fanout{}", to.size());
  auto timed = [&](size_t bytes, int iters) {
    return nccl ? ferry::bench::nccl_fanout_seconds(bytes, iters, from, to)
                : ferry::bench::device_copy_fanout_seconds(bytes, iters, from, to);
  };
  FERRY_ASSIGN_OR_RETURN(double big, timed(bucket, 20));
  FERRY_ASSIGN_OR_RETURN(double small, timed(4096, 50));
  const double n = static_cast<double>(to.size());
  m.plain_bytes_per_second = static_cast<double>(bucket) * n / big;
  const auto fit = ferry::sharding::fit_link(static_cast<double>(bucket) * n, n, big, 4096.0 * n, n, small);
  if (fit.ok()) {
    m.link_bytes_per_second = fit->bytes_per_second;
    m.seconds_per_bucket = fit->seconds_per_bucket;
  } else {  // noise swamped one of them: keep the bytes
    m.link_bytes_per_second = m.plain_bytes_per_second;
  }
  return m;
}
#endif

// Spawns this binary with `args`; -1 when it could not.
pid_t spawn_self(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  return posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) == 0 ? pid : -1;
}

// `args` with the model's options for a child process.
std::vector<std::string> with_model(std::vector<std::string> args, const BenchModel& model) {
  if (!model.model.empty()) args.insert(args.end(), {"--model", model.model});
  if (model.stacked_experts) args.insert(args.end(), {"--experts", "stacked"});
  args.insert(args.end(), {"--layers", std::to_string(model.layers)});
  return args;
}

int run_trainer(const std::string& scheme, const BenchModel& model, int updates, int device,
                const std::vector<int>& rank_gpus, int tp, bool json, int trainers, bool adam) {
#if !FERRY_HAVE_CUDA
  (void)scheme, (void)model, (void)updates, (void)device, (void)rank_gpus, (void)tp, (void)json, (void)trainers,
      (void)adam;
  std::cerr << "ferry-bench-colocated needs a CUDA build\n";
  return 1;
#else
  ferry::set_log_identity("trainer");
  const bool apart = std::any_of(rank_gpus.begin(), rank_gpus.end(), [&](int g) { return g != device; });
  const bool spread = std::any_of(rank_gpus.begin(), rank_gpus.end(), [&](int g) { return g != rank_gpus[0]; });
  std::string rank_list;
  for (int g : rank_gpus) rank_list += fmt::format("{}cuda:{}", rank_list.empty() ? "" : ",", g);
  const ferry::Settings settings = ferry::load_settings().value();  // checked in main()
  const std::string transport = settings.transport;
  if (apart && transport != "nccl" && transport != "cuda_ipc") {
    return std::cerr << "--rank-device on another GPU: set FERRY_TRANSPORT=nccl or cuda_ipc\n", 2;
  }
  auto desc = ferry::bench::bench_model(model);
  if (!desc.ok()) return std::cerr << desc.status().to_string() << "\n", 1;
  const auto manifest = ferry::sharding::model_manifest(*desc);
  std::vector<ferry::sharding::RankSpec> specs;
  uint64_t storage_bytes = 0;
  for (int r = 0; r < tp; ++r) {
    auto spec = ferry::bench::colocated_rank_spec(*desc, scheme, r, tp);
    if (!spec.ok()) return std::cerr << spec.status().to_string() << "\n", 1;
    for (const auto& p : spec->params) {
      auto layout = ferry::reload::param_layout(p, ferry::DType::kBF16, spec->layout);
      if (!layout.ok()) return std::cerr << layout.status().to_string() << "\n", 1;
      for (const auto& t : *layout) storage_bytes += ferry::dtype_bytes(t.dtype, ferry::shape_numel(t.shape));
    }
    specs.push_back(std::move(*spec));
  }
  auto bw = copy_bandwidth(device);
  if (!bw.ok()) return std::cerr << bw.status().to_string() << "\n", 1;
  const uint64_t bucket = settings.bucket_bytes;
  Measured link;
  if (apart) {
    auto m = measure_link(transport, device, rank_gpus, bucket);
    if (!m.ok()) return std::cerr << "link: " << m.status().to_string() << "\n", 1;
    link = *m;
  }
  if (auto st = ferry::set_current_device(ferry::Device::cuda(device)); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
  ferry::coordinator::UpdateOptions u;
  if (trainers > 1) u.holdings = ferry::sharding::fsdp_holdings(manifest, 0, trainers);
  auto weights = allocate_weights(manifest, ferry::Device::cuda(device), trainers > 1 ? &u.holdings : nullptr);
  if (!weights.ok()) return std::cerr << weights.status().to_string() << "\n", 1;
  // --change adam: each update follows one Adam step of the weights (bench/adam_step.h).
  std::unique_ptr<ferry::bench::DeviceAdam> optimizer;
  if (adam) {
    if (auto st = change_weights(*weights, 0); !st.ok()) return std::cerr << st.to_string() << "\n", 1;
    std::vector<ferry::TensorView> views;
    for (const auto& [name, v] : weights->views) views.push_back(v);
    auto a = ferry::bench::DeviceAdam::create(std::move(views));
    if (!a.ok()) return std::cerr << a.status().to_string() << "\n", 1;
    optimizer = std::move(*a);
  }

  ferry::coordinator::TrainerOptions o;
  o.trainer_ranks = trainers;
  auto trainer = ferry::coordinator::Trainer::create(o);
  if (!trainer.ok()) return std::cerr << trainer.status().to_string() << "\n", 1;
  std::vector<pid_t> pids;
  std::vector<std::string> rank_reports;
  const int warmup = 2;
  for (int r = 0; r < tp; ++r) {
    const auto report = fmt::format("ferry-bench-colocated-{}-rank{}", getpid(), r);
    rank_reports.push_back((std::filesystem::temp_directory_path() / report).string());
    pids.push_back(spawn_self(with_model({"ferry-bench-colocated", "--role", "rollout", "--coordinator",
                                          (*trainer)->coordinator_address(), "--scheme", scheme, "--device",
                                          fmt::format("cuda:{}", rank_gpus[static_cast<size_t>(r)]), "--tp",
                                          std::to_string(tp), "--tp-rank", std::to_string(r), "--rank-report",
                                          rank_reports.back()},
                                         model)));
  }
  for (int r = 1; r < trainers; ++r) {
    pids.push_back(spawn_self(with_model({"ferry-bench-colocated", "--role", "trainer-rank", "--coordinator",
                                          (*trainer)->coordinator_address(), "--device", fmt::format("cuda:{}", device),
                                          "--trainers", std::to_string(trainers), "--trainer-rank", std::to_string(r),
                                          "--updates", std::to_string(warmup + updates)},
                                         model)));
  }
  if (std::count(pids.begin(), pids.end(), -1) > 0) return std::cerr << "posix_spawn failed\n", 1;
  const int64_t timeout = ferry::load_settings().value().timeout_ms;
  Status st = (*trainer)->wait_for_ranks(tp, timeout);
  std::vector<ferry::coordinator::UpdateReport> reports, warm;
  for (int v = 1; v <= warmup + updates && st.ok(); ++v) {
    st = optimizer ? optimizer->step() : change_weights(*weights, static_cast<uint64_t>(v * trainers));
    if (!st.ok()) break;
    ferry::coordinator::MapSource source(weights->views);
    st = (*trainer)->start_weight_update(static_cast<uint64_t>(v), manifest, u);
    if (st.ok()) st = (*trainer)->update_weights(source);
    if (!st.ok()) break;
    auto r = (*trainer)->finish_weight_update();
    if (!r.ok()) {
      st = r.status();
      break;
    }
    if (r->moved != 0) st = Status::internal(fmt::format("update v{}: census moved {}/{}", v, r->moved, r->registered));
    (v > warmup ? reports : warm).push_back(*r);
    std::cerr << fmt::format("update v{}: {:.2f} ms (transfer {:.2f}, process {:.2f}) direct {}/{} bytes\n", v,
                             r->seconds * 1e3, r->transfer_seconds * 1e3, r->process_seconds * 1e3, r->direct_bytes,
                             r->bytes);
  }
  trainer->reset();
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
  }
  // What the ranks counted: quantize kernel runs per version they took (every update's are alike).
  uint64_t runs = 0, versions = 0, mapped = 0;
  double map_seconds = 0;  // the longest rank's: they map at the same time
  for (const auto& path : rank_reports) {
    auto c = ferry::bench::read_rank_counts(path);
    std::remove(path.c_str());
    if (st.ok() && !c.ok()) st = c.status();
    if (c.ok()) {
      runs += c->quantize_runs;
      versions = std::max(versions, c->versions);
      mapped += c->mapped;
      map_seconds = std::max(map_seconds, c->map_seconds);
    }
  }
  if (!st.ok()) return std::cerr << "ferry-bench-colocated: " << st.to_string() << "\n", 1;
  auto median = [](const std::vector<ferry::coordinator::UpdateReport>& rs, auto field) {
    std::vector<double> v;
    for (const auto& r : rs) v.push_back(field(r));
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto med = [&](auto field) { return median(reports, field); };
  const double seconds = med([](const auto& r) { return r.seconds; });
  uint64_t all_params = 0;  // of the whole model, whichever share this trainer rank holds
  int layer_count = 0;
  for (const auto& t : manifest) {
    all_params += static_cast<uint64_t>(ferry::shape_numel(t.shape));
    layer_count = std::max(layer_count, ferry::sharding::layer_index_of(t.name) + 1);
  }
  const double moved_bytes = 2.0 * static_cast<double>(all_params) + static_cast<double>(storage_bytes);
  const auto& last = reports.back();
  std::string extra;
  double floor = moved_bytes / *bw;
  // The update's plan, from this run's trainer processes (each an FSDP2 Shard(0) holder when sharded).
  std::vector<ferry::sharding::SenderInfo> senders(1);
  if (trainers > 1) {
    senders.clear();
    for (int r = 0; r < trainers; ++r) senders.push_back(ferry::sharding::fsdp_holdings(manifest, r, trainers));
  }
  auto plan = ferry::sharding::make_plan(manifest, specs, senders, ferry::sharding::PlanOptions{bucket});
  if (!plan.ok()) return std::cerr << plan.status().to_string() << "\n", 1;
  if (apart) {
    // The link's floor: the update's bytes at the plain send's rate. The cost model's prediction
    // for the same plan, from the link fitted above and the stages of the warm-up updates.
    floor = static_cast<double>(last.bytes) / link.plain_bytes_per_second;
    ferry::sharding::Topology topo;
    topo.gpus_per_node = std::max(ferry::bench::cuda_device_count(), *std::max_element(rank_gpus.begin(), rank_gpus.end()) + 1);
    topo.nvlink_gbps = link.link_bytes_per_second * 8 / 1e9;
    topo.seconds_per_bucket = link.seconds_per_bucket;
    topo.rank_gpus.assign(rank_gpus.begin(), rank_gpus.end());
    ferry::sharding::CostOptions co;
    co.stages.pack_bytes_per_second = *bw / 2;  // a copy reads and writes each byte
    // The stages from the warm-up updates after the first, which pays one-time costs (pools,
    // mappings, NCCL buffers): with two warm-ups the median of all would be that first one.
    const std::vector<ferry::coordinator::UpdateReport> steady(warm.begin() + 1, warm.end());
    const double proc = median(steady, [](const auto& r) { return r.process_seconds; });
    co.stages.process_bytes_per_second = proc > 0 ? static_cast<double>(last.bytes) / tp / proc : 0;
    co.stages.round_trip_seconds = median(steady, [](const auto& r) { return r.pause_seconds; }) / 2;  // pause: 2 round trips
    auto cost = ferry::sharding::estimate_cost(*plan, specs, 1, topo, co);
    if (!cost.ok()) return std::cerr << cost.status().to_string() << "\n", 1;
    extra = fmt::format(",\"transport\":\"{}\",\"tp\":{},\"rank_device\":\"{}\",\"link_baseline\":\"{}\","
                        "\"link_gbps\":{:.1f},\"seconds_per_bucket\":{:.6f},\"predicted_seconds\":{:.6f},"
                        "\"measured_over_predicted\":{:.3f},\"critical\":\"{}\",\"predicted_control\":{:.6f},"
                        "\"predicted_fill\":{:.6f},\"predicted_busy\":{:.6f},\"predicted_drain\":{:.6f},"
                        "\"process_gbps\":{:.1f}",
                        transport, tp, rank_list, link.link_baseline, link.link_bytes_per_second / 1e9,
                        link.seconds_per_bucket, cost->predicted_seconds, seconds / cost->predicted_seconds,
                        cost->critical, cost->control_seconds, cost->fill_seconds, cost->busy_seconds,
                        cost->drain_seconds, co.stages.process_bytes_per_second / 1e9);
  }
  const std::string sharded = trainers > 1 ? fmt::format("-trainers{}", trainers) : "";
  // With Adam steps: how the update travelled (direct reads or bytes, deltas, staging).
  const std::string how = adam ? fmt::format("-adam{}{}{}", settings.direct == "off" ? "-bytes" : "",
                                             settings.delta == "on" || settings.delta == "always" ? "-delta" : "",
                                             settings.stage == "on" ? "-staged" : "")
                               : "";
  const std::string on = model.model.empty() ? ""
                         : "-" + model.model.substr(model.model.find_last_of('/') + 1) +
                               (model.stacked_experts ? "-stacked" : "");
  const std::string name = apart ? fmt::format("ferry{}-{}-tp{}{}{}{}/{}", on, transport, tp, spread ? "-spread" : "",
                                               sharded, how, scheme)
                                 : fmt::format("ferry{}{}{}/{}", on, sharded, how, scheme);
  const auto ipc = ferry::transport::ipc_stats();  // this trainer's exports (the ranks report their mappings)
  // The per-tensor counts of the update (issue figures for MoE models): tensors sent, plan pieces,
  // storage tensors registered (census entries), quantize kernel runs per update over the ranks,
  // and the first update (handles opened, pools grown) beside the steady median.
  extra += fmt::format(",\"model\":\"{}\",\"experts\":\"{}\",\"tensors\":{},\"pieces\":{},\"registered\":{},"
                       "\"quantize_runs_per_update\":{:.1f},"
                       "\"first_seconds\":{:.6f},\"first_over_steady\":{:.3f},\"mapped_allocations\":{},"
                       "\"map_seconds\":{:.6f},\"exported_allocations\":{},\"export_seconds\":{:.6f},"
                       "\"first_less_handles_over_steady\":{:.3f},\"first_plan_seconds\":{:.6f},"
                       "\"first_transfer_seconds\":{:.6f},\"first_process_seconds\":{:.6f}",
                       model.model.empty() ? "llama3-8b" : model.model.substr(model.model.find_last_of('/') + 1),
                       model.stacked_experts ? "stacked" : "per-expert", manifest.size(), plan->pieces.size(),
                       last.registered,
                       versions > 0 ? static_cast<double>(runs) / static_cast<double>(versions) : 0.0, warm[0].seconds,
                       warm[0].seconds / seconds, mapped, map_seconds, ipc.exported, ipc.export_seconds,
                       (warm[0].seconds - map_seconds - ipc.export_seconds) / seconds, warm[0].plan_seconds,
                       warm[0].transfer_seconds, warm[0].process_seconds);
  double changed = 0, compared = 0;
  for (const auto& r : reports) {
    for (const auto& d : r.delta) changed += static_cast<double>(d.changed), compared += static_cast<double>(d.elements);
  }
  extra += fmt::format(",\"wire_bytes\":{:.0f},\"changed_fraction\":{:.6f},\"pause_window_seconds\":{:.6f},\"staged\":{}",
                       med([](const auto& r) { return static_cast<double>(r.wire_bytes()); }),
                       compared > 0 ? changed / compared : 0.0, med([](const auto& r) { return r.pause_window_seconds; }),
                       last.staged ? "true" : "false");
  if (json) {
    fmt::print("{{\"bench\":\"colocated\",\"case\":\"{}\",\"device\":\"cuda\",\"params\":{},\"layers\":{},"
               "\"bytes\":{:.0f},\"direct_bytes\":{},\"seconds\":{:.6f},\"updates\":{},\"pause_seconds\":{:.6f},"
               "\"ranks_pause_seconds\":{:.6f},"
               "\"transfer_seconds\":{:.6f},\"process_seconds\":{:.6f},\"resume_seconds\":{:.6f},"
               "\"copy_gbps\":{:.1f},\"floor_seconds\":{:.6f},\"ratio_to_floor\":{:.3f}{}}}\n",
               name, all_params, layer_count, moved_bytes, last.direct_bytes, seconds, reports.size(),
               med([](const auto& r) { return r.pause_seconds; }), med([](const auto& r) { return r.ranks_pause_seconds; }),
               med([](const auto& r) { return r.transfer_seconds; }), med([](const auto& r) { return r.process_seconds; }),
               med([](const auto& r) { return r.resume_seconds; }), *bw / 1e9, floor, seconds / floor, extra);
  } else {
    fmt::print("{} {} params: {:.2f} ms per update (median of {}), floor {:.2f} ms, ratio {:.2f}\n", name,
               all_params, seconds * 1e3, reports.size(), floor * 1e3, seconds / floor);
  }
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry-bench-colocated: a colocated update of a Llama-3-8B shaped model (or --model) beside its memory floor"};
  std::string role = "trainer", coordinator, scheme = "fp8_per_channel", device_name = "cuda:0";
  std::string rank_device_name, rank_report;
  BenchModel model;
  int updates = 10, tp = 1, tp_rank = 0, trainers = 1, trainer_rank = 0;
  std::string change = "all", layout = "ferry";
  bool json = false;
  app.add_option("--role", role, "trainer (default), rollout, or trainer-rank (of a sharded trainer)")
      ->check(CLI::IsMember({"trainer", "rollout", "trainer-rank"}));
  app.add_option("--trainers", trainers, "trainer processes, each holding Shard(0) rows of every tensor")
      ->check(CLI::Range(1, 64));
  app.add_option("--trainer-rank", trainer_rank, "trainer-rank role: this rank");
  app.add_option("--coordinator", coordinator, "rollout role: coordinator address");
  app.add_option("--scheme", scheme, "the rollout's linear-layer scheme");
  app.add_option("--layout", layout, "the rollout's engine layout (docs/engines.md)")
      ->check(CLI::IsMember({"ferry", "vllm", "sglang"}));
  app.add_option("--model", model.model,
                 "a preset (ferry plan --model: qwen3-30b-a3b, ...) or a config.json; default: Llama-3-8B's shape");
  std::string experts = "per-expert";
  app.add_option("--experts", experts, "routed experts held per expert (checkpoint names) or stacked per layer "
                                       "(transformers' gate_up_proj, down_proj)")
      ->check(CLI::IsMember({"per-expert", "stacked"}));
  app.add_option("--layers", model.layers, "decoder layers of the Llama-3-8B shape (32)")->check(CLI::Range(1, 128));
  app.add_option("--rank-report", rank_report, "rollout role: where to write its counts when the job ends");
  app.add_option("--updates", updates, "timed updates after two warm-up updates")->check(CLI::Range(1, 1000));
  app.add_option("--device", device_name, "cuda:N: the trainer's weights (and the ranks' storage, unless --rank-device)");
  app.add_option("--rank-device", rank_device_name,
                 "the ranks' storage on other GPUs: cuda:M for all, or one per rank (cuda:1,cuda:2); "
                 "FERRY_TRANSPORT=nccl|cuda_ipc");
  app.add_option("--tp", tp, "tensor-parallel ranks of the replica")->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--tp-rank", tp_rank, "rollout role: this rank");
  app.add_flag("--json", json, "one JSON line");
  app.add_option("--change", change,
                 "all: every weight new each update; adam: one Adam step (lr 1e-6, fp32 master) per update, "
                 "the change set of an RL step (FERRY_DELTA, FERRY_DIRECT, FERRY_STAGE choose the path)")
      ->check(CLI::IsMember({"all", "adam"}));
  CLI11_PARSE(app, argc, argv);
  model.stacked_experts = experts == "stacked";
  if (!model.model.empty() && app.count("--layers") > 0 && role == "trainer") {
    return std::cerr << "--layers sizes the Llama-3-8B shape; --model " << model.model << " brings its own layers\n", 2;
  }
  if (scheme.find('@') != std::string::npos && role == "trainer") {
    return std::cerr << "--scheme " << scheme << ": give the layout with --layout\n", 2;
  }
  if (layout != "ferry") scheme += "@" + layout;  // the ranks' --scheme carries it
  if (auto st = ferry::load_settings().status(); !st.ok()) return std::cerr << st.to_string() << "\n", 2;
  auto device = ferry::parse_device(device_name);
  if (!device.ok() || !device->is_cuda()) return std::cerr << "--device " << device_name << ": expected cuda:N\n", 2;
  if (role == "rollout") {
    return ferry::bench::run_colocated_rank(coordinator, model, scheme, tp_rank, tp, device->index, rank_report);
  }
#if FERRY_HAVE_CUDA
  if (role == "trainer-rank") return run_trainer_rank(coordinator, trainer_rank, trainers, model, updates, device->index);
#endif
  auto rank_devices = ferry::parse_rank_devices(rank_device_name.empty() ? device_name : rank_device_name, tp);
  if (!rank_devices.ok()) return std::cerr << "--rank-device: " << rank_devices.status().message() << "\n", 2;
  std::vector<int> rank_gpus;
  for (const auto& d : *rank_devices) {
    if (!d.is_cuda()) return std::cerr << "--rank-device " << rank_device_name << ": expected cuda:N\n", 2;
    rank_gpus.push_back(d.index);
  }
  if (change == "adam" && trainers > 1) return std::cerr << "--change adam takes one trainer\n", 2;
  return run_trainer(scheme, model, updates, device->index, rank_gpus, tp, json, trainers, change == "adam");
}
