#include "transport/common/device_receiver.h"

#include <fmt/format.h>

#include "core/log.h"
#include "transport/admission.h"

namespace ferry::transport::net {
namespace {
constexpr int kSpins = 2000;
}  // namespace

DeviceReceiver::DeviceReceiver(std::string_view transport, ControlTypes types, Listener listener,
                               PeerClosedCallback on_closed, AdmitCallback admit, uint64_t default_max_bucket)
    : transport_(transport), types_(types), listener_(std::move(listener)), on_closed_(std::move(on_closed)),
      admissions_(std::string(transport), std::move(admit), default_max_bucket) {}

DeviceReceiver::~DeviceReceiver() { halt(); }

void DeviceReceiver::start() { thread_ = std::thread([this] { run(); }); }

bool DeviceReceiver::halt() {
  if (stop_.exchange(true)) return false;
  waker_.notify();
  if (thread_.joinable()) thread_.join();
  admissions_.clear();
  return true;
}

void DeviceReceiver::say_goodbye() {
  for (auto& p : peers_) {
    const Msg m = text_msg(types_.close, transport_ + " receiver shut down");
    (void)p->sock.write_all(&m, sizeof m, Clock::now() + std::chrono::milliseconds(100));
  }
}

Status DeviceReceiver::check_bucket(const DevicePeer& p, uint64_t size) const {
  return size > p.max_bucket ? bucket_over_limit(transport_, size, p.max_bucket) : ok_status();
}

Status DeviceReceiver::read_control(DevicePeer& p) {
  if (p.eof) return ok_status();
  auto more = p.sock.read_available(p.inbuf);
  if (!more.ok()) return more.status();
  p.eof = !*more;
  return ok_status();
}

void DeviceReceiver::run() {
  thread_started();
  int idle = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    bool progress = false, gpu_wait = false;
    for (;;) {
      Socket s = listener_.accept();
      if (!s.valid()) break;
      progress = true;
      admissions_.add(std::move(s));
    }
    admissions_.poll([this](Socket s, const Admission& granted) { on_admitted(std::move(s), granted); }, &progress);
    adopt(&progress);
    for (size_t k = 0; k < peers_.size();) {
      DevicePeer& p = *peers_[k];
      std::optional<Status> closing = serve(p, &progress, &gpu_wait);
      if (!closing) {
        ++k;
        continue;
      }
      if (!closing->ok() && !p.eof) {
        const Msg m = text_msg(types_.refuse, closing->message());
        (void)p.sock.write_all(&m, sizeof m, Clock::now() + std::chrono::milliseconds(100));
      }
      FERRY_LOG_DEBUG("{}: sender pid {} closed: {}", transport_, p.pid, closing->to_string());
      peers_.erase(peers_.begin() + static_cast<std::ptrdiff_t>(k));
      if (on_closed_) on_closed_(*closing);
      progress = true;
    }
    if (progress) {
      idle = 0;
      continue;
    }
    std::vector<int> fds = {listener_.poll_fd(), waker_.fd()};
    for (auto& p : peers_) fds.push_back(p->sock.fd());
    admissions_.append_fds(fds);
    // A copy or receive in flight is polled (it ends in microseconds to milliseconds); otherwise
    // sleep on the sockets, bounded so stop() is seen even if the waker were missed, and so a
    // silent peer's admission deadline is kept.
    const int timeout = listener_.timeout_ms(admissions_.timeout_ms(gpu_wait ? (++idle < kSpins ? 0 : 1) : 100));
    if (wait_readable(fds.data(), fds.size(), timeout) & 2) waker_.drain();
  }
}

}  // namespace ferry::transport::net
