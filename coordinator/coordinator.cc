#include "coordinator/coordinator.h"

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/asio.h"
#include "core/log.h"
#include "core/settings.h"
#include "core/version.h"
#include "coordinator/auth.h"
#include "coordinator/channel.h"
#include "coordinator/members.h"
#include "coordinator/metrics_http.h"
#include "coordinator/update_machine.h"
#include "coordinator/wire.h"

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

class CoordinatorImpl final : public Coordinator {
 public:
  CoordinatorImpl() : work_(asio::make_work_guard(io_)), acceptor_(io_), reaper_(io_) {}
  ~CoordinatorImpl() override { stop(); }

  Status listen(const CoordinatorOptions& o) {
    FERRY_ASSIGN_OR_RETURN(max_frame_, setting_bytes("FERRY_MAX_FRAME_BYTES"));
    FERRY_ASSIGN_OR_RETURN(timeout_ms_, setting_int("FERRY_TIMEOUT_MS"));
    FERRY_ASSIGN_OR_RETURN(token_, setting_string("FERRY_TOKEN"));
    if (timeout_ms_ < 10) return Status::invalid_argument("FERRY_TIMEOUT_MS must be at least 10");
    updates_ = std::make_unique<UpdateMachine>(io_, members_, timeout_ms_);
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
    arm_reaper();
    std::optional<uint16_t> mport = o.metrics_port;
    if (!mport) {
      FERRY_ASSIGN_OR_RETURN(int64_t p, setting_int("FERRY_METRICS_PORT"));
      if (p < 0 || p > 65535) return Status::invalid_argument("FERRY_METRICS_PORT must be a port number");
      if (p > 0) mport = static_cast<uint16_t>(p);
    }
    if (mport) {
      FERRY_ASSIGN_OR_RETURN(metrics_, MetricsServer::start(io_, host, *mport, [this] { return render_metrics(); }));
    }
    thread_ = std::thread([this] { run_io(io_); });
    FERRY_LOG_INFO("coordinator listening on {}{}", address_, token_.empty() ? "" : " (token required)");
    return ok_status();
  }

  std::string address() const override { return address_; }
  uint16_t metrics_port() const override { return metrics_ ? metrics_->port() : 0; }

  int rollout_ranks() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return n_rollout_;
  }

  std::vector<MemberInfo> members() const override {
    std::vector<MemberInfo> out;
    const wire::StatusReply st = status();
    for (const auto& m : st.members()) {
      out.push_back({m.member_id(), m.role(), m.peer(), m.replica(), m.tp_rank(), m.version(), m.state()});
    }
    return out;
  }

  wire::StatusReply status() const {
    std::promise<wire::StatusReply> p;
    asio::post(const_cast<asio::io_context&>(io_), [&] { p.set_value(make_status()); });
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
      reaper_.cancel();
      metrics_.reset();
      for (auto& [id, m] : members_) m.channel->close(Status::unavailable("coordinator stopped"));
      for (auto& [c, nonce] : pending_) c->close(Status::unavailable("coordinator stopped"));
    });
    work_.reset();
    thread_.join();
  }

 private:
  wire::StatusReply make_status() const {
    wire::StatusReply r;
    r.set_phase(updates_->phase());
    uint64_t v = 0;
    for (const auto& [id, m] : members_) {
      auto* s = r.add_members();
      s->set_member_id(id);
      s->set_role(m.role);
      s->set_peer(m.channel->peer());
      s->set_replica(m.role == "rollout" ? m.spec.replica : -1);
      s->set_tp_rank(m.role == "rollout" ? m.spec.tp_rank : -1);
      s->set_version(m.version);
      s->set_state(m.state);
      s->set_consistent(m.consistent);
      if (m.role == "rollout") v = std::max(v, m.version);
    }
    r.set_version(v);
    for (const auto& u : updates_->history()) *r.add_updates() = u;
    return r;
  }

  // Prometheus text exposition of members, versions and updates.
  std::string render_metrics() const {
    std::map<std::string, int> roles;
    for (const auto& [id, m] : members_) roles[m.role]++;
    std::string out = "# HELP ferry_members Members joined, by role.\n# TYPE ferry_members gauge\n";
    for (const char* r : {"trainer", "rollout", "observer"}) out += fmt::format("ferry_members{{role=\"{}\"}} {}\n", r, roles[r]);
    out += "# HELP ferry_updates_total Weight updates finished, by result.\n# TYPE ferry_updates_total counter\n";
    out += fmt::format("ferry_updates_total{{result=\"ok\"}} {}\n", updates_->updates_ok());
    out += fmt::format("ferry_updates_total{{result=\"failed\"}} {}\n", updates_->updates_failed());
    out += "# HELP ferry_update_in_progress 1 while an update runs.\n# TYPE ferry_update_in_progress gauge\n";
    out += fmt::format("ferry_update_in_progress {}\n", updates_->in_update() ? 1 : 0);
    out += "# HELP ferry_weight_version Weight version each rollout rank holds.\n# TYPE ferry_weight_version gauge\n";
    std::string consistent =
        "# HELP ferry_rank_consistent 1 when the rank holds one complete version.\n# TYPE ferry_rank_consistent gauge\n";
    for (const auto& [id, m] : members_) {
      if (m.role != "rollout") continue;
      const std::string labels = fmt::format("replica=\"{}\",rank=\"{}\"", m.spec.replica, m.spec.tp_rank);
      out += fmt::format("ferry_weight_version{{{}}} {}\n", labels, m.version);
      consistent += fmt::format("ferry_rank_consistent{{{}}} {}\n", labels, m.consistent ? 1 : 0);
    }
    out += consistent;
    if (!updates_->history().empty()) {
      const auto& u = updates_->history().back();
      out += "# HELP ferry_last_update_seconds Duration of the last update.\n# TYPE ferry_last_update_seconds gauge\n";
      out += fmt::format("ferry_last_update_seconds {}\n", u.seconds());
      out += "# HELP ferry_last_update_bytes Bytes the last update moved.\n# TYPE ferry_last_update_bytes gauge\n";
      out += fmt::format("ferry_last_update_bytes {}\n", u.bytes());
    }
    return out;
  }

  void accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket s) {
      if (ec) return;
      auto ch = std::make_shared<Channel>(std::move(s), max_frame_);
      wire::Envelope challenge;
      auto* c = challenge.mutable_challenge();
      c->set_protocol_version(kProtocolVersion);
      c->set_token_required(!token_.empty());
      if (!token_.empty()) {
        auto nonce = make_nonce();
        if (!nonce.ok()) {
          FERRY_LOG_ERROR("{}", nonce.status().message());
          return accept();
        }
        c->set_nonce(*nonce);
      }
      pending_[ch] = c->nonce();
      ch->start([this](const std::shared_ptr<Channel>& x, wire::Envelope& env) { on_message(x, env); },
                [this](const std::shared_ptr<Channel>& x, const Status& why) { on_closed(x, why); });
      ch->send(challenge);
      accept();
    });
  }

  // Drops members silent for longer than the deadline (a stopped or wedged process).
  void arm_reaper() {
    reaper_.expires_after(std::chrono::milliseconds(std::max<int64_t>(timeout_ms_ / 4, 5)));
    reaper_.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      const auto now = Clock::now();
      for (auto& [id, m] : members_) {
        if (now - m.last_seen > std::chrono::milliseconds(timeout_ms_)) {
          FERRY_LOG_WARN("{} sent nothing for over FERRY_TIMEOUT_MS={}; dropping it", m.describe(), timeout_ms_);
          m.channel->close(Status::deadline_exceeded(fmt::format("no heartbeat for over {} ms", timeout_ms_)));
        }
      }
      arm_reaper();
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
        FERRY_LOG_WARN("{} sent message {} before hello; closing it", c->peer(), static_cast<int>(env.body_case()));
        return c->close(Status::failed_precondition("hello expected"));
      }
      return on_hello(c, env.hello());
    }
    m->last_seen = Clock::now();
    switch (env.body_case()) {
      case wire::Envelope::kHeartbeat: return;
      case wire::Envelope::kStatusRequest: {
        wire::Envelope reply;
        *reply.mutable_status_reply() = make_status();
        return c->send(reply);
      }
      case wire::Envelope::kStartUpdate: return updates_->on_start(*m, env.start_update());
      case wire::Envelope::kPauseAck: return updates_->on_pause_ack(*m, env.pause_ack());
      case wire::Envelope::kFinishUpdate: return updates_->on_finish(*m, env.finish_update());
      case wire::Envelope::kFinalized: return updates_->on_finalized(*m, env.finalized());
      case wire::Envelope::kResumeAck: return updates_->on_resume_ack(*m, env.resume_ack());
      case wire::Envelope::kAbortAck: return updates_->on_abort_ack(*m, env.abort_ack());
      default:
        FERRY_LOG_WARN("unexpected message {} from {} ({}); closing it", static_cast<int>(env.body_case()),
                       m->describe(), c->peer());
        c->close(Status::invalid_argument("unexpected message"));
    }
  }

  void refuse(const std::shared_ptr<Channel>& c, const Status& st) {
    FERRY_LOG_WARN("refused {}: {}", c->peer(), st.message());
    wire::Envelope reply;
    to_wire(st, reply.mutable_welcome()->mutable_status());
    c->send(reply);
    c->close(st);
  }

  void on_hello(const std::shared_ptr<Channel>& c, const wire::Hello& h) {
    auto it = pending_.find(c);
    if (it == pending_.end()) return;
    const std::string nonce = it->second;
    pending_.erase(it);
    if (h.protocol_version() != kProtocolVersion) {
      return refuse(c, Status::failed_precondition(fmt::format("protocol version {} from {}; this coordinator speaks {}",
                                                               h.protocol_version(), c->peer(), kProtocolVersion)));
    }
    if (!token_.empty() && !check_answer(token_, nonce, h.auth())) {
      return refuse(c, Status::unauthenticated(
                           fmt::format("{} answered the token challenge {}", c->peer(), h.auth().empty() ? "with nothing" : "wrongly")));
    }
    Member m;
    m.id = next_id_++;
    m.channel = c;
    m.role = h.role();
    m.last_seen = Clock::now();
    if (m.role == "rollout") {
      auto spec = from_wire(h.spec());
      if (!spec.ok()) return refuse(c, spec.status());
      m.spec = std::move(*spec);
      m.endpoints.assign(h.endpoints().begin(), h.endpoints().end());
      m.storage_device = h.storage_device();
      if (m.endpoints.empty()) return refuse(c, Status::invalid_argument("a rollout rank must listen on a data transport"));
    } else if (m.role != "trainer" && m.role != "observer") {
      return refuse(c, Status::invalid_argument("unknown role '" + m.role + "'"));
    } else {
      m.state = "connected";
    }
    wire::Envelope reply;
    reply.mutable_welcome()->set_member_id(m.id);
    c->send(reply);
    FERRY_LOG_INFO("{} joined from {}", m.describe(), c->peer());
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
    pending_.erase(c);
    Member* m = member_of(c);
    if (!m) return;
    FERRY_LOG_INFO("{} left: {}", m->describe(), why.message());
    updates_->on_member_lost(*m, why);
    members_.erase(m->id);
    count_rollout();
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  asio::steady_timer reaper_;
  std::thread thread_;
  std::string address_;
  uint64_t max_frame_ = 0;
  int64_t timeout_ms_ = 0;
  std::string token_;

  MemberTable members_;
  std::map<std::shared_ptr<Channel>, std::string> pending_;  // joined sockets awaiting hello, with nonce
  int next_id_ = 1;
  std::unique_ptr<UpdateMachine> updates_;
  std::unique_ptr<MetricsServer> metrics_;

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
