// cuda_ipc, sending end: maps the receiver's ring once, then one worker thread per connection
// copies buckets slot by slot on its own stream, records the slot's `filled` event, and announces
// it; a slot is reused only after the receiver's kFree and its `freed` event (see cuda_ipc_wire.h).
#include <unistd.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/log.h"
#include "transport/admission.h"
#include "transport/common/socket.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"
#include "transport/handle.h"

namespace ferry::transport::cuda_ipc {
namespace {

constexpr auto kNotify = std::chrono::seconds(5);
constexpr auto kCloseGrace = std::chrono::seconds(30);
constexpr int kSpins = 2000;

struct Job {
  std::shared_ptr<CompletionState> state;
  const uint8_t* src = nullptr;
  uint64_t size = 0;
  uint64_t sent = 0;
  bool started = false;
  std::atomic<bool> cancelled{false};
};

struct Inflight {
  uint32_t slot;
  std::shared_ptr<Job> job;
  bool last;
};

class IpcConnection final : public Connection {
 public:
  IpcConnection(net::Socket sock, int device, const RingInfo& info, uint8_t* ring, bool opened_ring,
                std::shared_ptr<RingResources> local_ring, cudaEvent_t* freed, bool opened_freed,
                std::shared_ptr<FilledEvents> filled, cudaStream_t stream)
      : sock_(std::move(sock)), device_(device), slots_(info.slots), slot_bytes_(info.slot_bytes),
        receiver_pid_(info.pid), ring_(ring), opened_ring_(opened_ring), local_ring_(std::move(local_ring)),
        opened_freed_(opened_freed), filled_(std::move(filled)), stream_(stream) {
    for (uint32_t i = 0; i < slots_; ++i) freed_[i] = freed[i];
    thread_ = std::thread([this] { run(); });
  }

  ~IpcConnection() override {
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
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (opened_freed_) {
      for (uint32_t i = 0; i < slots_; ++i) cudaEventDestroy(freed_[i]);
    }
    if (opened_ring_) cudaIpcCloseMemHandle(ring_);
  }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override {
    if (offset > region.size() || size > region.size() - offset) {
      return Status::invalid_argument(fmt::format("cuda_ipc post: {} bytes at {} overrun a {}-byte region", size,
                                                  offset, region.size()));
    }
    auto job = std::make_shared<Job>();
    job->state = std::make_shared<CompletionState>();
    job->src = static_cast<const uint8_t*>(region.data()) + offset;
    job->size = size;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_ || closing_) return failure_.ok() ? Status::aborted("cuda_ipc connection is closed") : failure_;
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
    fail(Status::aborted("cuda_ipc connection aborted"), /*tell_peer=*/true);
    waker_.notify();
  }

 private:
  // Fails every queued and in-flight transfer; the worker then says kAbort and exits.
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
      if (m.type == kFree && m.slot < slots_) {
        busy_[m.slot] = false;
      } else if (m.type == kRefuse) {
        peer_ended_ = true;
        return Status::aborted(fmt::format("cuda_ipc receiver pid {} refused a bucket: {}", receiver_pid_, m.text));
      } else if (m.type == kClose) {
        peer_ended_ = true;
        return Status::unavailable(fmt::format("cuda_ipc receiver pid {} closed: {}", receiver_pid_, m.text));
      } else {
        return Status::data_loss(fmt::format("cuda_ipc: unexpected control message {} (slot {})", m.type, m.slot));
      }
    }
    if (!*more) {
      peer_ended_ = true;
      return Status::unavailable(fmt::format(
          "cuda_ipc receiver pid {} closed its control socket (it exited, shut down or died)", receiver_pid_));
    }
    return ok_status();
  }

  // Completes transfers whose last copy has landed; true on progress.
  Result<bool> reap() {
    bool progress = false;
    while (!inflight_.empty()) {
      const Inflight& f = inflight_.front();
      FERRY_ASSIGN_OR_RETURN(bool done, event_done(filled_->filled[f.slot], "cudaEventQuery(filled)"));
      if (!done) break;
      if (f.last) f.job->state->complete(ok_status());
      inflight_.pop_front();
      progress = true;
    }
    return progress;
  }

  // Copies queued buckets into free slots; sets *gpu_wait when a slot waits on its freed event.
  Result<bool> issue(bool* gpu_wait) {
    bool progress = false;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!queue_.empty() && !queue_.front()->started && queue_.front()->cancelled) queue_.pop_front();
        if (queue_.empty() || done_) return progress;
        job = queue_.front();
      }
      const uint32_t slot = static_cast<uint32_t>(record_ % slots_);
      if (busy_[slot] || inflight_.size() >= slots_) return progress;
      FERRY_ASSIGN_OR_RETURN(bool freed, event_done(freed_[slot], "cudaEventQuery(freed)"));
      if (!freed) {
        *gpu_wait = true;
        return progress;
      }
      const uint64_t len = std::min<uint64_t>(slot_bytes_, job->size - job->sent);
      if (len > 0) {
        FERRY_CUDA_CHECK(cudaMemcpyAsync(ring_ + slot * slot_bytes_, job->src + job->sent, len, cudaMemcpyDefault, stream_));
      }
      FERRY_CUDA_CHECK(cudaEventRecord(filled_->filled[slot], stream_));
      net::Msg m;
      m.type = kReady;
      m.slot = slot;
      m.total = job->size;
      m.offset = job->sent;
      m.length = len;
      FERRY_RETURN_IF_ERROR(sock_.write_all(&m, sizeof m, Clock::now() + kNotify));
      job->started = true;
      job->sent += len;
      busy_[slot] = true;
      ++record_;
      const bool last = job->sent == job->size;
      inflight_.push_back({slot, job, last});
      if (last) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!queue_.empty() && queue_.front() == job) queue_.pop_front();
      }
      progress = true;
    }
  }

  void run() {
    if (cudaSetDevice(device_) != cudaSuccess) fail(Status::internal("cuda_ipc: cannot set the sender's device"), false);
    int idle = 0;
    while (!failed()) {
      bool gpu_wait = false;
      Status st = handle_messages();
      Result<bool> reaped = st.ok() ? reap() : Result<bool>(st);
      Result<bool> issued = reaped.ok() ? issue(&gpu_wait) : Result<bool>(reaped.status());
      if (!issued.ok()) {
        FERRY_LOG_WARN("cuda_ipc: connection to pid {} failed: {}", receiver_pid_, issued.status().to_string());
        fail(issued.status(), !peer_ended_);
        break;
      }
      bool closing = false, closing_now = false, overdue = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        closing = closing_;
        closing_now = closing_ && queue_.empty() && inflight_.empty();
        overdue = closing_ && Clock::now() > close_by_;
      }
      if (closing_now) {
        net::Msg m;
        m.type = kClose;
        (void)sock_.write_all(&m, sizeof m, Clock::now() + kNotify);
        fail(Status::aborted("cuda_ipc connection is closed"), false);
        return;
      }
      if (overdue) {
        fail(Status::deadline_exceeded("cuda_ipc: a closing connection still had transfers after 30 s"), true);
        break;
      }
      (void)closing;
      if (*reaped || *issued) {
        idle = 0;
        continue;
      }
      const int fds[] = {sock_.fd(), waker_.fd()};
      const bool busy_gpu = gpu_wait || !inflight_.empty();
      const int timeout = busy_gpu ? (++idle < kSpins ? 0 : 1) : 100;
      if (net::wait_readable(fds, 2, timeout) & 2) waker_.drain();
    }
    // Failed: complete what is in flight with the failure and tell the receiver why.
    Status why;
    bool tell = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      why = failure_;
      tell = tell_peer_;
    }
    for (auto& f : inflight_) f.job->state->complete(why);
    inflight_.clear();
    if (tell) {
      const net::Msg m = net::text_msg(kAbort, why.message());
      (void)sock_.write_all(&m, sizeof m, Clock::now() + std::chrono::milliseconds(200));
    }
  }

  net::Socket sock_;
  int device_;
  uint32_t slots_;
  uint64_t slot_bytes_;
  int receiver_pid_;
  uint8_t* ring_;
  bool opened_ring_;
  std::shared_ptr<RingResources> local_ring_;  // keeps the ring alive when both ends share a process
  cudaEvent_t freed_[kMaxSlots] = {};
  bool opened_freed_;
  std::shared_ptr<FilledEvents> filled_;
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
  bool busy_[kMaxSlots] = {};
  uint64_t record_ = 0;
  std::deque<Inflight> inflight_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Connection>> connect(const std::string& blob, int device, Deadline deadline,
                                            std::string_view credential) {
  FERRY_RETURN_IF_ERROR(check_credential(credential));
  const std::string_view scheme = kScheme;
  const size_t slash = blob.find('/', scheme.size());
  if (!blob.starts_with(scheme) || slash == std::string::npos || slash + 1 >= blob.size()) {
    return Status::invalid_argument("not a cuda_ipc blob (want cuda_ipc://<boot id>/<name>)");
  }
  const std::string boot = blob.substr(scheme.size(), slash - scheme.size());
  if (boot != net::boot_id()) {
    return Status::unavailable("the cuda_ipc receiver runs on another node (boot id " + boot + ")");
  }
  FERRY_ASSIGN_OR_RETURN(net::Socket sock, net::Socket::connect_unix(blob.substr(slash + 1), deadline));
  const std::string frame = credential_frame(credential);  // first: nothing else is read before it
  FERRY_RETURN_IF_ERROR(sock.write_all(frame.data(), frame.size(), deadline));
  ScopedDevice scoped(device);
  Hello hello{};
  hello.magic = kMagic;
  hello.process_nonce = net::process_nonce();
  hello.pid = getpid();
  hello.device = device;
  std::snprintf(hello.bus_id, sizeof hello.bus_id, "%s", bus_id(device).c_str());
  FERRY_RETURN_IF_ERROR(sock.write_all(&hello, sizeof hello, deadline));
  RingInfo info{};
  FERRY_RETURN_IF_ERROR(sock.read_all(&info, sizeof info, deadline));
  info.reason[sizeof info.reason - 1] = '\0';
  info.bus_id[sizeof info.bus_id - 1] = '\0';
  if (info.magic != kMagic) return Status::invalid_argument("the listener did not answer as a cuda_ipc receiver");
  if (!info.accepted) return Status::unavailable(std::string("the receiver could not set up a ring: ") + info.reason);
  if (info.slots == 0 || info.slots > kMaxSlots || info.slot_bytes == 0) return Status::data_loss("malformed ring info");

  SenderEvents se{};
  se.magic = kMagic;
  uint8_t* ring = nullptr;
  cudaEvent_t freed[kMaxSlots] = {};
  std::shared_ptr<RingResources> local_ring;
  const bool same_process = info.process_nonce == net::process_nonce();
  bool opened_ring = false, opened_freed = false;
  auto filled = std::make_shared<FilledEvents>();
  filled->device = device;
  cudaStream_t stream = nullptr;
  Status st = [&]() -> Status {
    if (same_process) {
      local_ring = std::static_pointer_cast<RingResources>(find_local(info.local_id));
      if (!local_ring) return Status::internal("the receiver's ring is gone");
      ring = static_cast<uint8_t*>(local_ring->ring);
      for (uint32_t i = 0; i < info.slots; ++i) freed[i] = local_ring->freed[i];
      if (info.device != device) {
        const cudaError_t e = cudaDeviceEnablePeerAccess(info.device, 0);
        if (e != cudaSuccess) (void)cudaGetLastError();  // already on, or copies go through the host
      }
    } else {
      void* p = nullptr;
      const cudaError_t e = cudaIpcOpenMemHandle(&p, info.ring, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        return cuda_status(e, "cudaIpcOpenMemHandle", __FILE__, __LINE__)
            .with_context(fmt::format("mapping the ring of pid {} on {} (cuda:{}) into cuda:{} ({}): are both GPUs "
                                      "visible to both processes and can they reach each other (peer access)?",
                                      info.pid, info.bus_id, info.device, device, hello.bus_id));
      }
      ring = static_cast<uint8_t*>(p);
      opened_ring = true;
      opened_freed = true;
      for (uint32_t i = 0; i < info.slots; ++i) FERRY_CUDA_CHECK(cudaIpcOpenEventHandle(&freed[i], info.freed[i]));
    }
    filled->slots = info.slots;
    FERRY_RETURN_IF_ERROR(create_ipc_events(filled->filled, info.slots));
    for (uint32_t i = 0; i < info.slots; ++i) FERRY_CUDA_CHECK(cudaIpcGetEventHandle(&se.filled[i], filled->filled[i]));
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return ok_status();
  }();
  se.ok = st.ok() ? 1 : 0;
  se.local_id = publish_local(filled);
  if (!st.ok()) std::snprintf(se.reason, sizeof se.reason, "%s", st.message().c_str());
  Status sent = sock.write_all(&se, sizeof se, deadline);
  if (st.ok()) st = sent;
  if (!st.ok()) {
    if (stream != nullptr) cudaStreamDestroy(stream);
    for (uint32_t i = 0; opened_freed && i < info.slots; ++i) {
      if (freed[i] != nullptr) cudaEventDestroy(freed[i]);
    }
    if (opened_ring) cudaIpcCloseMemHandle(ring);
    return st;
  }
  return std::unique_ptr<Connection>(std::make_unique<IpcConnection>(std::move(sock), device, info, ring, opened_ring,
                                                                     std::move(local_ring), freed, opened_freed,
                                                                     std::move(filled), stream));
}

}  // namespace ferry::transport::cuda_ipc
