// cuda_ipc, receiving end and the transport: one thread (net::DeviceReceiver) accepts senders, owns
// each one's device ring, and hands buckets to the callback in place (fragments of larger buckets
// are assembled in a device buffer first). Callbacks never run concurrently.
#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <unistd.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/log.h"
#include "transport/common/device_receiver.h"
#include "transport/common/device_transport.h"
#include "transport/common/socket.h"
#include "transport/cuda_ipc/cuda_ipc_wire.h"

namespace ferry::transport {
namespace cuda_ipc {

RingResources::~RingResources() {
  ScopedDevice d(device);
  for (uint32_t i = 0; i < slots; ++i) {
    if (freed[i] != nullptr) cudaEventDestroy(freed[i]);
  }
  if (ring != nullptr) cudaFree(ring);
}

FilledEvents::~FilledEvents() {
  ScopedDevice d(device);
  for (uint32_t i = 0; i < slots; ++i) {
    if (filled[i] != nullptr) cudaEventDestroy(filled[i]);
  }
}

namespace {
std::mutex g_local_mu;
std::map<uint64_t, std::weak_ptr<void>> g_local;
uint64_t g_next_local = 1;
}  // namespace

uint64_t publish_local(const std::shared_ptr<void>& p) {
  std::lock_guard<std::mutex> lock(g_local_mu);
  std::erase_if(g_local, [](const auto& kv) { return kv.second.expired(); });
  g_local[g_next_local] = p;
  return g_next_local++;
}

std::shared_ptr<void> find_local(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_local_mu);
  auto it = g_local.find(id);
  return it == g_local.end() ? nullptr : it->second.lock();
}

Status create_ipc_events(cudaEvent_t* events, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&events[i], cudaEventInterprocess | cudaEventDisableTiming));
  }
  return ok_status();
}

}  // namespace cuda_ipc

namespace {

using namespace cuda_ipc;

constexpr auto kHandshake = std::chrono::seconds(10);
constexpr auto kNotify = std::chrono::seconds(2);

struct Peer final : net::DevicePeer {
  std::shared_ptr<RingResources> ring;
  uint64_t slot_bytes = 0;
  // Opened from the sender's handles (owned here), or the sender's own in the same process.
  std::shared_ptr<FilledEvents> local_filled;
  cudaEvent_t filled[kMaxSlots] = {};
  bool owns_filled = false;
  std::deque<net::Msg> ready;
  uint64_t record = 0;
  void* assembly = nullptr;
  uint64_t assembly_cap = 0;
  uint64_t assembled = 0;

  ~Peer() override {
    ScopedDevice d(ring ? ring->device : 0);
    if (owns_filled) {
      for (uint32_t i = 0; ring && i < ring->slots; ++i) {
        if (filled[i] != nullptr) cudaEventDestroy(filled[i]);
      }
    }
    if (assembly != nullptr) cudaFree(assembly);
  }
};

class IpcReceiver final : public net::DeviceReceiver {
 public:
  IpcReceiver(net::Listener listener, int device, uint32_t slots, uint64_t slot_bytes, uint64_t default_max_bucket,
              BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit)
      : DeviceReceiver("cuda_ipc", {kClose, kAbort, kRefuse}, std::move(listener), std::move(on_closed),
                       std::move(admit), default_max_bucket),
        device_(device), slots_(slots), slot_bytes_(slot_bytes), on_bucket_(std::move(on_bucket)) {
    start();
  }
  ~IpcReceiver() override { stop(); }

  void stop() override {
    if (!halt()) return;
    say_goodbye();
    ScopedDevice d(device_);
    peers_.clear();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  // An admitted sender's handshake; its ring is allocated only now.
  Status accept_peer(net::Socket s, const Admission& granted) {
    const Deadline deadline = Clock::now() + kHandshake;
    Hello hello{};
    FERRY_RETURN_IF_ERROR(s.read_all(&hello, sizeof hello, deadline));
    if (hello.magic != kMagic) return Status::invalid_argument("a connection without the cuda_ipc hello");
    hello.bus_id[sizeof hello.bus_id - 1] = '\0';
    auto peer = std::make_unique<Peer>();
    peer->pid = hello.pid;
    peer->identity = granted.peer;
    peer->max_bucket = granted.max_bucket_bytes;
    peer->slot_bytes = slot_bytes_;
    RingInfo info{};
    info.magic = kMagic;
    info.process_nonce = net::process_nonce();
    info.device = device_;
    info.pid = getpid();
    std::snprintf(info.bus_id, sizeof info.bus_id, "%s", bus_id(device_).c_str());
    Status st = [&]() -> Status {
      auto r = std::make_shared<RingResources>();
      r->device = device_;
      FERRY_CUDA_CHECK(cudaMalloc(&r->ring, slots_ * slot_bytes_));
      r->slots = slots_;
      FERRY_RETURN_IF_ERROR(create_ipc_events(r->freed, slots_));
      FERRY_CUDA_CHECK(cudaIpcGetMemHandle(&info.ring, r->ring));
      for (uint32_t i = 0; i < slots_; ++i) FERRY_CUDA_CHECK(cudaIpcGetEventHandle(&info.freed[i], r->freed[i]));
      info.local_id = publish_local(r);
      peer->ring = std::move(r);
      return ok_status();
    }();
    info.accepted = st.ok() ? 1 : 0;
    info.slots = slots_;
    info.slot_bytes = slot_bytes_;
    if (!st.ok()) std::snprintf(info.reason, sizeof info.reason, "%s", st.message().c_str());
    FERRY_RETURN_IF_ERROR(s.write_all(&info, sizeof info, deadline));
    FERRY_RETURN_IF_ERROR(st);
    SenderEvents se{};
    FERRY_RETURN_IF_ERROR(s.read_all(&se, sizeof se, deadline));
    se.reason[sizeof se.reason - 1] = '\0';
    if (se.magic != kMagic) return Status::invalid_argument("malformed cuda_ipc sender events");
    if (!se.ok) return Status::unavailable(fmt::format("sender pid {} could not map the ring: {}", hello.pid, se.reason));
    if (hello.process_nonce == net::process_nonce()) {
      peer->local_filled = std::static_pointer_cast<FilledEvents>(find_local(se.local_id));
      if (!peer->local_filled) return Status::internal("cuda_ipc: the sender's events are gone");
      for (uint32_t i = 0; i < slots_; ++i) peer->filled[i] = peer->local_filled->filled[i];
    } else {
      peer->owns_filled = true;
      for (uint32_t i = 0; i < slots_; ++i) FERRY_CUDA_CHECK(cudaIpcOpenEventHandle(&peer->filled[i], se.filled[i]));
    }
    FERRY_LOG_DEBUG("cuda_ipc: sender pid {} on {} connected to the ring on {} ({} x {} bytes)", hello.pid,
                    hello.bus_id, info.bus_id, slots_, slot_bytes_);
    peer->sock = std::move(s);
    peers_.push_back(std::move(peer));
    return ok_status();
  }

  Status validate(const Peer& p, const net::Msg& m) const {
    const uint32_t expect = static_cast<uint32_t>((p.record + p.ready.size()) % slots_);
    if (m.slot != expect || m.length > slot_bytes_ || m.offset > m.total || m.length > m.total - m.offset ||
        (m.length == 0 && m.total != 0)) {
      return Status::data_loss(fmt::format("cuda_ipc: malformed ready (slot {} expected {}, {} bytes at {} of {})",
                                           m.slot, expect, m.length, m.offset, m.total));
    }
    return ok_status();
  }

  // Hands every ready slot whose copy has landed to the callback, in order.
  Status deliver(Peer& p, bool* progress) {
    while (!p.ready.empty()) {
      const net::Msg m = p.ready.front();
      // A sender says kClose only once every copy it announced has landed (its in-flight list is
      // empty), so after a clean close the slots are known filled: no need to query events whose
      // creator may have exited since.
      bool done = p.clean_close;
      if (!done) {
        FERRY_ASSIGN_OR_RETURN(done, event_done(p.filled[m.slot], "cudaEventQuery(filled)"));
      }
      if (!done) return ok_status();
      *progress = true;
      const uint8_t* data = static_cast<const uint8_t*>(p.ring->ring) + m.slot * slot_bytes_;
      const Device where = Device::cuda(device_);
      // A slot may be larger than the connection's limit.
      if (m.offset == 0) FERRY_RETURN_IF_ERROR(check_bucket(p, m.total));
      Status st;
      if (m.offset == 0 && m.length == m.total) {
        st = on_bucket_(ReceivedBucket{data, m.length, p.identity, where, nullptr});
      } else {
        if (m.offset == 0) {
          if (m.total > p.assembly_cap) {
            if (p.assembly != nullptr) FERRY_CUDA_CHECK(cudaFree(p.assembly));
            p.assembly = nullptr;
            p.assembly_cap = 0;
            FERRY_CUDA_CHECK(cudaMalloc(&p.assembly, m.total));
            p.assembly_cap = m.total;
          }
          p.assembled = 0;
        }
        if (m.offset != p.assembled || p.assembly == nullptr) return Status::data_loss("cuda_ipc: fragments out of order");
        auto* dst = static_cast<uint8_t*>(p.assembly) + m.offset;
        FERRY_CUDA_CHECK(cudaMemcpyAsync(dst, data, m.length, cudaMemcpyDeviceToDevice, stream_));
        FERRY_CUDA_CHECK(cudaStreamSynchronize(stream_));  // local copy: it cannot wait on the peer
        p.assembled += m.length;
        if (p.assembled == m.total) {
          st = on_bucket_(ReceivedBucket{static_cast<const uint8_t*>(p.assembly), m.total, p.identity, where, nullptr});
        }
      }
      // On the legacy stream: work the callback left on blocking streams finishes before reuse.
      FERRY_CUDA_CHECK(cudaEventRecord(p.ring->freed[m.slot], cudaStreamLegacy));
      p.ready.pop_front();
      ++p.record;
      FERRY_RETURN_IF_ERROR(st);
      // A sender's handles complete when its copies land, not when we consume them, so it may
      // say goodbye and close its socket while buckets still wait here. After its kClose it reuses
      // no slot: a kFree is pointless, and writing it to the closed socket would fail (EPIPE) and
      // turn a clean close into an error and drop the buckets still waiting.
      if (p.clean_close) continue;
      net::Msg f;
      f.type = kFree;
      f.slot = m.slot;
      Status sent = p.sock.write_all(&f, sizeof f, Clock::now() + kNotify);
      if (!sent.ok()) {
        // The goodbye may have arrived after our last read: a sender writes kClose before it
        // closes, so if it said one, it is queued on our socket now. Only a sender that left
        // without one (it died) makes this failure the connection's end.
        FERRY_RETURN_IF_ERROR(take_control(p, progress));
        if (!p.clean_close) return sent;
      }
    }
    return ok_status();
  }

  // Reads what the control socket holds now and takes in its messages.
  Status take_control(Peer& p, bool* progress) {
    FERRY_RETURN_IF_ERROR(read_control(p));
    net::Msg m;
    while (net::pop_msg(p.inbuf, &m)) {
      *progress = true;
      if (m.type == kReady) {
        FERRY_RETURN_IF_ERROR(validate(p, m));
        p.ready.push_back(m);
      } else if (m.type == kClose) {
        p.clean_close = true;
      } else if (m.type == kAbort) {
        return Status::aborted(fmt::format("cuda_ipc sender pid {} aborted the connection: {}", p.pid, m.text));
      } else {
        return Status::data_loss(fmt::format("cuda_ipc: unknown control message {}", m.type));
      }
    }
    return ok_status();
  }

  // Reads the control socket and delivers; returns the Status that ends the link, if it ends.
  std::optional<Status> serve(net::DevicePeer& peer, bool* progress, bool* gpu_wait) override {
    Peer& p = static_cast<Peer&>(peer);
    Status st = take_control(p, progress);
    if (!st.ok()) return st;
    st = deliver(p, progress);
    if (!st.ok()) return st;
    if (p.clean_close && p.ready.empty()) return ok_status();
    if (p.eof && !p.clean_close) {
      return Status::unavailable(fmt::format(
          "cuda_ipc sender pid {} closed its control socket without a close (it exited or died mid-transfer)", p.pid));
    }
    *gpu_wait |= !p.ready.empty();
    return std::nullopt;
  }

  void thread_started() override {
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) {
      FERRY_LOG_ERROR("cuda_ipc: receiver thread could not set up device {}", device_);
    }
  }

  void on_admitted(net::Socket s, const Admission& granted) override {
    Status st = accept_peer(std::move(s), granted);
    if (!st.ok()) FERRY_LOG_WARN("cuda_ipc: refused a sender: {}", st.to_string());
  }

  int device_;
  uint32_t slots_;
  uint64_t slot_bytes_;
  BucketCallback on_bucket_;
  cudaStream_t stream_ = nullptr;
};

class IpcTransport final : public net::DeviceTransport {
 public:
  IpcTransport(int device, const TransportOptions& options) : DeviceTransport(device, options) {}
  std::string_view name() const override { return "cuda_ipc"; }
  Capabilities capabilities() const override { return {true, false, false, true, device_}; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    if (!device.is_cuda()) return Status::invalid_argument("cuda_ipc moves device memory only; got " + device.to_string());
    if (size > 0) {
      FERRY_ASSIGN_OR_RETURN(int actual, device_of(data));
      if (actual != device.index) {
        return Status::invalid_argument(fmt::format("cuda_ipc: memory said {} lives on cuda:{}", device.to_string(), actual));
      }
    }
    return std::unique_ptr<MemoryRegion>(std::make_unique<DeviceRegion>(data, size, device.index));
  }

 private:
  Result<Started> start_receiver(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) override {
    const uint64_t bucket = options_.bucket_bytes;
    constexpr uint64_t kGrain = 2 << 20, kMaxSlot = 256ull << 20;
    const uint64_t slot_bytes = std::clamp((bucket + kGrain - 1) / kGrain * kGrain, kGrain, kMaxSlot);
    const uint32_t slots = static_cast<uint32_t>(std::clamp<int64_t>(options_.buckets_in_flight, 2, kMaxSlots));
    static std::atomic<uint64_t> counter{0};
    const std::string name = fmt::format("ferry-cuda-ipc-{}-{}-{:x}", getpid(), counter++, net::process_nonce());
    FERRY_ASSIGN_OR_RETURN(net::Listener listener, net::Listener::unix_abstract(name));
    auto receiver = std::make_unique<IpcReceiver>(std::move(listener), device_, slots, slot_bytes,
                                                  options_.max_received_bucket(), std::move(on_bucket),
                                                  std::move(on_closed), std::move(admit));
    return Started{std::move(receiver), std::string(kScheme) + net::boot_id() + "/" + name};
  }

  Result<std::unique_ptr<Connection>> connect_sender(const std::string& blob, Deadline deadline,
                                                     std::string_view credential) override {
    return cuda_ipc::connect(blob, device_, deadline, credential);
  }
};

}  // namespace

Result<std::unique_ptr<Transport>> create_cuda_ipc_transport(const TransportOptions& options) {
  if (!cuda_device_available()) return Status::unavailable("cuda_ipc: no CUDA device here");
  int device = 0;
  FERRY_CUDA_CHECK(cudaGetDevice(&device));
  return std::unique_ptr<Transport>(std::make_unique<IpcTransport>(device, options));
}

}  // namespace ferry::transport
