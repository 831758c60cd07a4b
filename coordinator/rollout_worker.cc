#include "coordinator/rollout_worker.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "core/asio.h"
#include <fmt/format.h>

#include "core/log.h"
#include "core/settings.h"
#include "dataplane/bucket_receiver.h"
#include "coordinator/channel.h"
#include "coordinator/mailbox.h"
#include "coordinator/listen_transports.h"
#include "coordinator/member.h"
#include "coordinator/wire.h"
#include "reload/engine.h"
#include "transport/transport.h"

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;

class RolloutWorkerImpl final : public RolloutWorker {
 public:
  explicit RolloutWorkerImpl(RolloutOptions o)
      : options_(std::move(o)), work_(asio::make_work_guard(io_)), timer_(io_) {}

  ~RolloutWorkerImpl() override {
    {
      std::lock_guard<std::mutex> lock(closed_mu_);
      closing_ = true;  // this process ends the connection: nothing to report
    }
    heartbeat_.reset();
    if (channel_) channel_->close(Status::unavailable("rollout worker closed"));
    for (auto& t : transports_) t->shutdown();
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
    transports_.clear();
  }

  Status init() {
    FERRY_ASSIGN_OR_RETURN(const Settings settings, settings_or_environment(options_.settings));
    apply_process_settings(settings);
    if (options_.storage == nullptr) return Status::invalid_argument("RolloutOptions.storage is required");
    timeout_ms_ = settings.timeout_ms;
    verify_ = settings.verify;
    const std::string address = options_.coordinator.empty() ? settings.coordinator : options_.coordinator;
    if (address.empty()) return Status::invalid_argument("no coordinator address: set FERRY_COORDINATOR=host:port");
    reload::EngineOptions eo;
    eo.none_dtype = options_.storage->none_dtype();  // f32 or f16 storage is written as such
    eo.rollback = settings.rollback == "host" ? reload::RollbackMode::kHost : reload::RollbackMode::kOff;
    eo.max_staging_bytes = settings.max_staging_bytes;
    eo.delta_shadow = settings.delta_shadow != "off";
    eo.shadow_on_device = settings.delta_shadow == "device";
    FERRY_ASSIGN_OR_RETURN(engine_, reload::ReloadEngine::create(options_.spec, *options_.storage, std::move(eo)));
    device_ = options_.storage->device();
    receiver_ = std::make_unique<dataplane::BucketReceiver>(*engine_, device_, verify_);
    // Listen on every transport that may reach a sender (FERRY_TRANSPORT narrows it to one); the
    // sender connects with the first, in priority order, that reaches this rank.
    FERRY_ASSIGN_OR_RETURN(auto transports, create_listen_transports(settings));
    for (auto& t : transports) {
      // nccl and cuda_ipc hand the callback buckets in device memory of their device.
      const Device where = transport::bucket_device(t->capabilities());
      // Only the senders the coordinator announced for the current update are admitted (dataplane/credential.h).
      auto blob = t->listen([this, where](const transport::ReceivedBucket& b) { return on_bucket(b, where); },
                            [](const Status& why) {
                              if (!why.ok()) FERRY_LOG_WARN("data connection closed: {}", why.message());
                            },
                            [this](std::string_view credential) { return receiver_->admit(credential); });
      if (!blob.ok()) {
        FERRY_LOG_INFO("not listening on {}: {}", t->name(), blob.status().message());
        continue;
      }
      wire::Endpoint e;
      e.set_transport(std::string(t->name()));
      e.set_blob(*blob);
      endpoints_.push_back(std::move(e));
      transports_.push_back(std::move(t));
    }
    if (transports_.empty()) return Status::unavailable("no data transport could listen on this rank");
    thread_ = std::thread([this] { run_io(io_); });
    FERRY_ASSIGN_OR_RETURN(auto socket, connect_control(io_, address, timeout_ms_));
    channel_ = std::make_shared<Channel>(std::move(socket), settings.max_frame_bytes);
    channel_->start([this](const std::shared_ptr<Channel>&, wire::Envelope& e) { on_message(e); },
                    [this](const std::shared_ptr<Channel>&, const Status& why) { on_closed(why); });
    wire::Envelope hello;
    hello.mutable_hello()->set_role("rollout");
    hello.mutable_hello()->set_pid(static_cast<int32_t>(getpid()));
    wire::Envelope registration;
    auto* r = registration.mutable_registration();
    to_wire(options_.spec, r->mutable_spec());
    for (const auto& e : endpoints_) *r->add_endpoints() = e;
    r->set_storage_device(device_.to_string());
    r->set_max_staging_bytes(settings.max_staging_bytes);
    FERRY_ASSIGN_OR_RETURN(
        wire::Welcome welcome,
        join(*channel_, welcome_, std::move(hello), std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_),
             settings.token, registration));
    receiver_->set_receiver(welcome.member_id());
    heartbeat_ = std::make_unique<Heartbeat>(channel_, std::chrono::milliseconds(std::max<int64_t>(timeout_ms_ / 4, 1)));
    return ok_status();
  }

  uint64_t weight_version() const override { return version_.load(); }
  bool consistent() const override { return consistent_.load(); }
  bool paused() const override { return paused_.load(); }

  Status wait_serving(int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(serve_mu_);
    if (!serve_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !paused_.load(); })) {
      return Status::deadline_exceeded(fmt::format("rank still paused after {} ms (weight version {}{})", timeout_ms,
                                                   version_.load(), consistent_ ? "" : ", inconsistent"));
    }
    return ok_status();
  }

  Status wait_closed(int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(closed_mu_);
    if (!closed_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return closed_; })) {
      return Status::deadline_exceeded("coordinator still connected");
    }
    return ended_;
  }

  std::vector<DataEndpoint> data_endpoints() const override {
    std::vector<DataEndpoint> out;
    for (const auto& e : endpoints_) out.push_back({e.transport(), e.blob()});
    return out;
  }

  Status resume() override {
    std::lock_guard<std::mutex> hooks(hooks_mu_);
    const uint64_t v = version_.load();
    if (!consistent_.load()) {
      return Status::failed_precondition(
          fmt::format("resume(): this rank holds no complete version (last complete v{}); it waits for an update", v));
    }
    if (!paused_.load()) return ok_status();
    return run_resume_hook(v);
  }

 private:
  void reply(wire::Envelope& env) { channel_->send(env); }

  void on_message(wire::Envelope& env) {
    switch (env.body_case()) {
      case wire::Envelope::kChallenge:
      case wire::Envelope::kWelcome: return welcome_.push(std::move(env));
      case wire::Envelope::kPause: return on_pause(env.pause());
      case wire::Envelope::kFinalize: return on_finalize(env.finalize());
      case wire::Envelope::kApply: return on_apply(env.apply());
      case wire::Envelope::kResume: return on_resume(env.resume());
      case wire::Envelope::kAbort: return on_abort(env.abort());
      case wire::Envelope::kGoodbye: {
        std::lock_guard<std::mutex> lock(closed_mu_);
        goodbye_ = true;
        return;
      }
      default: FERRY_LOG_WARN("unexpected control message {}", static_cast<int>(env.body_case()));
    }
  }

  void on_pause(const wire::Pause& p) {
    std::lock_guard<std::mutex> hooks(hooks_mu_);
    {
      std::map<int, std::string> senders;
      for (const auto& s : p.senders()) senders[s.member_id()] = s.key();
      receiver_->set_senders(std::move(senders));
    }
    Status st;
    uint64_t delta_base = 0;
    // A staged update does not pause now: the rank serves on while the version arrives into
    // staging, and pauses when told to apply it.
    staging_ = p.stage();
    pause_request_ = PauseRequest{p.version(), p.mode(), p.clear_cache()};
    if (options_.pause && !staging_) st = options_.pause(pause_request_);
    if (!staging_) paused_ = true;
    if (st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      st = engine_->begin(p.version(), std::max(p.senders_size(), 1), staging_);
      if (st.ok()) delta_base = engine_->update_delta_base();
      // From here storage is being rewritten: the rank serves nothing until a complete version lands.
      if (!staging_) consistent_ = false;
      update_version_ = p.version();
      completed_ = false;
      received_ = 0;
      expected_ = -1;
      finalized_ = false;
      bucket_error_ = Status();
    }
    wire::Envelope env;
    env.mutable_pause_ack()->set_version(p.version());
    to_wire(st, env.mutable_pause_ack()->mutable_status());
    env.mutable_pause_ack()->set_delta_base(delta_base);
    reply(env);
  }

  void on_finalize(const wire::Finalize& f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (f.version() != update_version_) return;
      expected_ = static_cast<int64_t>(f.buckets());
      if (received_ < expected_) {
        timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
        timer_.async_wait([this, v = f.version()](boost::system::error_code ec) {
          if (!ec) finalize(v, true);
        });
        return;
      }
    }
    finalize(f.version(), false);
  }

  // Runs on the I/O thread once every announced bucket arrived, or when the deadline passes.
  void finalize(uint64_t version, bool deadline) {
    wire::Envelope env;
    auto* out = env.mutable_finalized();
    out->set_version(version);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finalized_ || version != update_version_) return;
      finalized_ = true;
      timer_.cancel();
      Status st = bucket_error_;
      if (st.ok() && deadline) {
        st = Status::deadline_exceeded(fmt::format("received {} of {} buckets of update v{} within FERRY_TIMEOUT_MS",
                                                   received_, expected_, version));
      }
      if (st.ok() && staging_) {
        out->set_staged(true);  // every byte is here; the rank serves the old version until Apply
      } else if (st.ok()) {
        st = finalize_engine(out);
      } else {
        engine_->abort();
      }
      if (!st.ok()) FERRY_LOG_ERROR("update v{} failed on this rank: {}", version, st.message());
      to_wire(st, out->mutable_status());
    }
    reply(env);
  }

  // The caller holds mu_.
  Status finalize_engine(wire::Finalized* out) {
    auto r = engine_->finalize();
    completed_ = r.ok();
    if (r.ok()) {
      out->set_moved(r->census.moved);
      out->set_registered(r->census.registered);
      out->set_bytes(r->bytes);
      out->set_peak_staging_bytes(r->peak_staging_bytes);
      out->set_allocated_staging_bytes(r->allocated_staging_bytes);
      out->set_process_seconds(r->process_seconds);
      out->set_delta_base(engine_->delta_base());
      out->set_delta_pieces(r->delta_pieces);
      out->set_shadow_bytes(r->shadow_bytes);
    }
    return r.status();
  }

  // A staged update: every rank of the replica holds every byte. The rank pauses now, writes the
  // staged layers into storage, and finalizes.
  void on_apply(const wire::Apply& a) {
    std::lock_guard<std::mutex> hooks(hooks_mu_);
    wire::Envelope env;
    auto* out = env.mutable_finalized();
    out->set_version(a.version());
    Status st;
    if (!staging_ || a.version() != update_version_) {
      st = Status::failed_precondition(fmt::format("apply of v{}: this rank stages no such update", a.version()));
    } else {
      staging_ = false;
      if (options_.pause) st = options_.pause(pause_request_);
      paused_ = true;
      std::lock_guard<std::mutex> lock(mu_);
      consistent_ = false;  // storage is being rewritten from here
      if (st.ok()) st = engine_->apply_staged();
      if (st.ok()) {
        st = finalize_engine(out);
      } else {
        engine_->abort();
      }
    }
    if (!st.ok()) FERRY_LOG_ERROR("applying staged update v{} failed on this rank: {}", a.version(), st.message());
    to_wire(st, out->mutable_status());
    reply(env);
  }

  void on_resume(const wire::Resume& r) {
    std::lock_guard<std::mutex> hooks(hooks_mu_);
    // The version is set before the hook runs: code the hook wakes must read the new version.
    version_ = r.version();
    consistent_ = true;
    run_resume_hook(r.version()).ignore_error();
  }

  // Runs the engine's resume hook and tells the coordinator how it went. A failing hook leaves the
  // rank paused, at `version` complete, and its replica not serving (the update fails, naming it).
  // The caller holds hooks_mu_.
  Status run_resume_hook(uint64_t version) {
    Status st;
    if (options_.resume) st = options_.resume(version);
    if (!st.ok()) {
      FERRY_LOG_ERROR("resume hook failed at v{}: {}; this rank stays paused (RolloutWorker::resume() retries it)",
                      version, st.message());
    } else {
      {
        std::lock_guard<std::mutex> lock(serve_mu_);
        paused_ = false;
      }
      serve_cv_.notify_all();
    }
    wire::Envelope env;
    env.mutable_resume_ack()->set_version(version);
    to_wire(st, env.mutable_resume_ack()->mutable_status());
    reply(env);
    return st;
  }

  void on_abort(const wire::Abort& a) {
    std::lock_guard<std::mutex> hooks(hooks_mu_);
    wire::Envelope env;
    auto* ack = env.mutable_abort_ack();
    ack->set_version(a.version());
    const bool staged = staging_;
    staging_ = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      engine_->abort();
      finalized_ = true;
      timer_.cancel();
      if (staged) {
        // It never paused: storage still holds the version it serves.
        FERRY_LOG_ERROR("update v{} aborted while staging; still serving v{}: {}", a.version(), version_.load(),
                        a.reason());
        reply(env);
        return;
      }
      consistent_ = false;
      if (completed_) {
        // Its storage holds the aborted update complete (the engine let its snapshots go at
        // finalize): there is nothing to restore, and claiming the previous version would let the
        // replica resume on a mix of versions. It stays paused until a complete update lands.
        FERRY_LOG_ERROR("update v{} aborted after this rank finalized it: no rollback; paused", a.version());
      } else if (engine_->rollback_mode() == reload::RollbackMode::kHost) {
        // Storage goes back to the last complete version, in place; the coordinator resumes the
        // replica at it once every rank has done the same.
        Status st = engine_->rollback();
        to_wire(st, ack->mutable_status());
        ack->set_rolled_back(st.ok());
        ack->set_serving_version(version_.load());
        if (!st.ok()) FERRY_LOG_ERROR("rollback after update v{} failed: {}", a.version(), st.message());
      }
    }
    FERRY_LOG_ERROR("update v{} aborted; {}: {}", a.version(),
                    ack->rolled_back() ? "restored the previous version" : "staying paused until a complete update lands",
                    a.reason());
    reply(env);
  }

  void on_closed(const Status& why) {
    bool mid_update = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      mid_update = engine_->in_update();
      if (mid_update) {
        engine_->abort();
        if (!staging_) consistent_ = false;  // a staging rank's storage holds what it served
      }
    }
    welcome_.close(why);
    {
      std::lock_guard<std::mutex> lock(closed_mu_);
      closed_ = true;
      if ((!goodbye_ || mid_update) && !closing_) {
        // The coordinator went away without ending the job: say in what state it left this rank.
        const uint64_t v = version_.load();
        const std::string state =
            !consistent_.load()
                ? (mid_update ? fmt::format("paused on an incomplete version (update v{} was under way; no complete "
                                            "version in storage since v{})",
                                            update_version_, v)
                              : fmt::format("paused, holding no complete version (last complete v{})", v))
            : paused_.load() ? fmt::format("paused at v{} complete", v)
                             : fmt::format("serving v{} complete", v);
        ended_ = Status::unavailable(fmt::format("{} ({}); this rank is {}",
                                                 goodbye_ ? "the job ended" : "lost the coordinator", why.message(), state));
        FERRY_LOG_ERROR("{}", ended_.message());
      }
    }
    closed_cv_.notify_all();
  }

  // Runs on the transport's thread: the receiver decodes and checks the bucket, then takes its
  // pieces under the engine's lock; the count decides when the rank can finalize.
  Status on_bucket(const transport::ReceivedBucket& bucket, Device where) {
    const auto decoded = receiver_->decode(bucket, where);
    std::lock_guard<std::mutex> lock(mu_);
    Status st;
    if (!receiver_->take(decoded, bucket, where, update_version_, &st)) return ok_status();  // a stale update's
    if (!st.ok() && bucket_error_.ok()) bucket_error_ = st;
    ++received_;
    if (expected_ >= 0 && received_ >= expected_ && !finalized_) {
      asio::post(io_, [this, v = update_version_] { finalize(v, false); });
    }
    return ok_status();
  }

  RolloutOptions options_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  asio::steady_timer timer_;
  std::thread thread_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<Heartbeat> heartbeat_;
  Mailbox welcome_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::vector<wire::Endpoint> endpoints_;
  int64_t timeout_ms_ = 0;
  bool verify_ = false;

  // The engine's hooks and the state they go with (paused_, consistent_, version_) change under
  // this: a resume() retried on a user's thread never interleaves with the next update's pause.
  std::mutex hooks_mu_;
  std::mutex mu_;  // engine and update counters
  std::unique_ptr<reload::ReloadEngine> engine_;
  Device device_ = Device::cpu();                      // of the storage
  std::unique_ptr<dataplane::BucketReceiver> receiver_;  // admission, and buckets into the engine
  uint64_t update_version_ = 0;
  int64_t received_ = 0;
  int64_t expected_ = -1;
  bool finalized_ = false;
  Status bucket_error_;
  // The update in progress stages while the rank serves (Pause.stage) and has not been applied;
  // the pause hook's request waits for the Apply. Under hooks_mu_.
  std::atomic<bool> staging_{false};
  bool completed_ = false;  // the update in progress finalized here (under mu_)
  PauseRequest pause_request_;

  // A rank serves nothing until its first complete version lands.
  std::atomic<uint64_t> version_{0};
  std::atomic<bool> consistent_{false};
  std::atomic<bool> paused_{true};
  std::mutex serve_mu_;
  std::condition_variable serve_cv_;


  std::mutex closed_mu_;
  std::condition_variable closed_cv_;
  bool closed_ = false;
  bool goodbye_ = false;  // the coordinator ended the job
  bool closing_ = false;  // this worker is being destroyed
  Status ended_;          // how the connection to the coordinator ended (OK: the job ended)
};

}  // namespace

Result<std::unique_ptr<RolloutWorker>> RolloutWorker::create(RolloutOptions options) {
  auto w = std::make_unique<RolloutWorkerImpl>(std::move(options));
  FERRY_RETURN_IF_ERROR(w->init());
  return std::unique_ptr<RolloutWorker>(std::move(w));
}

}  // namespace ferry::coordinator
