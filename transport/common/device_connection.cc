#include "transport/common/device_connection.h"

#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "core/log.h"
#include "transport/listen_host.h"

namespace ferry::transport::net {
namespace {

constexpr auto kNotify = std::chrono::seconds(5);
constexpr auto kCloseGrace = std::chrono::seconds(30);
constexpr int kSpins = 2000;

}  // namespace

DeviceConnection::DeviceConnection(std::string_view transport, ControlTypes types, Socket sock, int device,
                                   int receiver_pid)
    : sock_(std::move(sock)), device_(device), receiver_pid_(receiver_pid), transport_(transport),
      same_host_(peer_on_this_host(sock_.fd())), types_(types) {}

DeviceConnection::~DeviceConnection() { close_and_join(); }

void DeviceConnection::start() { thread_ = std::thread([this] { run(); }); }

void DeviceConnection::close_and_join() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) {
      closing_ = true;
      close_by_ = Clock::now() + kCloseGrace;
    }
  }
  waker_.notify();
  if (thread_.joinable()) thread_.join();
}

Result<std::unique_ptr<TransferHandle>> DeviceConnection::post(const MemoryRegion& region, size_t offset, size_t size) {
  if (offset > region.size() || size > region.size() - offset) {
    return Status::invalid_argument(
        fmt::format("{} post: {} bytes at {} overrun a {}-byte region", transport_, size, offset, region.size()));
  }
  auto job = std::make_shared<Job>();
  job->state = std::make_shared<CompletionState>();
  job->src = static_cast<uint8_t*>(region.data()) + offset;
  job->size = size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || closing_) return failure_.ok() ? Status::aborted(transport_ + " connection is closed") : failure_;
    queue_.push_back(job);
  }
  waker_.notify();
  std::weak_ptr<Job> weak = job;
  return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(job->state, [weak, this] {
    if (auto j = weak.lock()) j->cancelled = true;
    waker_.notify();
  }));
}

void DeviceConnection::abort() {
  fail(Status::aborted(transport_ + " connection aborted"), /*tell_peer=*/true);
  waker_.notify();
}

void DeviceConnection::fail(const Status& why, bool tell_peer) {
  std::deque<std::shared_ptr<Job>> queue;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    failure_ = why;
    tell_peer_ = tell_peer;
    queue.swap(queue_);
  }
  for (auto& j : queue) j->state->complete(why);
}

bool DeviceConnection::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::shared_ptr<Job> DeviceConnection::front_job() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!queue_.empty() && !queue_.front()->started && queue_.front()->cancelled) queue_.pop_front();
  if (queue_.empty() || done_) return nullptr;
  return queue_.front();
}

void DeviceConnection::pop_job(const std::shared_ptr<Job>& job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!queue_.empty() && queue_.front() == job) queue_.pop_front();
}

Status DeviceConnection::on_message(const Msg& m) {
  peer_ended_ = true;
  return Status::data_loss(fmt::format("{}: unexpected control message {}", transport_, m.type));
}

Status DeviceConnection::handle_messages() {
  auto more = sock_.read_available(inbuf_);
  FERRY_RETURN_IF_ERROR(more.status());
  Msg m;
  while (pop_msg(inbuf_, &m)) {
    if (m.type == types_.refuse) {
      peer_ended_ = true;
      return Status::aborted(fmt::format("{} receiver pid {} refused a bucket: {}", transport_, receiver_pid_, m.text));
    }
    if (m.type == types_.close) {
      peer_ended_ = true;
      return Status::unavailable(fmt::format("{} receiver pid {} closed: {}", transport_, receiver_pid_, m.text));
    }
    FERRY_RETURN_IF_ERROR(on_message(m));
  }
  if (!*more) {
    peer_ended_ = true;
    return Status::unavailable(fmt::format(
        "{} receiver pid {} closed its control socket (it exited, shut down or died)", transport_, receiver_pid_));
  }
  return ok_status();
}

void DeviceConnection::run() {
  if (cudaSetDevice(device_) != cudaSuccess) fail(Status::internal(transport_ + ": cannot set the sender's device"), false);
  int idle = 0;
  while (!failed()) {
    bool gpu_wait = false;
    Status st = handle_messages();
    if (st.ok()) st = check();
    Result<bool> reaped = st.ok() ? reap() : Result<bool>(st);
    Result<bool> issued = reaped.ok() ? issue(&gpu_wait) : Result<bool>(reaped.status());
    if (!issued.ok()) {
      FERRY_LOG_WARN("{}: connection to pid {} failed: {}", transport_, receiver_pid_, issued.status().to_string());
      fail(issued.status(), !peer_ended_);
      break;
    }
    bool closing_now = false, overdue = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_now = closing_ && queue_.empty() && !in_flight();
      overdue = closing_ && Clock::now() > close_by_;
    }
    if (closing_now) {
      Msg m;
      m.type = types_.close;
      (void)sock_.write_all(&m, sizeof m, Clock::now() + kNotify);
      fail(Status::aborted(transport_ + " connection is closed"), false);
      return;
    }
    if (overdue) {
      fail(Status::deadline_exceeded(transport_ + ": a closing connection still had transfers after 30 s"), true);
      break;
    }
    if (*reaped || *issued) {
      idle = 0;
      continue;
    }
    const int fds[] = {sock_.fd(), waker_.fd()};
    const bool busy_gpu = gpu_wait || in_flight();
    const int timeout = busy_gpu ? (++idle < kSpins ? 0 : 1) : 100;
    if (wait_readable(fds, 2, timeout) & 2) waker_.drain();
  }
  // Failed: complete what is in flight with the failure and tell the receiver why.
  Status why;
  bool tell = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = failure_;
    tell = tell_peer_;
  }
  fail_in_flight(why);
  if (tell) {
    const Msg m = text_msg(types_.abort, why.message());
    (void)sock_.write_all(&m, sizeof m, Clock::now() + std::chrono::milliseconds(200));
  }
}

}  // namespace ferry::transport::net
