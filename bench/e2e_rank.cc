// A rollout rank process of `ferry bench e2e` (`ferry bench e2e-rank`, started by the bench): a
// RolloutWorker that serves the bench's updates, and between them answers the bench's link probes
// from this process: control round trips over ferry's control channel, this rank's processing of
// its own pieces through a reload engine of its own, and buckets received over the transport under
// test. It exits when the coordinator goes away.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/e2e_bench.h"
#include "bench/e2e_links.h"
#include "bench/e2e_probe.h"
#include "coordinator/channel.h"
#include "coordinator/rollout_worker.h"
#include "core/asio.h"
#include "core/log.h"
#include "core/settings.h"
#include "core/work_pool.h"
#include "examples/demo/llama_config.h"
#include "reload/engine.h"
#include "reload/model_storage.h"
#include "sharding/llama.h"
#include "sharding/trainer_layouts.h"
#include "transport/transport.h"

namespace ferry {
namespace {

using e2e::Clock;
using namespace std::chrono_literals;

// Answers the bench's control messages on this process's own I/O thread, as a rank answers the
// coordinator: a Pause with a PauseAck.
class ControlEcho {
 public:
  ControlEcho() : work_(boost::asio::make_work_guard(io_)) {}
  ~ControlEcho() {
    if (channel_) channel_->close(Status::unavailable("probe done"));
    work_.reset();
    if (thread_.joinable()) thread_.join();
  }

  Status start(uint16_t port) {
    thread_ = std::thread([this] { io_.run(); });
    FERRY_ASSIGN_OR_RETURN(auto socket, coordinator::connect_control(io_, fmt::format("127.0.0.1:{}", port), 10'000));
    channel_ = std::make_shared<coordinator::Channel>(std::move(socket), 1u << 20);
    channel_->start(
        [](const std::shared_ptr<coordinator::Channel>& ch, wire::Envelope& e) {
          if (!e.has_pause()) return;
          wire::Envelope out;
          out.mutable_pause_ack()->set_version(e.pause().version());
          ch->send(out);
        },
        [](const std::shared_ptr<coordinator::Channel>&, const Status&) {});
    return ok_status();
  }

 private:
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::thread thread_;
  std::shared_ptr<coordinator::Channel> channel_;
};

// This rank's pieces as the plan of `senders` trainer ranks (each holding FSDP2 Shard(0) rows of
// every tensor; 1: one trainer holding everything) cuts them into buckets, the senders' buckets
// taken in turn (bucket k of every sender, then k + 1, as streams of equal pace arrive), bf16, new
// values before every run, as every update brings; processed through a reload engine of its own
// over storage of its own, each bucket borrowed and released as a rank does a host bucket's valid
// for the transport's callback, or (`handed_over`: the transport hands its buckets over, as tcp
// does) lent until its layers are processed, where the engine takes lent pieces.
class ProcessProbe {
 public:
  static Result<std::unique_ptr<ProcessProbe>> make(const sharding::LlamaConfig& cfg, const sharding::RankSpec& spec,
                                                    const std::vector<sharding::RankSpec>& specs, int senders,
                                                    bool handed_over) {
    FERRY_ASSIGN_OR_RETURN(const Settings settings, load_settings());
    FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cpu()));
    auto p = std::unique_ptr<ProcessProbe>(new ProcessProbe(std::move(storage), spec.tp_rank));
    FERRY_ASSIGN_OR_RETURN(p->engine_, reload::ReloadEngine::create(spec, p->storage_));
    p->lend_ = handed_over && p->engine_->lends_host_pieces();  // as dataplane/bucket_receiver.cc decides
    const sharding::Manifest manifest = sharding::llama_manifest(cfg);
    std::vector<sharding::SenderInfo> holdings;
    if (senders <= 1) {
      holdings.push_back(sharding::SenderInfo{});
    } else {
      for (int r = 0; r < senders; ++r) holdings.push_back(sharding::fsdp_holdings(manifest, r, senders));
    }
    FERRY_ASSIGN_OR_RETURN(
        const sharding::Plan plan,
        sharding::make_plan(manifest, specs, holdings, sharding::PlanOptions{settings.bucket_bytes}));
    // This rank's buckets per sender, in plan order; then taken in turn.
    std::vector<std::vector<const sharding::Bucket*>> streams(holdings.size());
    for (const auto& b : plan.buckets) {
      if (b.dst == spec.tp_rank) streams[static_cast<size_t>(b.sender)].push_back(&b);
    }
    size_t longest = 0;
    for (const auto& st : streams) longest = std::max(longest, st.size());
    std::vector<const sharding::Bucket*> order;
    for (size_t k = 0; k < longest; ++k) {
      for (const auto& st : streams) {
        if (k < st.size()) order.push_back(st[k]);
      }
    }
    for (const sharding::Bucket* b : order) {
      auto& parts = p->buckets_.emplace_back();
      for (const auto& bp : b->parts) {
        const sharding::Piece& pc = plan.pieces[static_cast<size_t>(bp.piece)];
        const auto& param = spec.params[static_cast<size_t>(pc.param)];
        if (param.source_dtype != DType::kBF16) return Status::invalid_argument("bench e2e sends bf16 weights only");
        const Region dst = sharding::piece_dst_region(pc, param);
        const auto [src, part_dst] = sharding::part_regions(pc.src, dst, bp.first_row, bp.rows);
        parts.push_back({static_cast<uint32_t>(pc.param), part_dst,
                         std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(src.numel()))});
        p->bytes_ += parts.back().data->size() * 2;
      }
    }
    return p;
  }

  uint64_t bytes() const { return bytes_; }

  // New values for the next run(), as every update brings.
  void refill() {
    std::vector<std::vector<uint16_t>*> parts;
    for (auto& bucket : buckets_) {
      for (auto& pc : bucket) parts.push_back(pc.data.get());
    }
    ++fills_;
    run_pieces(parts.size(), [&](size_t k) { e2e::fill_bf16(*parts[k], seed_ + (fills_ << 32) + k); });
  }

  // One whole update of the values refill() made (begin, every bucket, finalize); its seconds.
  Result<double> run() {
    const auto t0 = Clock::now();
    FERRY_RETURN_IF_ERROR(engine_->begin(++version_));
    for (const auto& bucket : buckets_) {
      for (const auto& pc : bucket) {
        const size_t n = pc.data->size() * 2;
        FERRY_RETURN_IF_ERROR(lend_
                                  ? engine_->lend_piece(pc.param, 0, pc.dst, DType::kBF16, pc.data, pc.data->data(), n)
                                  : engine_->borrow_piece(pc.param, 0, pc.dst, DType::kBF16, pc.data->data(), n));
      }
      FERRY_RETURN_IF_ERROR(engine_->release_borrowed());
    }
    FERRY_RETURN_IF_ERROR(engine_->finalize().status());
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // Median seconds of `runs` runs after one that warms the engine's pools and the pages.
  Result<double> median_of(int runs) {
    std::vector<double> t;
    for (int r = 0; r <= runs; ++r) {
      refill();
      FERRY_ASSIGN_OR_RETURN(const double s, run());
      if (r > 0) t.push_back(s);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

 private:
  ProcessProbe(reload::ModelStorage storage, int rank)
      : storage_(std::move(storage)), seed_(0x2545f4914f6cdd1dull * static_cast<uint64_t>(rank + 1)) {}

  struct Part {
    uint32_t param;
    Region dst;
    std::shared_ptr<std::vector<uint16_t>> data;
  };
  reload::ModelStorage storage_;
  std::unique_ptr<reload::ReloadEngine> engine_;
  bool lend_ = false;
  std::vector<std::vector<Part>> buckets_;
  uint64_t bytes_ = 0;
  uint64_t seed_;
  uint64_t fills_ = 0;
  uint64_t version_ = 0;
};

// Counts buckets arriving over the transport; tells the bench when the expected number arrived.
class TransportSink {
 public:
  explicit TransportSink(e2e::ProbeSocket& probe, std::mutex& send_mu) : probe_(probe), send_mu_(send_mu) {}
  ~TransportSink() {
    if (transport_) transport_->shutdown();
  }

  Result<std::string> listen(const std::string& name) {
    FERRY_ASSIGN_OR_RETURN(transport_, transport::create_transport(name));
    return transport_->listen(
        [this](const transport::ReceivedBucket& bucket) {
          handed_over_.store(bucket.owner != nullptr);
          std::lock_guard<std::mutex> lock(mu_);
          if (++received_ == expected_) {
            std::lock_guard<std::mutex> send_lock(send_mu_);
            (void)probe_.send("received");
          }
          return ok_status();
        },
        [](const Status&) {}, nullptr);
  }
  void expect(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    received_ = 0;
    expected_ = n;
  }
  void close() {
    if (transport_) transport_->shutdown();
    transport_.reset();
  }
  // Whether the last bucket received came with its owner (the transport hands its buckets over, so
  // the rank's engine may keep their bytes): false until one arrives.
  bool hands_over() const { return handed_over_.load(); }

 private:
  e2e::ProbeSocket& probe_;
  std::mutex& send_mu_;
  std::unique_ptr<transport::Transport> transport_;
  std::mutex mu_;
  int64_t received_ = 0;
  int64_t expected_ = -1;
  std::atomic<bool> handed_over_{false};
};

Status serve(uint16_t probe_port, const std::string& coordinator, int rank, int tp, const std::string& scheme,
             const std::string& transport, const std::string& model) {
  set_log_identity(fmt::format("bench rank {}", rank));
  FERRY_ASSIGN_OR_RETURN(const sharding::LlamaConfig cfg, e2e::model_config(model));
  FERRY_ASSIGN_OR_RETURN(auto specs, e2e::demo_rank_specs(cfg, tp, scheme));
  const sharding::RankSpec spec = specs.at(static_cast<size_t>(rank));
  FERRY_ASSIGN_OR_RETURN(auto probe, e2e::ProbeSocket::connect(probe_port));
  std::mutex send_mu;
  auto reply = [&](const std::string& s) {
    std::lock_guard<std::mutex> lock(send_mu);
    return probe.send(s);
  };
  // The rank itself: joins the coordinator and serves updates on its own threads, between which
  // the bench measures the links.
  FERRY_ASSIGN_OR_RETURN(auto storage, reload::ModelStorage::allocate(spec, Device::cpu()));
  coordinator::RolloutOptions o;
  o.coordinator = coordinator;
  o.spec = spec;
  o.storage = &storage;
  FERRY_ASSIGN_OR_RETURN(auto worker, coordinator::RolloutWorker::create(std::move(o)));
  FERRY_RETURN_IF_ERROR(reply(fmt::format("hello {}", rank)));

  std::unique_ptr<ControlEcho> echo;
  TransportSink sink(probe, send_mu);
  for (bool done = false; !done;) {
    // Generous: the bench may spend a while on the other ranks' probes and on the updates.
    FERRY_ASSIGN_OR_RETURN(std::string frame, probe.recv(Clock::now() + 600s));
    std::string_view rest;
    const std::string_view cmd = e2e::command_of(frame, &rest);
    if (cmd == "control") {
      echo = std::make_unique<ControlEcho>();
      FERRY_RETURN_IF_ERROR(echo->start(static_cast<uint16_t>(std::stoi(std::string(rest)))));
      FERRY_RETURN_IF_ERROR(reply("ok"));
    } else if (cmd == "process") {
      // "process RUNS [SENDERS]"
      int runs = 0, senders = 1;
      if (std::sscanf(std::string(rest).c_str(), "%d %d", &runs, &senders) < 1 || runs < 1 || senders < 1) {
        return Status::invalid_argument(fmt::format("bench rank: malformed process probe '{}'", rest));
      }
      // Lent as the receiving side does with buckets handed over (seen from the transport's own
      // buckets in the bench's earlier rounds), when lending saves the engine work.
      FERRY_ASSIGN_OR_RETURN(auto p, ProcessProbe::make(cfg, spec, specs, senders, sink.hands_over()));
      FERRY_ASSIGN_OR_RETURN(const double seconds, p->median_of(runs));
      FERRY_RETURN_IF_ERROR(reply(fmt::format("processed {} {:.9f}", p->bytes(), seconds)));
    } else if (cmd == "overlap") {
      // "overlap SENDERS": made and warmed, then one run from "go", while the bench packs and
      // sends (the host's stages at once); "processed" may come before or after "received".
      int senders = 1;
      if (std::sscanf(std::string(rest).c_str(), "%d", &senders) != 1 || senders < 1) {
        return Status::invalid_argument(fmt::format("bench rank: malformed overlap probe '{}'", rest));
      }
      FERRY_ASSIGN_OR_RETURN(auto p, ProcessProbe::make(cfg, spec, specs, senders, sink.hands_over()));
      p->refill();
      FERRY_RETURN_IF_ERROR(p->run().status());
      p->refill();  // made before "go": the timed run processes, as an update's rank does
      FERRY_RETURN_IF_ERROR(reply("prepared"));
      FERRY_ASSIGN_OR_RETURN(std::string go, probe.recv(Clock::now() + 60s));
      if (go != "go") return Status::invalid_argument(fmt::format("bench rank: '{}' where 'go' was expected", go));
      FERRY_ASSIGN_OR_RETURN(const double seconds, p->run());
      FERRY_RETURN_IF_ERROR(reply(fmt::format("processed {} {:.9f}", p->bytes(), seconds)));
    } else if (cmd == "listen") {
      FERRY_ASSIGN_OR_RETURN(std::string blob, sink.listen(transport));
      FERRY_RETURN_IF_ERROR(reply("blob " + blob));
    } else if (cmd == "expect") {
      sink.expect(std::stoll(std::string(rest)));
      FERRY_RETURN_IF_ERROR(reply("ok"));
    } else if (cmd == "done") {
      done = true;
    } else {
      return Status::invalid_argument(fmt::format("bench rank: unexpected probe command '{}'", cmd));
    }
  }
  echo.reset();
  sink.close();
  // Serve until the bench's trainer (and its coordinator) goes away.
  Status end;
  while ((end = worker->wait_closed(60'000)).code() == StatusCode::kDeadlineExceeded) {
  }
  return end;
}

}  // namespace

int run_e2e_rank(uint16_t probe_port, const std::string& coordinator, int rank, int tp, const std::string& scheme,
                 const std::string& transport, const std::string& model) {
  Status st = serve(probe_port, coordinator, rank, tp, scheme, transport, model);
  if (!st.ok()) {
    fmt::print(stderr, "bench e2e rank {}: {}\n", rank, st.to_string());
    return 1;
  }
  return 0;
}

}  // namespace ferry
