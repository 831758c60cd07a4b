#include "examples/async_rl/async_rl.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "examples/tiny_decoder/decoder.h"
#include "reload/engine.h"

namespace async_rl {
namespace {

using ferry::Result;
using ferry::Status;
using Clock = std::chrono::steady_clock;

std::atomic<uint64_t> g_seq{0};

// One rollout replica: its storage, a RolloutWorker that loads updates into it, and a generator
// thread replaying the tiny decoder's captured decode step token by token.
class Replica {
 public:
  Replica(int index, const tiny::Config& cfg, const Options& options) : index_(index), cfg_(cfg), options_(options) {}
  ~Replica() { stop(); }

  Status start(const std::string& coordinator) {
    FERRY_ASSIGN_OR_RETURN(spec_, tiny::rank_spec(cfg_, options_.scheme));
    spec_.replica = index_;  // each replica its own (TP 1): a second "replica 0 rank 0" would replace the first
    FERRY_ASSIGN_OR_RETURN(auto storage, ferry::reload::ModelStorage::allocate(spec_, ferry::Device::cpu()));
    storage_ = std::make_unique<ferry::reload::ModelStorage>(std::move(storage));
    // The decoder takes its tensors from a registry over the same storage the worker updates.
    FERRY_ASSIGN_OR_RETURN(registry_, ferry::reload::ReloadEngine::create(spec_, *storage_));
    FERRY_ASSIGN_OR_RETURN(decoder_, tiny::Decoder::create(cfg_, spec_, registry_->registry()));
    ferry::coordinator::RolloutOptions o;
    o.coordinator = coordinator;
    o.spec = spec_;
    o.storage = storage_.get();
    o.pause = [this](const ferry::coordinator::PauseRequest& r) { return pause(r); };
    o.resume = [this](uint64_t v) { return resume(v); };
    FERRY_ASSIGN_OR_RETURN(worker_, ferry::coordinator::RolloutWorker::create(std::move(o)));
    thread_ = std::thread([this] { generate(); });
    return ferry::ok_status();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Blocks until this replica generated `n` tokens tagged `version`, or `deadline`.
  Status wait_tokens(uint64_t version, uint64_t n, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return tokens_[version] >= n || !error_.ok(); })) {
      return Status::deadline_exceeded(
          fmt::format("replica {}: {} of {} tokens at v{}", index_, tokens_[version], n, version));
    }
    return error_;
  }

  std::vector<Event> events() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  double frozen_seconds(uint64_t version) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = frozen_seconds_.find(version);
    return it == frozen_seconds_.end() ? 0.0 : it->second;
  }
  Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  // pause(keep): returns once generation is frozen between two tokens; nothing reads the weights
  // until resume.
  Status pause(const ferry::coordinator::PauseRequest& r) {
    std::lock_guard<std::mutex> lock(mu_);
    if (r.mode != "keep") return Status::invalid_argument(fmt::format("replica {}: pause mode {}", index_, r.mode));
    frozen_ = true;
    clear_cache_ = r.clear_cache;
    paused_at_ = Clock::now();
    events_.push_back(Event{Event::kPause, r.version, g_seq++, 0, 0});
    return ferry::ok_status();
  }

  Status resume(uint64_t version) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (frozen_) frozen_seconds_[version] = std::chrono::duration<double>(Clock::now() - paused_at_).count();
      frozen_ = false;
      hook_version_ = version;
      events_.push_back(Event{Event::kResume, version, g_seq++, 0, 0});
    }
    cv_.notify_all();
    return ferry::ok_status();
  }

  void fail(Status st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = std::move(st);
    }
    cv_.notify_all();
  }

  void generate() {
    const std::vector<int32_t> prompt{1, static_cast<int32_t>(17 + index_), 42, 7};
    int32_t next = 0, pos = 0;
    size_t fed = 0;  // prompt tokens fed into the current sequence
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !frozen_; });
      if (stop_) return;
      // The resume hook runs before the worker records the new version; the worker serves (and
      // reports that version) right after. Generation waits for that, so every tag is the
      // version the storage holds. Before the first version lands the worker does not serve.
      if (worker_->paused()) {
        lock.unlock();
        Status st = worker_->wait_serving(options_.timeout_ms);
        if (!st.ok()) return fail(st);
        continue;
      }
      if (clear_cache_) {
        clear_cache_ = false;
        pos = 0;
        fed = 0;
      }
      if (pos >= static_cast<int32_t>(cfg_.max_seq)) pos = 0, fed = 0;  // a new sequence
      const int32_t in = fed < prompt.size() ? prompt[fed++] : next;
      const uint64_t version = worker_->weight_version();
      auto out = decoder_->step(in, pos++);
      if (!out.ok()) {
        lock.unlock();
        return fail(out.status());
      }
      next = *out;
      if (fed >= prompt.size()) {
        events_.push_back(Event{Event::kToken, version, g_seq++, next, hook_version_});
        ++tokens_[version];
        lock.unlock();
        cv_.notify_all();
      }
    }
  }

  const int index_;
  const tiny::Config cfg_;
  const Options options_;
  ferry::sharding::RankSpec spec_;
  std::unique_ptr<ferry::reload::ModelStorage> storage_;
  std::unique_ptr<ferry::reload::ReloadEngine> registry_;
  std::unique_ptr<tiny::Decoder> decoder_;
  std::unique_ptr<ferry::coordinator::RolloutWorker> worker_;
  std::thread thread_;

  mutable std::mutex mu_;  // the generation gate: a token is generated holding it
  std::condition_variable cv_;
  bool stop_ = false;
  bool frozen_ = false;
  bool clear_cache_ = false;
  uint64_t hook_version_ = 0;
  std::map<uint64_t, uint64_t> tokens_;  // per version
  Clock::time_point paused_at_;
  std::map<uint64_t, double> frozen_seconds_;
  std::vector<Event> events_;
  Status error_;
};

}  // namespace

Result<RunLog> run(const Options& options) {
  if (options.replicas < 1 || options.updates < 0 || options.steps_per_update < 1 || options.tokens_per_step < 1) {
    return Status::invalid_argument("async_rl: replicas, steps and tokens must be positive");
  }
  const tiny::Config cfg;
  FERRY_ASSIGN_OR_RETURN(auto spec, tiny::rank_spec(cfg, options.scheme));
  FERRY_ASSIGN_OR_RETURN(auto trainer, ferry::coordinator::Trainer::create({}));
  std::vector<std::unique_ptr<Replica>> replicas;
  for (int r = 0; r < options.replicas; ++r) {
    replicas.push_back(std::make_unique<Replica>(r, cfg, options));
    FERRY_RETURN_IF_ERROR(replicas.back()->start(trainer->coordinator_address()));
  }
  FERRY_RETURN_IF_ERROR(trainer->wait_for_ranks(options.replicas, options.timeout_ms));

  RunLog log;
  ferry::coordinator::UpdateOptions keep;
  keep.pause_mode = "keep";
  keep.clear_cache = options.clear_cache;
  // Training steps on the rollouts of the current version: each step consumes a batch of tokens
  // of that version from every replica, which keeps generating meanwhile.
  auto train = [&](uint64_t version, int steps) -> Status {
    for (int s = 1; s <= steps; ++s) {
      const auto deadline = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
      for (auto& r : replicas) {
        FERRY_RETURN_IF_ERROR(r->wait_tokens(version, static_cast<uint64_t>(s * options.tokens_per_step), deadline));
      }
    }
    return ferry::ok_status();
  };
  Status st;
  for (uint64_t v = 1; st.ok() && v <= static_cast<uint64_t>(options.updates) + 1; ++v) {
    if (v > 1) {
      st = train(v - 1, options.steps_per_update);
      if (!st.ok()) break;
    }
    // The trainer's new weights: the checkpoint of step v.
    FERRY_ASSIGN_OR_RETURN(auto weights, tiny::Weights::random(cfg, spec, v));
    ferry::coordinator::MapSource source(weights.checkpoint());
    st = trainer->start_weight_update(v, spec.expects, keep);
    if (st.ok()) st = trainer->update_weights(source);
    if (!st.ok()) break;
    auto report = trainer->finish_weight_update();
    if (!report.ok()) {
      st = report.status();
      break;
    }
    log.published.push_back(v);
    UpdateStats u{v, report->pause_seconds, report->seconds, {}};
    for (auto& r : replicas) u.frozen_seconds.push_back(r->frozen_seconds(v));
    log.updates.push_back(std::move(u));
  }
  // The last version gets its steps too.
  if (st.ok() && !log.published.empty()) st = train(log.published.back(), options.steps_per_update);
  for (auto& r : replicas) {
    r->stop();
    if (st.ok()) st = r->error();
    log.replicas.push_back(r->events());
  }
  replicas.clear();
  trainer.reset();
  if (!st.ok()) return st;
  return log;
}

void print_summary(const RunLog& log) {
  for (const UpdateStats& u : log.updates) {
    std::string frozen;
    for (size_t r = 0; r < u.frozen_seconds.size(); ++r) {
      frozen += fmt::format("{}r{} {:.2f} ms", r ? ", " : "", r, u.frozen_seconds[r] * 1e3);
    }
    fmt::print("update v{}: pause {:.2f} ms, update {:.2f} ms, frozen {}\n", u.version, u.pause_seconds * 1e3,
               u.seconds * 1e3, frozen.empty() ? "-" : frozen);
  }
  for (size_t r = 0; r < log.replicas.size(); ++r) {
    std::map<uint64_t, int> per;
    for (const Event& e : log.replicas[r]) {
      if (e.kind == Event::kToken) ++per[e.version];
    }
    std::string line;
    for (const auto& [v, n] : per) line += fmt::format(" v{}:{}", v, n);
    fmt::print("replica {} tokens per version:{}\n", r, line);
  }
}

}  // namespace async_rl
