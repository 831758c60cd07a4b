#include "coordinator/coordinator.h"

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/asio.h"
#include <fmt/format.h>

#include "core/log.h"
#include "core/settings.h"
#include "core/version.h"
#include "coordinator/channel.h"
#include "coordinator/wire.h"
#include "sharding/planner.h"

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

enum class Phase { kIdle, kPausing, kTransferring, kFinalizing, kResuming };

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kIdle: return "idle";
    case Phase::kPausing: return "pausing";
    case Phase::kTransferring: return "transferring";
    case Phase::kFinalizing: return "finalizing";
    case Phase::kResuming: return "resuming";
  }
  return "?";
}

struct Member {
  int id = 0;
  std::shared_ptr<Channel> channel;
  std::string role;
  sharding::RankSpec spec;
  std::string endpoint;
  std::string transport;
  uint64_t version = 0;
  bool consistent = true;
  std::string state = "serving";
};

class CoordinatorImpl final : public Coordinator {
 public:
  CoordinatorImpl() : work_(asio::make_work_guard(io_)), acceptor_(io_), timer_(io_) {}
  ~CoordinatorImpl() override { stop(); }

  Status listen(const CoordinatorOptions& o) {
    FERRY_ASSIGN_OR_RETURN(max_frame_, setting_bytes("FERRY_MAX_FRAME_BYTES"));
    FERRY_ASSIGN_OR_RETURN(timeout_ms_, setting_int("FERRY_TIMEOUT_MS"));
    std::string host = o.host;
    if (host.empty()) {
      FERRY_ASSIGN_OR_RETURN(host, setting_string("FERRY_LISTEN_HOST"));
    }
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(host, ec);
    if (ec) return Status::invalid_argument("coordinator listen address '" + host + "' is not an IP address");
    tcp::endpoint ep(addr, o.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::unavailable(fmt::format("coordinator cannot listen on {}:{}: {}", host, o.port, ec.message()));
    auto local = acceptor_.local_endpoint();
    address_ = fmt::format("{}:{}", local.address().to_string(), local.port());
    accept();
    thread_ = std::thread([this] { io_.run(); });
    FERRY_LOG_INFO("coordinator listening on {}", address_);
    return ok_status();
  }

  std::string address() const override { return address_; }

  int rollout_ranks() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return n_rollout_;
  }

  std::vector<MemberInfo> members() const override {
    std::promise<std::vector<MemberInfo>> p;
    asio::post(const_cast<asio::io_context&>(io_), [&] {
      std::vector<MemberInfo> out;
      for (const auto& [id, m] : members_) {
        out.push_back({id, m.role, m.channel->peer(), m.spec.replica, m.spec.tp_rank, m.version, m.state});
      }
      p.set_value(std::move(out));
    });
    return p.get_future().get();
  }

  Status wait_for_ranks(int n, int64_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return n_rollout_ >= n; })) {
      return Status::deadline_exceeded(fmt::format("{} of {} rollout ranks joined within {} ms", n_rollout_, n, timeout_ms));
    }
    return ok_status();
  }

  void stop() override {
    if (!thread_.joinable()) return;
    asio::post(io_, [this] {
      boost::system::error_code ec;
      acceptor_.close(ec);
      timer_.cancel();
      for (auto& [id, m] : members_) m.channel->close(Status::unavailable("coordinator stopped"));
      for (auto& c : pending_) c->close(Status::unavailable("coordinator stopped"));
    });
    work_.reset();
    thread_.join();
  }

 private:
  void accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket s) {
      if (ec) return;
      auto ch = std::make_shared<Channel>(std::move(s), max_frame_);
      pending_.push_back(ch);
      ch->start([this](const std::shared_ptr<Channel>& c, wire::Envelope& env) { on_message(c, env); },
                [this](const std::shared_ptr<Channel>& c, const Status& why) { on_closed(c, why); });
      accept();
    });
  }

  Member* member_of(const std::shared_ptr<Channel>& c) {
    for (auto& [id, m] : members_) {
      if (m.channel == c) return &m;
    }
    return nullptr;
  }

  void on_message(const std::shared_ptr<Channel>& c, wire::Envelope& env) {
    Member* m = member_of(c);
    if (!m) {
      if (env.body_case() != wire::Envelope::kHello) {
        FERRY_LOG_WARN("{} sent a message before hello; closing it", c->peer());
        return c->close(Status::failed_precondition("hello expected"));
      }
      return on_hello(c, env.hello());
    }
    switch (env.body_case()) {
      case wire::Envelope::kStartUpdate: return on_start(*m, env.start_update());
      case wire::Envelope::kPauseAck: return on_pause_ack(*m, env.pause_ack());
      case wire::Envelope::kFinishUpdate: return on_finish(*m, env.finish_update());
      case wire::Envelope::kFinalized: return on_finalized(*m, env.finalized());
      case wire::Envelope::kResumeAck: return on_resume_ack(*m, env.resume_ack());
      default:
        FERRY_LOG_WARN("unexpected message {} from member {} ({}); closing it", static_cast<int>(env.body_case()), m->id,
                       c->peer());
        c->close(Status::invalid_argument("unexpected message"));
    }
  }

  void on_hello(const std::shared_ptr<Channel>& c, const wire::Hello& h) {
    std::erase(pending_, c);
    wire::Envelope reply;
    wire::Welcome* w = reply.mutable_welcome();
    if (h.protocol_version() != kProtocolVersion) {
      const Status st = Status::failed_precondition(
          fmt::format("protocol version {} from {}; this coordinator speaks {}", h.protocol_version(), c->peer(), kProtocolVersion));
      FERRY_LOG_WARN("{}", st.message());
      to_wire(st, w->mutable_status());
      c->send(reply);
      return c->close(st);
    }
    Member m;
    m.id = next_id_++;
    m.channel = c;
    m.role = h.role();
    if (m.role == "rollout") {
      auto spec = from_wire(h.spec());
      if (!spec.ok()) {
        to_wire(spec.status(), w->mutable_status());
        c->send(reply);
        return c->close(spec.status());
      }
      m.spec = std::move(*spec);
      m.endpoint = h.data_endpoint();
      m.transport = h.transport();
      m.version = version_;
      // A rank that joins while others serve a version has none yet: it waits for the next update.
      m.consistent = (version_ == 0);
      m.state = "joined";
    } else if (m.role != "trainer" && m.role != "observer") {
      const Status st = Status::invalid_argument("unknown role '" + m.role + "'");
      to_wire(st, w->mutable_status());
      c->send(reply);
      return c->close(st);
    }
    w->set_member_id(m.id);
    w->set_version(version_);
    c->send(reply);
    FERRY_LOG_INFO("member {} joined as {} from {}", m.id, m.role, c->peer());
    members_.emplace(m.id, std::move(m));
    count_rollout();
  }

  void count_rollout() {
    int n = 0;
    for (auto& [id, m] : members_) n += m.role == "rollout";
    {
      std::lock_guard<std::mutex> lock(mu_);
      n_rollout_ = n;
    }
    cv_.notify_all();
  }

  void on_closed(const std::shared_ptr<Channel>& c, const Status& why) {
    std::erase(pending_, c);
    Member* m = member_of(c);
    if (!m) return;
    const int id = m->id;
    const bool in_update = phase_ != Phase::kIdle && (id == trainer_ || participants_.count(id));
    FERRY_LOG_INFO("member {} left: {}", id, why.message());
    if (in_update) {
      fail_update(Status::unavailable(fmt::format("{} {} left during {}: {}", m->role, describe(*m), phase_name(phase_),
                                                  why.message())));
    }
    members_.erase(id);
    count_rollout();
  }

  static std::string describe(const Member& m) {
    if (m.role == "rollout") return fmt::format("member {} (replica {} rank {})", m.id, m.spec.replica, m.spec.tp_rank);
    return fmt::format("member {}", m.id);
  }

  void send_to_trainer(wire::Envelope& env) {
    auto it = members_.find(trainer_);
    if (it != members_.end()) it->second.channel->send(env);
  }

  void arm_timer(const char* what) {
    timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
    const uint64_t v = update_version_;
    timer_.async_wait([this, what, v](boost::system::error_code ec) {
      if (ec || phase_ == Phase::kIdle || update_version_ != v) return;
      std::string late;
      for (int id : participants_) {
        if (!acked_.count(id)) late += " " + describe(members_.at(id));
      }
      fail_update(Status::deadline_exceeded(fmt::format("{} of update v{} passed FERRY_TIMEOUT_MS={} waiting for:{}", what, v,
                                                        timeout_ms_, late)));
    });
  }

  void on_start(Member& trainer, const wire::StartUpdate& s) {
    wire::Envelope reply;
    auto* r = reply.mutable_start_reply();
    auto refuse = [&](const Status& st) {
      to_wire(st, r->mutable_status());
      trainer.channel->send(reply);
    };
    if (phase_ != Phase::kIdle) {
      return refuse(Status::failed_precondition(
          fmt::format("update v{} is {}; a second update cannot start", update_version_, phase_name(phase_))));
    }
    if (s.version() <= version_) {
      return refuse(Status::invalid_argument(
          fmt::format("version {} is not above the current version {}", s.version(), version_)));
    }
    auto manifest = manifest_from_wire(s.manifest());
    if (!manifest.ok()) return refuse(manifest.status());
    std::vector<sharding::RankSpec> specs;
    participants_.clear();
    for (auto& [id, m] : members_) {
      if (m.role != "rollout") continue;
      participants_.insert(id);
      specs.push_back(m.spec);
    }
    if (specs.empty()) return refuse(Status::failed_precondition("no rollout rank has joined"));
    // Every mismatch fails here, before any rank pauses and before one byte moves.
    Status st = sharding::check_manifest(*manifest, specs);
    if (!st.ok()) return refuse(st);
    trainer_ = trainer.id;
    update_version_ = s.version();
    pending_failure_ = Status();
    acked_.clear();
    phase_ = Phase::kPausing;
    phase_start_ = Clock::now();
    report_ = wire::FinishReply{};
    wire::Envelope pause;
    pause.mutable_pause()->set_version(s.version());
    pause.mutable_pause()->set_mode(s.pause_mode().empty() ? "abort" : s.pause_mode());
    for (int id : participants_) {
      members_.at(id).state = "pausing";
      members_.at(id).channel->send(pause);
    }
    arm_timer("pause");
  }

  void on_pause_ack(Member& m, const wire::PauseAck& a) {
    if (phase_ != Phase::kPausing || a.version() != update_version_) return;
    Status st = from_wire(a.status());
    if (!st.ok()) return fail_update(st.with_context(describe(m) + " pause"));
    m.state = "paused";
    acked_.insert(m.id);
    if (acked_.size() < participants_.size()) return;
    timer_.cancel();
    report_.set_pause_seconds(since(phase_start_));
    phase_ = Phase::kTransferring;
    wire::Envelope reply;
    auto* r = reply.mutable_start_reply();
    to_wire(ok_status(), r->mutable_status());
    for (int id : participants_) {
      const Member& p = members_.at(id);
      auto* w = r->add_ranks();
      w->set_member_id(id);
      to_wire(p.spec, w->mutable_spec());
      w->set_data_endpoint(p.endpoint);
      w->set_transport(p.transport);
    }
    send_to_trainer(reply);
  }

  void on_finish(Member& trainer, const wire::FinishUpdate& f) {
    if (phase_ != Phase::kTransferring || trainer.id != trainer_ || f.version() != update_version_) {
      wire::Envelope reply;
      Status st = Status::failed_precondition(fmt::format("finish of v{} without a matching start", f.version()));
      if (phase_ == Phase::kIdle && f.version() == aborted_version_ && !pending_failure_.ok()) {
        st = pending_failure_;
        pending_failure_ = Status();
      }
      to_wire(st, reply.mutable_finish_reply()->mutable_status());
      trainer.channel->send(reply);
      return;
    }
    if (static_cast<size_t>(f.buckets_size()) != participants_.size()) {
      return fail_update(Status::invalid_argument(fmt::format("finish lists {} ranks; the update has {}", f.buckets_size(),
                                                              participants_.size())));
    }
    phase_ = Phase::kFinalizing;
    phase_start_ = Clock::now();
    acked_.clear();
    int i = 0;
    for (int id : participants_) {
      wire::Envelope env;
      env.mutable_finalize()->set_version(update_version_);
      env.mutable_finalize()->set_buckets(f.buckets(i++));
      members_.at(id).state = "finalizing";
      members_.at(id).channel->send(env);
    }
    arm_timer("finalize");
  }

  void on_finalized(Member& m, const wire::Finalized& f) {
    if (phase_ != Phase::kFinalizing || f.version() != update_version_) return;
    Status st = from_wire(f.status());
    if (!st.ok()) return fail_update(st.with_context(describe(m) + " finalize"));
    acked_.insert(m.id);
    report_.set_bytes(report_.bytes() + f.bytes());
    report_.set_moved(report_.moved() + f.moved());
    report_.set_registered(report_.registered() + f.registered());
    report_.set_peak_staging_bytes(std::max(report_.peak_staging_bytes(), f.peak_staging_bytes()));
    report_.set_process_seconds(std::max(report_.process_seconds(), f.process_seconds()));
    if (acked_.size() < participants_.size()) return;
    timer_.cancel();
    // Every rank of every replica holds the complete new version: release them together.
    phase_ = Phase::kResuming;
    phase_start_ = Clock::now();
    acked_.clear();
    wire::Envelope env;
    env.mutable_resume()->set_version(update_version_);
    for (int id : participants_) members_.at(id).channel->send(env);
    arm_timer("resume");
  }

  void on_resume_ack(Member& m, const wire::ResumeAck& a) {
    if (phase_ != Phase::kResuming || a.version() != update_version_) return;
    acked_.insert(m.id);
    m.version = update_version_;
    m.consistent = true;
    m.state = "serving";
    if (acked_.size() < participants_.size()) return;
    timer_.cancel();
    version_ = update_version_;
    report_.set_resume_seconds(since(phase_start_));
    to_wire(ok_status(), report_.mutable_status());
    report_.set_version(version_);
    report_.set_ranks(static_cast<int32_t>(participants_.size()));
    wire::Envelope env;
    *env.mutable_finish_reply() = report_;
    send_to_trainer(env);
    phase_ = Phase::kIdle;
  }

  void fail_update(const Status& why) {
    if (phase_ == Phase::kIdle) return;
    timer_.cancel();
    FERRY_LOG_ERROR("update v{} aborted during {}: {}", update_version_, phase_name(phase_), why.message());
    wire::Envelope abort;
    abort.mutable_abort()->set_version(update_version_);
    abort.mutable_abort()->set_reason(why.message());
    for (int id : participants_) {
      auto it = members_.find(id);
      if (it == members_.end()) continue;
      it->second.consistent = false;
      it->second.state = "paused-inconsistent";
      it->second.channel->send(abort);
    }
    wire::Envelope reply;
    if (phase_ == Phase::kPausing) {
      to_wire(why, reply.mutable_start_reply()->mutable_status());
    } else {
      to_wire(why, reply.mutable_finish_reply()->mutable_status());
      reply.mutable_finish_reply()->set_version(update_version_);
    }
    // During the transfer the trainer is not waiting on a reply; it learns at finish.
    if (phase_ == Phase::kTransferring) {
      pending_failure_ = why;
      aborted_version_ = update_version_;
    } else {
      send_to_trainer(reply);
    }
    phase_ = Phase::kIdle;
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  asio::steady_timer timer_;
  std::thread thread_;
  std::string address_;
  uint64_t max_frame_ = 0;
  int64_t timeout_ms_ = 0;

  std::map<int, Member> members_;
  std::vector<std::shared_ptr<Channel>> pending_;
  int next_id_ = 1;

  Phase phase_ = Phase::kIdle;
  uint64_t version_ = 0;         // the version every replica serves
  uint64_t update_version_ = 0;  // the update in progress (or last attempted)
  uint64_t aborted_version_ = 0;
  Status pending_failure_;
  int trainer_ = 0;
  std::set<int> participants_;
  std::set<int> acked_;
  Clock::time_point phase_start_;
  wire::FinishReply report_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int n_rollout_ = 0;
};

}  // namespace

Result<std::unique_ptr<Coordinator>> Coordinator::start(const CoordinatorOptions& options) {
  auto c = std::make_unique<CoordinatorImpl>();
  FERRY_RETURN_IF_ERROR(c->listen(options));
  return std::unique_ptr<Coordinator>(std::move(c));
}

}  // namespace ferry::coordinator
