#include "coordinator/coordinator.h"

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/accept_loop.h"
#include "core/asio.h"
#include "core/log.h"
#include "core/settings.h"
#include "coordinator/auth.h"
#include "coordinator/channel.h"
#include "coordinator/metrics_http.h"
#include "coordinator/coordinator_core.h"

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
    FERRY_ASSIGN_OR_RETURN(const Settings settings, settings_or_environment(o.settings));
    apply_process_settings(settings);
    CoreOptions co;
    co.max_frame = settings.max_frame_bytes;
    co.timeout_ms = settings.timeout_ms;
    co.token = settings.token;
    if (co.timeout_ms < 10) return Status::invalid_argument("FERRY_TIMEOUT_MS (timeout_ms) must be at least 10");
    co.nonce = make_nonce;
    timeout_ms_ = co.timeout_ms;
    const bool token = !co.token.empty();
    core_ = std::make_unique<CoordinatorCore>(io_, std::move(co));
    core_->set_on_members_changed([this] { count_rollout(); });
    const std::string host = o.host.empty() ? settings.listen_host : o.host;
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
    accept_forever(acceptor_, [this](tcp::socket s) { on_accept(std::move(s)); }, "coordinator " + address_);
    arm_reaper();
    std::optional<uint16_t> mport = o.metrics_port;
    if (!mport && settings.metrics_port > 0) mport = static_cast<uint16_t>(settings.metrics_port);
    if (mport) {
      FERRY_ASSIGN_OR_RETURN(metrics_, MetricsServer::start(io_, host, *mport, [this] { return core_->metrics(); }));
    }
    thread_ = std::thread([this] { run_io(io_); });
    FERRY_LOG_INFO("coordinator listening on {}{}", address_, token ? " (token required)" : "");
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
    asio::post(const_cast<asio::io_context&>(io_), [&] { p.set_value(core_->status()); });
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
      core_->stop("the coordinator stopped: the job ended");
    });
    work_.reset();
    thread_.join();
  }

 private:
  void on_accept(tcp::socket s) {
    auto ch = std::make_shared<Channel>(std::move(s), kPreAuthFrameBytes);
    auto challenge = core_->on_connect(ch);
    if (!challenge.ok()) {
      FERRY_LOG_ERROR("{}", challenge.status().message());
      return ch->close(challenge.status());
    }
    ch->start([this](const std::shared_ptr<Channel>& x, wire::Envelope& env) { core_->on_message(x, env); },
              [this](const std::shared_ptr<Channel>& x, const Status& why) { core_->on_closed(x, why); });
    ch->send(*challenge);
  }

  // Drops members silent for longer than the deadline (a stopped or wedged process) and
  // connections that did not join within it.
  void arm_reaper() {
    reaper_.expires_after(std::chrono::milliseconds(std::max<int64_t>(timeout_ms_ / 4, 5)));
    reaper_.async_wait([this](boost::system::error_code ec) {
      if (ec) return;
      core_->reap(Clock::now());
      arm_reaper();
    });
  }

  void count_rollout() {
    const int n = core_->rollout_ranks();
    {
      std::lock_guard<std::mutex> lock(mu_);
      n_rollout_ = n;
    }
    cv_.notify_all();
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  asio::steady_timer reaper_;
  std::thread thread_;
  std::string address_;
  int64_t timeout_ms_ = 0;
  std::unique_ptr<CoordinatorCore> core_;
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
