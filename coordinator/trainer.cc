#include "coordinator/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <thread>

#include "core/asio.h"
#include <fmt/format.h>
#include <xxhash.h>

#include "core/log.h"
#include "core/settings.h"
#include "dataplane/bucket_sender.h"
#include "coordinator/channel.h"
#include "coordinator/coordinator.h"
#include "coordinator/local_holdings.h"
#include "coordinator/mailbox.h"
#include "coordinator/member.h"
#include "coordinator/wire.h"
#include "sharding/planner.h"
#include "transport/ipc_share.h"
#include "transport/transport.h"

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// XXH3-64 over every tensor's name, dtype and shape, in order.
uint64_t manifest_digest(const sharding::Manifest& manifest) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const auto& t : manifest) {
    XXH3_64bits_update(st, t.name.data(), t.name.size() + 1);
    const auto d = static_cast<int64_t>(t.dtype);
    XXH3_64bits_update(st, &d, sizeof d);
    const int64_t rank = static_cast<int64_t>(t.shape.size());
    XXH3_64bits_update(st, &rank, sizeof rank);
    XXH3_64bits_update(st, t.shape.data(), t.shape.size() * sizeof(int64_t));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h == 0 ? 1 : h;  // 0 means "no digest"
}

class TrainerImpl final : public Trainer {
 public:
  explicit TrainerImpl(TrainerOptions o) : options_(std::move(o)), work_(asio::make_work_guard(io_)) {}

  ~TrainerImpl() override {
    heartbeat_.reset();
    if (channel_) channel_->close(Status::unavailable("trainer closed"));
    sender_.reset();
    work_.reset();
    if (thread_.joinable()) thread_.join();
    if (embedded_) embedded_->stop();
  }

  Status init() {
    FERRY_ASSIGN_OR_RETURN(const Settings settings, settings_or_environment(options_.settings));
    apply_process_settings(settings);
    dataplane::BucketSenderSettings ss;
    ss.verify = settings.verify;
    ss.delta = settings.delta == "off"      ? dataplane::DeltaMode::kOff
               : settings.delta == "always" ? dataplane::DeltaMode::kAlways
               : settings.delta == "on"     ? dataplane::DeltaMode::kOn
                                            : dataplane::DeltaMode::kAuto;
    ss.delta_max_bytes = settings.delta_max_bytes;
    ss.delta_zstd = static_cast<int>(settings.delta_zstd);
    ss.delta_copy_on_device = settings.delta_copy == "device";
    stage_ = settings.stage == "on";
    ss.direct = settings.direct == "auto" && transport::ipc_share_available();
    ss.transport = settings.transport;
    ss.transport_options = transport::transport_options(settings);
    timeout_ms_ = ss.transport_options.timeout.count();
    // This trainer's bucket size: every plan it makes cuts its buckets so, and the ranks take them
    // whatever their own setting (each connection announces its largest bucket).
    plan_options_.bucket_bytes = ss.transport_options.bucket_bytes;
    sender_ = std::make_unique<dataplane::BucketSender>(ss, [this] { progress(false); });
    std::string address = options_.coordinator;
    if (address.empty()) {
      CoordinatorOptions co;
      co.host = options_.listen_host;
      co.port = options_.port;
      co.settings = settings;
      FERRY_ASSIGN_OR_RETURN(embedded_, Coordinator::start(co));
      address = embedded_->address();
    }
    address_ = address;
    thread_ = std::thread([this] { run_io(io_); });
    FERRY_ASSIGN_OR_RETURN(auto socket, connect_control(io_, address, timeout_ms_));
    channel_ = std::make_shared<Channel>(std::move(socket), settings.max_frame_bytes);
    channel_->start([this](const std::shared_ptr<Channel>&, wire::Envelope& e) { mailbox_.push(std::move(e)); },
                    [this](const std::shared_ptr<Channel>&, const Status& why) { mailbox_.close(why); });
    wire::Envelope hello;
    hello.mutable_hello()->set_role("trainer");
    hello.mutable_hello()->set_pid(static_cast<int32_t>(getpid()));
    FERRY_ASSIGN_OR_RETURN(wire::Welcome welcome, join(*channel_, mailbox_, std::move(hello), deadline(), settings.token));
    member_id_ = welcome.member_id();
    data_key_ = welcome.data_key();
    heartbeat_ = std::make_unique<Heartbeat>(channel_, std::chrono::milliseconds(std::max<int64_t>(timeout_ms_ / 4, 1)));
    return ok_status();
  }

  std::string coordinator_address() const override { return address_; }

  Status wait_for_ranks(int n, int64_t timeout_ms) override {
    if (embedded_) return embedded_->wait_for_ranks(n, timeout_ms);
    // A coordinator of its own (`ferry coordinator`) tells a trainer nothing when ranks join: ask it
    // for its members until n rollout ranks are among them, 1 ms after the first answer, backing off
    // to 50 ms.
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    auto gap = std::chrono::milliseconds(1);
    int joined = 0;
    while (true) {
      wire::Envelope ask;
      ask.mutable_status_request();
      channel_->send(ask);
      auto reply = mailbox_.wait(wire::Envelope::kStatusReply, until, "status reply");
      if (!reply.ok() && reply.status().code() != StatusCode::kDeadlineExceeded) return reply.status();
      if (reply.ok()) {
        const auto& members = reply->status_reply().members();
        joined = static_cast<int>(std::count_if(members.begin(), members.end(),
                                                [](const wire::MemberStatus& m) { return m.role() == "rollout"; }));
        if (joined >= n) return ok_status();
      }
      if (!reply.ok() || Clock::now() + gap >= until) {
        return Status::deadline_exceeded(fmt::format("{} of {} rollout ranks joined the coordinator at {} within {} ms",
                                                     joined, n, address_, timeout_ms));
      }
      std::this_thread::sleep_for(gap);
      gap = std::min(gap * 2, std::chrono::milliseconds(50));
    }
  }

  Status start_weight_update(uint64_t version, const sharding::Manifest& manifest) override {
    return start_weight_update(version, manifest, UpdateOptions{options_.pause_mode, options_.clear_cache, {}, {}, {}});
  }

  Status start_weight_update(uint64_t version, const sharding::Manifest& manifest, const UpdateOptions& o) override {
    if (in_update_) return Status::failed_precondition(fmt::format("update v{} is still open; finish it first", version_));
    t_start_ = Clock::now();
    // The manifest travels only when it differs from the last one the coordinator accepted.
    const uint64_t digest = manifest_digest(manifest);
    const bool omit = digest == accepted_digest_;
    wire::Envelope env;
    auto* s = env.mutable_start_update();
    s->set_version(version);
    s->set_pause_mode(o.pause_mode);
    s->set_clear_cache(o.clear_cache);
    s->set_stage(o.stage || stage_);
    for (int r : o.replicas) s->add_replicas(r);
    s->set_manifest_digest(digest);
    s->set_manifest_omitted(omit);
    if (!omit) {
      for (const auto& t : manifest) to_wire(t, s->add_manifest());
    }
    s->set_trainer_rank(options_.trainer_rank);
    s->set_trainer_ranks(options_.trainer_ranks);
    to_wire(o.source_layout.empty() ? o.holdings : sharding::layout_holdings(o.source_layout), s->mutable_holdings());
    s->set_senders_digest_held(senders_digest_);
    channel_->send(env);
    // A sharded trainer's start waits for the other trainer ranks too (up to FERRY_TIMEOUT_MS from the
    // first) before the pause. Past the deadline the update is ended at the coordinator, in case it
    // opens later; any late answer is dropped by its version.
    auto reply = wait_reply(wire::Envelope::kStartReply, version, deadline(options_.trainer_ranks > 1 ? 3 : 2),
                            "start reply");
    if (!reply.ok()) {
      wire::Envelope abort;
      abort.mutable_abort_update()->set_version(version);
      abort.mutable_abort_update()->set_reason("trainer rank " + std::to_string(options_.trainer_rank) +
                                               " gave up waiting for the start: " + reply.status().message());
      channel_->send(abort);
      return reply.status();
    }
    const auto& r = reply->start_reply();
    if (Status st = from_wire(r.status()); !st.ok()) {
      accepted_digest_ = 0;  // resend the manifest next time
      return st;
    }
    accepted_digest_ = digest;
    version_ = version;  // open at the coordinator from here: any failure below ends it there
    pause_seconds_ = since(t_start_);
    const auto t_plan = Clock::now();
    std::vector<int> members;
    std::vector<std::vector<wire::Endpoint>> endpoints;  // per destination, in its preference order
    std::vector<std::string> storage_devices;            // per destination
    std::vector<uint64_t> delta_bases;                   // per destination
    for (const auto& m : r.ranks()) {
      // A member's spec comes once; it never changes (a rejoining rank is a new member).
      if (m.has_spec()) {
        auto spec = from_wire(m.spec());
        if (!spec.ok()) return end_open_update(spec.status());
        // The ranks of identical replicas share one copy of their layout, so the plan checks,
        // hashes and walks it once.
        std::vector<const sharding::RankSpec*> known;
        for (const auto& [id, other] : specs_) known.push_back(&other);
        sharding::share_with_alike(*spec, known);
        specs_[m.member_id()] = std::move(*spec);
      } else if (!specs_.contains(m.member_id())) {
        return end_open_update(Status::internal(fmt::format("the coordinator sent no spec for member {}", m.member_id())));
      }
      members.push_back(m.member_id());
      endpoints.emplace_back(m.endpoints().begin(), m.endpoints().end());
      storage_devices.push_back(m.storage_device());
      delta_bases.push_back(m.delta_base());
    }
    // Every trainer rank makes the same plan from every rank's holdings (one sender: the only one).
    // Holdings this trainer was handed before are not handed again (StartReply.senders_digest).
    if (r.senders_size() > 0 || r.senders_digest() != senders_digest_) {
      if (r.senders_size() == 0 && r.senders_digest() != 0) {
        return end_open_update(Status::internal(fmt::format(
            "the coordinator omitted holdings {:016x} this trainer does not hold ({:016x})", r.senders_digest(),
            senders_digest_)));
      }
      senders_.clear();
      for (const auto& w : r.senders()) {
        auto info = from_wire(w);
        if (!info.ok()) return end_open_update(info.status());
        senders_.push_back(std::move(*info));
      }
      senders_digest_ = r.senders_digest();
    }
    std::vector<sharding::SenderInfo> senders = senders_;
    if (options_.trainer_ranks > 1 && static_cast<int>(senders.size()) != options_.trainer_ranks) {
      return end_open_update(Status::failed_precondition(fmt::format(
          "the coordinator handed out the holdings of {} trainer ranks for a trainer of {}; is it older than this "
          "trainer (sharded trainers need a coordinator that gathers them)?",
          senders.size(), options_.trainer_ranks)));
    }
    if (senders.empty()) senders.emplace_back();
    if (!plan_ || members != plan_members_ || digest != plan_digest_ || senders_digest_ != plan_senders_) {
      ranks_.clear();
      for (int id : members) ranks_.push_back(specs_.at(id));
      manifest_ = manifest;
      index_.clear();
      for (size_t i = 0; i < manifest_.size(); ++i) index_[manifest_[i].name] = i;
      auto plan = plans_.get(manifest_, ranks_, senders, plan_options_);
      if (!plan.ok()) return end_open_update(plan.status());
      plan_ = *plan;
      plan_members_ = members;
      plan_digest_ = digest;
      plan_senders_ = senders_digest_;
    }
    if (Status st = local_.reset(manifest_, o.holdings, o.source_layout,
                                 fmt::format("trainer rank {} of {}", options_.trainer_rank, options_.trainer_ranks));
        !st.ok()) {
      return end_open_update(st);
    }
    plan_seconds_ = since(t_plan);
    dataplane::BucketSender::Identity identity{member_id_, data_key_, members, options_.trainer_rank,
                                               std::move(delta_bases)};
    if (Status st = sender_->prepare(version, plan_, ranks_, endpoints, storage_devices, std::move(identity)); !st.ok()) {
      return end_open_update(st);
    }
    failure_ = Status();
    in_update_ = true;
    t_transfer_ = Clock::now();
    return ok_status();
  }

  Status send(const std::string& name, const TensorView& tensor) override {
    if (!in_update_) return Status::failed_precondition("send(" + name + ") outside an update");
    Status st = send_one(name, tensor);
    if (!st.ok() && failure_.ok()) failure_ = st;
    return st;
  }

  Status update_weights(WeightSource& source) override {
    if (!in_update_) return Status::failed_precondition("update_weights outside an update");
    for (const std::string& name : local_.wanted(plan_->source_order)) {
      auto t = source.get(name);
      if (!t.ok()) {
        if (failure_.ok()) failure_ = t.status();
        return t.status();
      }
      FERRY_RETURN_IF_ERROR(send(name, *t));
    }
    return ok_status();
  }

  Status abort_weight_update(const std::string& reason) override {
    if (!in_update_) return Status::failed_precondition("abort_weight_update: no update is open");
    in_update_ = false;
    sender_->finish(Status::aborted("aborted by the trainer")).ignore_error();
    progress_shown_ = false;
    return tell_abort(reason);
  }

  Result<UpdateReport> finish_weight_update() override {
    if (!in_update_) return Status::failed_precondition("finish_weight_update without start_weight_update");
    in_update_ = false;
    failure_ = sender_->finish(failure_);
    if (const auto unsent = sender_->unsent(); failure_.ok() && !unsent.empty()) {
      // Caught here, named by checkpoint tensor, before the ranks find a gap in a layer.
      std::string names;
      for (size_t i = 0; i < std::min<size_t>(unsent.size(), 3); ++i) names += (i ? ", " : "") + manifest_[unsent[i]].name;
      failure_ = Status::failed_precondition(fmt::format(
          "trainer rank {} of {} did not send {} tensor(s) of the manifest it holds: {}{}; send each (or the local "
          "tensor of its source layout) before finish_weight_update",
          options_.trainer_rank, options_.trainer_ranks, unsent.size(), names, unsent.size() > 3 ? ", ..." : ""));
    }
    progress(true);
    progress_shown_ = false;
    const double transfer = since(t_transfer_);
    wire::Envelope env;
    auto* f = env.mutable_finish_update();
    f->set_version(version_);
    for (uint64_t b : sender_->buckets()) f->add_buckets(b);
    f->set_bytes(sender_->bytes());
    f->set_transfer_seconds(transfer);
    channel_->send(env);
    FERRY_ASSIGN_OR_RETURN(auto reply, wait_reply(wire::Envelope::kFinishReply, version_, deadline(4), "finish reply"));
    const auto& r = reply.finish_reply();
    Status st = from_wire(r.status());
    if (!st.ok()) return failure_.ok() ? st : failure_.with_context(st.message());
    if (!failure_.ok()) return failure_;
    UpdateReport rep;
    rep.version = r.version();
    rep.ranks = r.ranks();
    rep.bytes = r.bytes();
    rep.direct_bytes = sender_->direct_bytes();
    rep.buckets = sender_->buckets();
    for (const auto& t : sender_->delta_tallies()) {
      rep.delta.push_back(RankDelta{t.dense_bytes, t.delta_bytes, t.delta_dense_bytes, t.elements, t.changed});
    }
    rep.delta_copy_bytes = sender_->delta_copy_bytes();
    rep.compared_bytes = sender_->compared_bytes();
    rep.compare_seconds = sender_->compare_seconds();
    rep.copy_seconds = sender_->copy_seconds();
    rep.shadow_bytes = r.shadow_bytes();
    rep.moved = r.moved();
    rep.registered = r.registered();
    rep.peak_staging_bytes = r.peak_staging_bytes();
    rep.allocated_staging_bytes = r.allocated_staging_bytes();
    rep.seconds = since(t_start_);
    rep.pause_seconds = pause_seconds_;
    rep.ranks_pause_seconds = r.pause_seconds();
    rep.plan_seconds = plan_seconds_;
    rep.transfer_seconds = transfer;
    rep.process_seconds = r.process_seconds();
    rep.resume_seconds = r.resume_seconds();
    rep.staged = r.staged();
    rep.pause_window_seconds = r.pause_window_seconds();
    rep.apply_seconds = r.apply_seconds();
    return rep;
  }

 private:
  // The coordinator opened update version_ but this trainer cannot send it: end it there, so the
  // ranks learn at once (and roll back or stay paused) and the next start is not refused.
  Status end_open_update(const Status& why) {
    Status told = tell_abort(why.message());
    if (!told.ok()) FERRY_LOG_WARN("could not end update v{} at the coordinator: {}", version_, told.message());
    return why;
  }

  // Asks the coordinator to abort update version_ and waits for its answer. OK once the update is
  // over, also when it had already failed on its own (that failure is logged).
  Status tell_abort(const std::string& reason) {
    wire::Envelope env;
    env.mutable_abort_update()->set_version(version_);
    env.mutable_abort_update()->set_reason(reason);
    channel_->send(env);
    FERRY_ASSIGN_OR_RETURN(auto reply, wait_reply(wire::Envelope::kFinishReply, version_, deadline(2), "abort reply"));
    Status st = from_wire(reply.finish_reply().status());
    if (st.code() == StatusCode::kAborted) return ok_status();
    if (st.code() == StatusCode::kFailedPrecondition) return st;
    FERRY_LOG_WARN("update v{} had already failed before the abort: {}", version_, st.message());
    return ok_status();
  }

  // The coordinator's answer of `kind` to update `version`; answers to earlier ones (a start or
  // finish this trainer gave up on) are dropped.
  Result<wire::Envelope> wait_reply(wire::Envelope::BodyCase kind, uint64_t version, Clock::time_point until,
                                    const char* what) {
    while (true) {
      FERRY_ASSIGN_OR_RETURN(auto reply, mailbox_.wait(kind, until, what));
      const uint64_t v = kind == wire::Envelope::kStartReply ? reply.start_reply().version() : reply.finish_reply().version();
      if (v == version) return reply;
      FERRY_LOG_DEBUG("dropped a {} for update v{} while waiting for v{}", what, v, version);
    }
  }

  Clock::time_point deadline(int factor = 1) const {
    return Clock::now() + std::chrono::milliseconds(timeout_ms_ * factor);
  }

  // A progress bar on a terminal, for updates that run longer than a second.
  void progress(bool done) {
    if (!tty_) return;
    const auto now = Clock::now();
    if (!done && (now - t_start_ < std::chrono::seconds(1) || now - last_progress_ < std::chrono::milliseconds(100))) {
      return;
    }
    if (done && !progress_shown_) return;
    last_progress_ = now;
    progress_shown_ = true;
    const double total = static_cast<double>(std::max<uint64_t>(plan_->total_bytes, 1));
    const uint64_t bytes = sender_->bytes();
    const double frac = std::min(1.0, static_cast<double>(bytes) / total);
    const int width = 30, filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < width) bar += '>' + std::string(static_cast<size_t>(width - filled - 1), ' ');
    std::fprintf(stderr, "\r[ferry] v%llu [%s] %3.0f%% %.2f/%.2f GB%s", static_cast<unsigned long long>(version_), bar.c_str(),
                 frac * 100, static_cast<double>(bytes) / 1e9, total / 1e9, done ? "\n" : "");
  }

  Status send_one(const std::string& name, const TensorView& tensor) {
    FERRY_ASSIGN_OR_RETURN(auto parts, local_.take(name, tensor));
    for (const auto& p : parts) FERRY_RETURN_IF_ERROR(sender_->send(p.source, manifest_[p.source], p.view, p.box));
    return ok_status();
  }

  TrainerOptions options_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  std::unique_ptr<Coordinator> embedded_;
  std::string address_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<Heartbeat> heartbeat_;
  Mailbox mailbox_;
  int64_t timeout_ms_ = 0;
  int member_id_ = 0;
  std::string data_key_;  // proves this trainer's data connections to ranks (auth.h)

  std::unique_ptr<dataplane::BucketSender> sender_;
  bool stage_ = false;  // FERRY_STAGE=on: every update stages while the ranks serve
  sharding::PlanCache plans_;
  sharding::PlanOptions plan_options_;
  std::shared_ptr<const sharding::Plan> plan_;
  sharding::Manifest manifest_;
  std::map<std::string, size_t> index_;
  std::vector<sharding::RankSpec> ranks_;
  LocalHoldings local_;                        // what this trainer rank holds, and where
  std::map<int, sharding::RankSpec> specs_;    // by member id, as the coordinator sent them once
  uint64_t accepted_digest_ = 0;              // of the manifest the coordinator holds from us
  std::vector<int> plan_members_;             // the members and manifest plan_ was made for
  uint64_t plan_digest_ = 0;
  uint64_t plan_senders_ = 0;                 // digest of the trainer ranks' holdings plan_ was made for
  std::vector<sharding::SenderInfo> senders_;  // every trainer rank's holdings, as last handed out
  uint64_t senders_digest_ = 0;                // and their digest (StartReply.senders_digest)
  bool in_update_ = false;
  uint64_t version_ = 0;
  Status failure_;
  Clock::time_point t_start_, t_transfer_, last_progress_;
  const bool tty_ = isatty(STDERR_FILENO) != 0;
  bool progress_shown_ = false;
  double pause_seconds_ = 0, plan_seconds_ = 0;
};

}  // namespace

Result<TensorView> MapSource::get(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return Status::not_found("weight source has no tensor " + name);
  return it->second;
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerOptions& options) {
  auto t = std::make_unique<TrainerImpl>(options);
  FERRY_RETURN_IF_ERROR(t->init());
  return std::unique_ptr<Trainer>(std::move(t));
}

}  // namespace ferry::coordinator
