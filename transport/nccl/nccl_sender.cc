// nccl, sending end: connect() joins a fresh two-rank communicator under its deadline; then one
// worker thread per connection writes each bucket's header and enqueues its grouped ncclSend on a
// dedicated stream, completing handles as their events land (see nccl_wire.h).
#include <unistd.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/log.h"
#include "transport/admission.h"
#include "transport/common/socket.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"
#include "transport/handle.h"
#include "transport/nccl/nccl_wire.h"

namespace ferry::transport::nccl {
namespace {

using cuda_ipc::event_done;
using cuda_ipc::ScopedDevice;

constexpr auto kNotify = std::chrono::seconds(5);
constexpr auto kGroup = std::chrono::seconds(10);
constexpr auto kCloseGrace = std::chrono::seconds(30);
constexpr size_t kMaxInflight = 16;
constexpr int kSpins = 2000;

struct Job {
  std::shared_ptr<CompletionState> state;
  void* src = nullptr;
  uint64_t size = 0;
  std::atomic<bool> cancelled{false};
};

struct Inflight {
  std::shared_ptr<Job> job;
  cudaEvent_t done;
};

class NcclConnection final : public Connection {
 public:
  NcclConnection(net::Socket sock, int device, int receiver_pid, ncclComm_t comm, cudaStream_t stream)
      : sock_(std::move(sock)), device_(device), receiver_pid_(receiver_pid), comm_(comm), stream_(stream) {
    thread_ = std::thread([this] { run(); });
  }

  ~NcclConnection() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_) {
        closing_ = true;
        close_by_ = Clock::now() + kCloseGrace;
      }
    }
    waker_.notify();
    if (thread_.joinable()) thread_.join();
    ScopedDevice d(device_);
    if (comm_ != nullptr) ncclCommAbort(comm_);  // never waits on the peer
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override {
    if (offset > region.size() || size > region.size() - offset) {
      return Status::invalid_argument(fmt::format("nccl post: {} bytes at {} overrun a {}-byte region", size, offset,
                                                  region.size()));
    }
    auto job = std::make_shared<Job>();
    job->state = std::make_shared<CompletionState>();
    job->src = static_cast<uint8_t*>(region.data()) + offset;
    job->size = size;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_ || closing_) return failure_.ok() ? Status::aborted("nccl connection is closed") : failure_;
      queue_.push_back(job);
    }
    waker_.notify();
    std::weak_ptr<Job> weak = job;
    return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(job->state, [weak, this] {
      if (auto j = weak.lock()) j->cancelled = true;
      waker_.notify();
    }));
  }

  void abort() override {
    fail(Status::aborted("nccl connection aborted"), true);
    waker_.notify();
  }

 private:
  void fail(const Status& why, bool tell_peer) {
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

  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

  Status handle_messages() {
    auto more = sock_.read_available(inbuf_);
    FERRY_RETURN_IF_ERROR(more.status());
    net::Msg m;
    while (net::pop_msg(inbuf_, &m)) {
      peer_ended_ = true;
      if (m.type == kRefuse) return Status::aborted(fmt::format("nccl receiver pid {} refused a bucket: {}", receiver_pid_, m.text));
      if (m.type == kClose) return Status::unavailable(fmt::format("nccl receiver pid {} closed: {}", receiver_pid_, m.text));
      return Status::data_loss(fmt::format("nccl: unexpected control message {}", m.type));
    }
    if (!*more) {
      peer_ended_ = true;
      return Status::unavailable(fmt::format("nccl receiver pid {} closed its control socket (it exited or died)", receiver_pid_));
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      return nccl_status(async, "nccl communicator", __FILE__, __LINE__, comm_);
    }
    return ok_status();
  }

  Result<bool> reap() {
    bool progress = false;
    while (!inflight_.empty()) {
      FERRY_ASSIGN_OR_RETURN(bool done, event_done(inflight_.front().done, "cudaEventQuery(send)"));
      if (!done) break;
      inflight_.front().job->state->complete(ok_status());
      events_.push_back(inflight_.front().done);
      inflight_.pop_front();
      progress = true;
    }
    return progress;
  }

  Result<bool> issue() {
    bool progress = false;
    while (inflight_.size() < kMaxInflight) {
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!queue_.empty() && queue_.front()->cancelled) queue_.pop_front();
        if (queue_.empty() || done_) return progress;
        job = queue_.front();
        queue_.pop_front();
      }
      cudaEvent_t ev = nullptr;
      if (events_.empty()) {
        FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      } else {
        ev = events_.back();
        events_.pop_back();
      }
      inflight_.push_back({job, ev});
      net::Msg m;
      m.type = kData;
      m.total = job->size;
      FERRY_RETURN_IF_ERROR(sock_.write_all(&m, sizeof m, Clock::now() + kNotify));
      FERRY_RETURN_IF_ERROR(p2p(true, job->src, job->size, 1, comm_, stream_, ev, Clock::now() + kGroup, sock_.fd()));
      progress = true;
    }
    return progress;
  }

  void run() {
    if (cudaSetDevice(device_) != cudaSuccess) fail(Status::internal("nccl: cannot set the sender's device"), false);
    int idle = 0;
    while (!failed()) {
      Status st = handle_messages();
      Result<bool> reaped = st.ok() ? reap() : Result<bool>(st);
      Result<bool> issued = reaped.ok() ? issue() : Result<bool>(reaped.status());
      if (!issued.ok()) {
        FERRY_LOG_WARN("nccl: connection to pid {} failed: {}", receiver_pid_, issued.status().to_string());
        fail(issued.status(), !peer_ended_);
        break;
      }
      bool closing_now = false, overdue = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        closing_now = closing_ && queue_.empty() && inflight_.empty();
        overdue = closing_ && Clock::now() > close_by_;
      }
      if (closing_now) {
        net::Msg m;
        m.type = kClose;
        (void)sock_.write_all(&m, sizeof m, Clock::now() + kNotify);
        fail(Status::aborted("nccl connection is closed"), false);
        return;
      }
      if (overdue) {
        fail(Status::deadline_exceeded("nccl: a closing connection still had transfers after 30 s"), true);
        break;
      }
      if (*reaped || *issued) {
        idle = 0;
        continue;
      }
      const int fds[] = {sock_.fd(), waker_.fd()};
      const int timeout = !inflight_.empty() ? (++idle < kSpins ? 0 : 1) : 100;
      if (net::wait_readable(fds, 2, timeout) & 2) waker_.drain();
    }
    Status why;
    bool tell = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      why = failure_;
      tell = tell_peer_;
    }
    // Stops kernels still waiting for the receiver, so nothing on this stream hangs.
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    for (auto& f : inflight_) {
      f.job->state->complete(why);
      events_.push_back(f.done);
    }
    inflight_.clear();
    if (tell) {
      const net::Msg m = net::text_msg(kAbort, why.message());
      (void)sock_.write_all(&m, sizeof m, Clock::now() + std::chrono::milliseconds(200));
    }
  }

  net::Socket sock_;
  int device_;
  int receiver_pid_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  net::Waker waker_;

  std::mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool done_ = false;
  bool closing_ = false;
  bool tell_peer_ = false;
  Deadline close_by_{};
  Status failure_;

  // The worker's own.
  std::string inbuf_;
  bool peer_ended_ = false;
  std::deque<Inflight> inflight_;
  std::vector<cudaEvent_t> events_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Connection>> connect(const std::string& blob, int device, Deadline deadline,
                                            std::string_view credential) {
  FERRY_RETURN_IF_ERROR(check_credential(credential));
  const std::string_view scheme = kScheme;
  const size_t colon = blob.rfind(':');
  if (!blob.starts_with(scheme) || colon == std::string::npos || colon <= scheme.size()) {
    return Status::invalid_argument("not an nccl blob (want nccl://<host>:<port>)");
  }
  std::string host = blob.substr(scheme.size(), colon - scheme.size());
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  FERRY_ASSIGN_OR_RETURN(net::Socket sock, net::Socket::connect_tcp(host, blob.substr(colon + 1), deadline));
  const std::string frame = credential_frame(credential);  // first: nothing else is read before it
  FERRY_RETURN_IF_ERROR(sock.write_all(frame.data(), frame.size(), deadline));
  ScopedDevice scoped(device);
  Hello hello{};
  hello.magic = kMagic;
  hello.pid = getpid();
  hello.device = device;
  std::snprintf(hello.bus_id, sizeof hello.bus_id, "%s", cuda_ipc::bus_id(device).c_str());
  FERRY_RETURN_IF_ERROR(sock.write_all(&hello, sizeof hello, deadline));
  Welcome w{};
  FERRY_RETURN_IF_ERROR(sock.read_all(&w, sizeof w, deadline));
  w.reason[sizeof w.reason - 1] = '\0';
  w.bus_id[sizeof w.bus_id - 1] = '\0';
  if (w.magic != kMagic) return Status::invalid_argument("the listener did not answer as an nccl receiver");
  if (!w.accepted) return Status::unavailable(std::string("the receiver could not create an NCCL id: ") + w.reason);
  ncclComm_t comm = nullptr;
  FERRY_RETURN_IF_ERROR(init_comm(&comm, w.id, 0, deadline, sock.fd())
                            .with_context(fmt::format("communicator from {} (cuda:{}) to pid {} on {}", hello.bus_id,
                                                      device, w.pid, w.bus_id)));
  cudaStream_t stream = nullptr;
  cudaEvent_t ev = nullptr;
  void* warm = nullptr;
  Status st = [&]() -> Status {
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    FERRY_CUDA_CHECK(cudaMallocAsync(&warm, kWarmupBytes, stream));
    FERRY_CUDA_CHECK(cudaMemsetAsync(warm, 0, kWarmupBytes, stream));
    return warm_up(true, warm, 1, comm, stream, ev, deadline, sock.fd());
  }();
  if (!st.ok()) ncclCommAbort(comm);  // first: it ends kernels still waiting for the receiver
  if (warm != nullptr) cudaFreeAsync(warm, stream);
  if (ev != nullptr) cudaEventDestroy(ev);
  if (!st.ok()) {
    if (stream != nullptr) cudaStreamDestroy(stream);
    return st;
  }
  return std::unique_ptr<Connection>(std::make_unique<NcclConnection>(std::move(sock), device, w.pid, comm, stream));
}

}  // namespace ferry::transport::nccl
