// `ferry bench e2e --trainers N`: a sharded trainer beside "gather to one rank, then send".
#include "bench/e2e_trainers.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "bench/e2e_links.h"
#include "bench/e2e_probe.h"
#include "core/log.h"
#include "core/settings.h"
#include "coordinator/coordinator.h"
#include "coordinator/trainer.h"
#include "sharding/cost_model.h"
#include "sharding/llama.h"
#include "sharding/planner.h"
#include "sharding/trainer_layouts.h"
#include "transport/transport.h"

namespace ferry {
namespace {

using e2e::Child;
using e2e::Clock;
using sharding::fsdp_holdings;
using sharding::shard_rows;
using namespace std::chrono_literals;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Trainer rank r's rows of every tensor of `w`, as views into it.
std::map<std::string, TensorView> local_rows(const sharding::Manifest& m, const e2e::Weights& w, int r, int ranks) {
  std::map<std::string, TensorView> out;
  for (size_t i = 0; i < m.size(); ++i) {
    const auto [from, to] = shard_rows(m[i].shape[0], r, ranks);
    const int64_t row = shape_numel(m[i].shape) / std::max<int64_t>(m[i].shape[0], 1);
    Shape local = m[i].shape;
    local[0] = to - from;
    out.emplace(m[i].name, TensorView(const_cast<uint16_t*>(w.data[i].data()) + from * row, DType::kBF16, local));
  }
  return out;
}

Status expect(e2e::ProbeSocket& s, std::string_view want, std::string* rest = nullptr) {
  FERRY_ASSIGN_OR_RETURN(std::string frame, s.recv(Clock::now() + 600s));
  std::string_view r;
  if (e2e::command_of(frame, &r) != want) {
    return Status::internal(fmt::format("bench trainer said '{}' where '{}' was expected", frame.substr(0, 80), want));
  }
  if (rest) *rest = std::string(r);
  return ok_status();
}

// The updates of one trainer process: `sharded` sends its own rows as trainer rank r of n;
// otherwise rank 0 gathers every rank's rows over loopback TCP and sends whole tensors alone.
Status trainer_process(uint16_t probe_port, const std::string& address, int r, int n, bool sharded, int updates,
                       uint64_t first, const std::string& model) {
  set_log_identity(fmt::format("bench trainer {}", r));
  FERRY_ASSIGN_OR_RETURN(const sharding::LlamaConfig cfg, e2e::model_config(model));
  const sharding::Manifest m = sharding::llama_manifest(cfg);
  FERRY_ASSIGN_OR_RETURN(auto probe, e2e::ProbeSocket::connect(probe_port));
  std::unique_ptr<coordinator::Trainer> trainer;
  if (sharded || r == 0) {
    coordinator::TrainerOptions o;
    o.coordinator = address;
    o.trainer_rank = sharded ? r : 0;
    o.trainer_ranks = sharded ? n : 1;
    FERRY_ASSIGN_OR_RETURN(trainer, coordinator::Trainer::create(o));
  }
  coordinator::UpdateOptions u;
  if (sharded) u.holdings = fsdp_holdings(m, r, n);
  // Gather mode: rank 0 listens for the others' rows; they connect where the bench tells them.
  e2e::ProbeListener gather;
  std::vector<e2e::ProbeSocket> peers;
  if (!sharded && r == 0) {
    FERRY_RETURN_IF_ERROR(gather.open());
    FERRY_RETURN_IF_ERROR(probe.send(fmt::format("port {}", gather.port())));
    for (int i = 1; i < n; ++i) {
      FERRY_ASSIGN_OR_RETURN(auto s, gather.accept(Clock::now() + 60s));
      peers.push_back(std::move(s));
    }
  } else if (!sharded) {
    FERRY_RETURN_IF_ERROR(probe.send("ready"));
    std::string port;
    FERRY_RETURN_IF_ERROR(expect(probe, "gather", &port));
    FERRY_ASSIGN_OR_RETURN(auto s, e2e::ProbeSocket::connect(static_cast<uint16_t>(std::stoi(port))));
    peers.push_back(std::move(s));
  } else {
    FERRY_RETURN_IF_ERROR(probe.send("ready"));
  }
  FERRY_RETURN_IF_ERROR(expect(probe, "go"));
  std::vector<std::vector<uint16_t>> whole(m.size());  // rank 0 gathering: the whole tensors
  std::vector<double> seconds, pause, transfer, process;
  for (int i = 0; i <= updates; ++i) {
    const uint64_t v = first + static_cast<uint64_t>(i);
    const e2e::Weights w(m, v);
    // Every process holds its version before any update is timed: making it is the training
    // step's work, and a rank still making it would stall the others inside the timed update.
    FERRY_RETURN_IF_ERROR(probe.send("made"));
    FERRY_RETURN_IF_ERROR(expect(probe, "start"));
    if (!sharded && r > 0) {
      // Wait for rank 0's call, then send this rank's rows of every tensor, in manifest order.
      FERRY_RETURN_IF_ERROR(expect(peers[0], "send"));
      std::vector<std::string_view> rows;  // written from where they lie, in name order
      for (const auto& [name, view] : local_rows(m, w, r, n)) {
        rows.emplace_back(static_cast<const char*>(view.data()), view.nbytes());
      }
      FERRY_RETURN_IF_ERROR(peers[0].send_parts(rows));
      continue;
    }
    const auto t0 = Clock::now();
    std::map<std::string, TensorView> source;
    if (sharded) {
      source = local_rows(m, w, r, n);
    } else {
      for (auto& p : peers) FERRY_RETURN_IF_ERROR(p.send("send"));
      for (size_t i = 0; i < m.size(); ++i) {
        whole[i].resize(w.data[i].size());
        const auto [from, to] = shard_rows(m[i].shape[0], 0, n);
        const size_t row = w.data[i].size() / static_cast<size_t>(m[i].shape[0]);
        std::memcpy(whole[i].data(), w.data[i].data() + from * row, (to - from) * row * 2);
      }
      for (int k = 1; k < n; ++k) {
        // Rows arrive in name order (local_rows is a map), read in place by name: the gather of a
        // well-made all-gather, one copy through loopback TCP.
        std::vector<std::pair<void*, size_t>> into;
        for (const auto& [name, view] : local_rows(m, w, k, n)) {
          const size_t i = static_cast<size_t>(std::find_if(m.begin(), m.end(), [&](const auto& t) { return t.name == name; }) - m.begin());
          const auto [from, to] = shard_rows(m[i].shape[0], k, n);
          const size_t row = w.data[i].size() / static_cast<size_t>(m[i].shape[0]);
          into.emplace_back(whole[i].data() + from * row, view.nbytes());
        }
        FERRY_RETURN_IF_ERROR(peers[static_cast<size_t>(k - 1)].recv_parts(into, Clock::now() + 600s));
      }
      for (size_t i = 0; i < m.size(); ++i) source.emplace(m[i].name, TensorView(whole[i].data(), DType::kBF16, m[i].shape));
    }
    coordinator::MapSource src(source);
    FERRY_RETURN_IF_ERROR(trainer->start_weight_update(v, m, u));
    FERRY_RETURN_IF_ERROR(trainer->update_weights(src));
    FERRY_ASSIGN_OR_RETURN(const coordinator::UpdateReport report, trainer->finish_weight_update());
    if (i > 0) {  // the first warms up
      seconds.push_back(since(t0));
      pause.push_back(report.pause_seconds);
      transfer.push_back(report.transfer_seconds);
      process.push_back(report.process_seconds);
    }
  }
  if (r == 0) {
    FERRY_RETURN_IF_ERROR(probe.send(fmt::format("result {:.9f} {:.9f} {:.9f} {:.9f}", e2e::median(seconds),
                                                 e2e::median(pause), e2e::median(transfer), e2e::median(process))));
  }
  return ok_status();
}

// The gathering rank's path measured on itself, as trainer_process() runs it: a peer told "send"
// writes `bytes` of rows as one frame over loopback TCP, and the gathering rank reads it in place
// (median of 3, seconds); and the gathering rank's copy of its own `own` bytes into its whole
// tensors.
struct GatherPath {
  double frame_seconds = 0;
  double own_seconds = 0;
};
Result<GatherPath> measure_gather_path(size_t bytes, size_t own) {
  constexpr int kReps = 3;
  std::vector<char> from(own, 2), to(own);
  // The gathering rank copies rows its training step wrote a while before into tensors the last
  // update's send read: neither is in the cache then. Each copy here is preceded by writing twice
  // the last-level cache elsewhere (on the H200 host, whose 300 MiB cache held most of 234 MB of
  // rows, copying them again at once took about half what the update's copy did).
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  std::vector<char> evict(2 * static_cast<size_t>(llc > 0 ? llc : 32L << 20));
  std::vector<double> copies;
  for (int i = 0; i < kReps; ++i) {
    std::memset(evict.data(), i, evict.size());
    asm volatile("" : : "r"(evict.data()) : "memory");  // the writes stay: nothing reads them
    const auto t0 = Clock::now();
    std::memcpy(to.data(), from.data(), own);
    copies.push_back(since(t0));
  }
  if (bytes == 0) return GatherPath{0, e2e::median(copies)};
  auto listener = std::make_unique<e2e::ProbeListener>();
  FERRY_RETURN_IF_ERROR(listener->open());
  const uint16_t port = listener->port();
  const std::vector<char> rows(bytes, 1);
  Status peer_status;
  std::thread peer([&rows, &peer_status, port] {
    auto s = e2e::ProbeSocket::connect(port);
    if (!s.ok()) {
      peer_status = s.status();
      return;
    }
    for (int i = 0; i < kReps && peer_status.ok(); ++i) {
      peer_status = expect(*s, "send");
      if (peer_status.ok()) peer_status = s->send_parts({std::string_view(rows.data(), rows.size())});
    }
  });
  std::vector<double> frames;
  std::vector<char> placed(bytes);
  auto s = listener->accept(Clock::now() + 60s);
  for (int i = 0; s.ok() && i < kReps; ++i) {
    const auto t0 = Clock::now();
    if (!s->send("send").ok() || !s->recv_parts({{placed.data(), placed.size()}}, Clock::now() + 600s).ok()) break;
    frames.push_back(since(t0));
  }
  const Status accepted = s.status();
  // Closed before the join: a peer still waiting for "send" sees the end at once.
  s = Status::aborted("done");
  listener.reset();
  peer.join();
  FERRY_RETURN_IF_ERROR(accepted);
  FERRY_RETURN_IF_ERROR(peer_status);
  if (frames.size() != kReps) return Status::internal("the gather path's probe lost its peer");
  return GatherPath{e2e::median(frames), e2e::median(copies)};
}

// What trainer rank 0 reports of one mode's updates (medians, seconds): the update as it sees it,
// and of that, its pause, transfer and the ranks' processing (UpdateReport).
struct ModeTimes {
  double seconds = -1;
  double pause = 0;
  double transfer = 0;
  double process = 0;
  std::string json() const {
    return fmt::format("{{\"pause\":{:.9f},\"transfer\":{:.9f},\"process\":{:.9f}}}", pause, transfer, process);
  }
};

// One mode at one N: the trainer processes' median update times, from trainer rank 0.
// Versions first .. first + updates.
Result<ModeTimes> run_mode(const std::string& address, int n, bool sharded, int updates, uint64_t first,
                           int64_t timeout_ms, const std::string& model) {
  e2e::ProbeListener listener;
  FERRY_RETURN_IF_ERROR(listener.open());
  std::vector<Child> children(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    FERRY_RETURN_IF_ERROR(children[static_cast<size_t>(r)].spawn(
        {"ferry", "bench", "e2e-trainer", "--probe-port", std::to_string(listener.port()), "--coordinator", address,
         "--trainer-rank", std::to_string(r), "--trainers", std::to_string(n), "--mode", sharded ? "sharded" : "gather",
         "--updates", std::to_string(updates), "--first-version", std::to_string(first), "--model", model}));
  }
  std::vector<e2e::ProbeSocket> trainers;
  std::vector<bool> gathered;  // a rank that sends its rows to rank 0 (said "ready" in gather mode)
  std::string gather_port;
  for (int i = 0; i < n; ++i) {
    FERRY_ASSIGN_OR_RETURN(auto s, listener.accept(Clock::now() + std::chrono::milliseconds(timeout_ms)));
    FERRY_ASSIGN_OR_RETURN(std::string hello, s.recv(Clock::now() + std::chrono::milliseconds(timeout_ms)));
    std::string_view rest;
    const std::string_view word = e2e::command_of(hello, &rest);
    if (word == "port") gather_port = std::string(rest);
    gathered.push_back(!sharded && word == "ready");
    trainers.push_back(std::move(s));
  }
  for (size_t i = 0; i < trainers.size(); ++i) {
    if (gathered[i]) FERRY_RETURN_IF_ERROR(trainers[i].send("gather " + gather_port));
    FERRY_RETURN_IF_ERROR(trainers[i].send("go"));
  }
  // Each update starts once every process made its version (the warm-up's and the timed ones).
  for (int u = 0; u <= updates; ++u) {
    for (auto& s : trainers) FERRY_RETURN_IF_ERROR(expect(s, "made"));
    for (auto& s : trainers) FERRY_RETURN_IF_ERROR(s.send("start"));
  }
  ModeTimes times;
  for (auto& s : trainers) {
    auto frame = s.recv(Clock::now() + 600s);
    std::string_view rest;
    if (!frame.ok() || e2e::command_of(*frame, &rest) != "result") continue;
    const std::string numbers(rest);
    if (std::sscanf(numbers.c_str(), "%lf %lf %lf %lf", &times.seconds, &times.pause, &times.transfer,
                    &times.process) != 4) {
      return Status::internal("trainer rank 0 sent a malformed result: " + numbers);
    }
  }
  for (auto& c : children) {
    if (const int rc = c.reap(static_cast<int>(timeout_ms)); rc != 0) {
      return Status::internal(fmt::format("a bench trainer process exited with {}", rc));
    }
  }
  if (times.seconds < 0) return Status::internal("trainer rank 0 reported no result");
  return times;
}

}  // namespace

Status run_trainers_case(const E2eOptions& o, const std::string& transport, int n) {
  setenv("FERRY_TRANSPORT", transport.c_str(), 1);  // every process here and below uses only it
  FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
  FERRY_ASSIGN_OR_RETURN(const sharding::LlamaConfig cfg, e2e::model_config(o.model));
  const sharding::Manifest manifest = sharding::llama_manifest(cfg);
  FERRY_ASSIGN_OR_RETURN(const std::vector<sharding::RankSpec> specs, e2e::demo_rank_specs(cfg, o.tp, o.scheme));
  const transport::TransportOptions topts = transport::transport_options(settings);
  const sharding::PlanOptions popts{topts.bucket_bytes};
  FERRY_ASSIGN_OR_RETURN(sharding::Plan one, sharding::make_plan(manifest, specs, {sharding::SenderInfo{}}, popts));
  std::vector<sharding::SenderInfo> senders;
  for (int r = 0; r < n; ++r) senders.push_back(fsdp_holdings(manifest, r, n));
  FERRY_ASSIGN_OR_RETURN(sharding::Plan many, sharding::make_plan(manifest, specs, senders, popts));

  coordinator::CoordinatorOptions co;
  co.settings = settings;
  FERRY_ASSIGN_OR_RETURN(auto coord, coordinator::Coordinator::start(co));
  e2e::ProbeListener listener;
  FERRY_RETURN_IF_ERROR(listener.open());
  std::vector<Child> ranks_proc;
  FERRY_ASSIGN_OR_RETURN(auto ranks, e2e::start_ranks(listener, ranks_proc, coord->address(), o.tp, o.scheme, transport,
                                                      settings.timeout_ms, o.model));
  FERRY_RETURN_IF_ERROR(coord->wait_for_ranks(o.tp, settings.timeout_ms));
  // The links from this process, as for one trainer: the cost model's inputs for both modes.
  FERRY_ASSIGN_OR_RETURN(
      auto probe, e2e::LinkProbe::open(ranks, transport, one, specs, manifest,
                                       static_cast<int>(topts.buckets_in_flight), e2e::pack_deltas(settings), n));
  for (int round = 0; round < 4; ++round) FERRY_RETURN_IF_ERROR(probe->round(round > 0));
  const e2e::Links links = probe->links();
  probe.reset();
  for (auto& r : ranks) FERRY_RETURN_IF_ERROR(r.send("done"));

  const uint64_t next = static_cast<uint64_t>(o.updates) + 2;
  FERRY_ASSIGN_OR_RETURN(const ModeTimes sharded_times,
                         run_mode(coord->address(), n, true, o.updates, 1, settings.timeout_ms, o.model));
  FERRY_ASSIGN_OR_RETURN(const ModeTimes gathered_times,
                         run_mode(coord->address(), n, false, o.updates, next, settings.timeout_ms, o.model));
  const double sharded = sharded_times.seconds, gathered = gathered_times.seconds;

  sharding::Topology topo;
  sharding::CostOptions cost, cost_many;
  e2e::cost_inputs(links, &topo, &cost);
  e2e::cost_inputs(links, &topo, &cost_many, /*many=*/true);
  FERRY_ASSIGN_OR_RETURN(auto p_many, sharding::estimate_cost(many, specs, n, topo, cost_many));
  FERRY_ASSIGN_OR_RETURN(auto p_one, sharding::estimate_cost(one, specs, 1, topo, cost));
  // Gathering: rank 0 copies its own rows into whole tensors, then every other rank's rows cross
  // loopback TCP into it, one rank after another (each a frame: packed, sent, received, placed),
  // then it sends as one trainer does. The frame and the copy are measured on that path itself.
  uint64_t total = 0;
  std::vector<uint64_t> held(static_cast<size_t>(n), 0);  // per trainer rank, the bytes of its rows
  for (const auto& t : manifest) {
    const uint64_t bytes = dtype_bytes(t.dtype, shape_numel(t.shape));
    total += bytes;
    for (int r = 0; r < n; ++r) {
      const auto [from, to] = shard_rows(t.shape[0], r, n);
      held[static_cast<size_t>(r)] += bytes / static_cast<uint64_t>(t.shape[0]) * static_cast<uint64_t>(to - from);
    }
  }
  FERRY_ASSIGN_OR_RETURN(const GatherPath path, measure_gather_path(n > 1 ? held[1] : 0, held[0]));
  double gather_predicted = p_one.predicted_seconds + path.own_seconds;
  for (int r = 1; r < n && held[1] > 0; ++r) {
    gather_predicted +=
        path.frame_seconds * static_cast<double>(held[static_cast<size_t>(r)]) / static_cast<double>(held[1]);
  }
  const std::string name = transport + "/" + o.scheme + (o.model == "demo" ? "" : "/" + o.model);
  if (o.json) {
    fmt::print(
        "{{\"bench\":\"e2e-trainers\",\"case\":\"{}\",\"trainers\":{},\"tp\":{},\"updates\":{},\"bytes\":{},"
        "\"sharded_seconds\":{:.9f},\"sharded_predicted_seconds\":{:.9f},\"gather_seconds\":{:.9f},"
        "\"gather_predicted_seconds\":{:.9f},\"speedup\":{:.3f},\"sharded_predicted\":{},"
        "\"one_sender_predicted\":{},\"gather_path\":{{\"own_seconds\":{:.9f},\"frame_seconds\":{:.9f}}},"
        "\"sharded_measured\":{},\"gather_measured\":{},\"links\":{}}}\n",
        name, n, o.tp, o.updates, total, sharded, p_many.predicted_seconds, gathered, gather_predicted,
        sharded > 0 ? gathered / sharded : 0, e2e::predicted_json(p_many), e2e::predicted_json(p_one), path.own_seconds,
        path.frame_seconds, sharded_times.json(), gathered_times.json(), e2e::links_json(links));
  } else {
    fmt::print("e2e {:<22} trainers {} tp {}  sharded {:.6f} s (predicted {:.6f}, ratio {:.2f})  gather-then-send "
               "{:.6f} s (predicted {:.6f}, ratio {:.2f})  gather/sharded {:.2f}x\n",
               name, n, o.tp, sharded, p_many.predicted_seconds, sharded > 0 ? p_many.predicted_seconds / sharded : 0,
               gathered, gather_predicted, gathered > 0 ? gather_predicted / gathered : 0,
               sharded > 0 ? gathered / sharded : 0);
  }
  std::fflush(stdout);
  coord->stop();  // the ranks see the job end and exit
  for (auto& c : ranks_proc) {
    if (const int rc = c.reap(static_cast<int>(settings.timeout_ms)); rc != 0) {
      return Status::internal(fmt::format("a bench rank exited with {}", rc));
    }
  }
  return ok_status();
}

int run_e2e_trainer(uint16_t probe_port, const std::string& coordinator, int rank, int trainers, const std::string& mode,
                    int updates, uint64_t first_version, const std::string& model) {
  Status st = trainer_process(probe_port, coordinator, rank, trainers, mode == "sharded", updates, first_version, model);
  if (!st.ok()) {
    fmt::print(stderr, "bench e2e trainer {}: {}\n", rank, st.to_string());
    return 1;
  }
  return 0;
}

}  // namespace ferry
