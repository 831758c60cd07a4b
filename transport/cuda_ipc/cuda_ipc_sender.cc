// cuda_ipc, sending end: maps the receiver's ring once, then one worker thread per connection
// (net::DeviceConnection) copies buckets slot by slot on its own stream, records the slot's
// `filled` event, and announces it; a slot is reused only after the receiver's kFree and its
// `freed` event (see cuda_ipc_wire.h).
#include <unistd.h>

#include <deque>

#include <fmt/format.h>

#include "transport/admission.h"
#include "transport/common/device_connection.h"
#include "transport/common/socket.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"

namespace ferry::transport::cuda_ipc {
namespace {

constexpr auto kNotify = std::chrono::seconds(5);

struct Inflight {
  uint32_t slot;
  std::shared_ptr<net::Job> job;
  bool last;
};

class IpcConnection final : public net::DeviceConnection {
 public:
  IpcConnection(net::Socket sock, int device, const RingInfo& info, uint8_t* ring, bool opened_ring,
                std::shared_ptr<RingResources> local_ring, cudaEvent_t* freed, bool opened_freed,
                std::shared_ptr<FilledEvents> filled, cudaStream_t stream)
      : DeviceConnection("cuda_ipc", {kClose, kAbort, kRefuse}, std::move(sock), device, info.pid),
        slots_(info.slots), slot_bytes_(info.slot_bytes), ring_(ring), opened_ring_(opened_ring),
        local_ring_(std::move(local_ring)), opened_freed_(opened_freed), filled_(std::move(filled)), stream_(stream) {
    for (uint32_t i = 0; i < slots_; ++i) freed_[i] = freed[i];
    start();
  }

  ~IpcConnection() override {
    close_and_join();
    ScopedDevice d(device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (opened_freed_) {
      for (uint32_t i = 0; i < slots_; ++i) cudaEventDestroy(freed_[i]);
    }
    if (opened_ring_) cudaIpcCloseMemHandle(ring_);
  }

 private:
  Status on_message(const net::Msg& m) override {
    if (m.type == kFree && m.slot < slots_) {
      busy_[m.slot] = false;
      return ok_status();
    }
    return Status::data_loss(fmt::format("cuda_ipc: unexpected control message {} (slot {})", m.type, m.slot));
  }

  Result<bool> reap() override {
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

  // Copies queued buckets into free slots, a slot's worth at a time.
  Result<bool> issue(bool* gpu_wait) override {
    bool progress = false;
    for (;;) {
      std::shared_ptr<net::Job> job = front_job();
      if (!job) return progress;
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
      if (last) pop_job(job);
      progress = true;
    }
  }

  bool in_flight() const override { return !inflight_.empty(); }

  void fail_in_flight(const Status& why) override {
    for (auto& f : inflight_) f.job->state->complete(why);
    inflight_.clear();
  }

  uint32_t slots_;
  uint64_t slot_bytes_;
  uint8_t* ring_;
  bool opened_ring_;
  std::shared_ptr<RingResources> local_ring_;  // keeps the ring alive when both ends share a process
  cudaEvent_t freed_[kMaxSlots] = {};
  bool opened_freed_;
  std::shared_ptr<FilledEvents> filled_;
  cudaStream_t stream_;

  // The worker's own.
  bool busy_[kMaxSlots] = {};
  uint64_t record_ = 0;
  std::deque<Inflight> inflight_;
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
