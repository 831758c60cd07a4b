// nccl, receiving end and the transport: one thread (net::DeviceReceiver) accepts senders and hands
// each to a set-up thread (handshake, communicator, warm-up, under a deadline); the serving thread
// posts receives for every connected sender as headers arrive and runs the callbacks, never two at
// once.
#include "transport/nccl/nccl_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/log.h"
#include "transport/common/device.h"
#include "transport/common/device_receiver.h"
#include "transport/common/device_transport.h"
#include "transport/common/socket.h"
#include "transport/listen_host.h"
#include "transport/nccl/nccl_wire.h"

namespace ferry::transport {
namespace nccl {
Result<std::unique_ptr<Connection>> connect(const std::string& blob, int device, Deadline deadline,
                                            std::string_view credential);
}  // namespace nccl

namespace {

using namespace nccl;
using gpu::event_done;

constexpr auto kSetup = std::chrono::seconds(30);
constexpr auto kGroup = std::chrono::seconds(10);
constexpr int kDepth = 2;  // receives posted ahead per sender

struct RecvSlot {
  void* buf = nullptr;
  uint64_t cap = 0;
  uint64_t size = 0;
  cudaEvent_t done = nullptr;
};

struct Peer final : net::DevicePeer {
  int device = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  RecvSlot slots[kDepth];
  std::deque<uint64_t> announced;  // sizes whose receive is not posted yet
  uint64_t posted = 0, delivered = 0;
  Clock::time_point closed_at{};  // when the clean close arrived

  // Abort, never finalize: it cannot wait on a peer that is gone, and stops kernels waiting for one.
  ~Peer() override {
    ScopedDevice d(device);
    if (comm != nullptr) ncclCommAbort(comm);
    for (auto& s : slots) {
      if (s.buf != nullptr) cudaFreeAsync(s.buf, stream);
      if (s.done != nullptr) cudaEventDestroy(s.done);
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

class NcclReceiver final : public net::DeviceReceiver {
 public:
  NcclReceiver(net::Listener listener, int device, uint64_t default_max_bucket, uint64_t slot_bytes,
               BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit)
      : DeviceReceiver("nccl", {kClose, kAbort, kRefuse}, std::move(listener), std::move(on_closed), std::move(admit),
                       default_max_bucket),
        device_(device), slot_bytes_(std::max<uint64_t>(slot_bytes, kWarmupBytes)),
        on_bucket_(std::move(on_bucket)) {
    start();
  }
  ~NcclReceiver() override { stop(); }

  void stop() override {
    if (!halt()) return;
    // Set-ups end at their own deadlines; what they finish joins the peers told to close below.
    std::vector<Setup> setups;
    {
      std::lock_guard<std::mutex> lock(setup_mu_);
      setups.swap(setups_);
    }
    for (auto& s : setups) s.thread.join();
    {
      std::lock_guard<std::mutex> lock(setup_mu_);
      for (auto& p : joined_) peers_.push_back(std::move(p));
      joined_.clear();
    }
    say_goodbye();
    peers_.clear();
  }

 private:
  // A new sender's handshake, communicator and warm-up run on a thread of their own, never on the
  // thread that serves the connected senders: those have sends in flight (NCCL kernels spinning on
  // the GPU until we post the matching receives), and NCCL's set-up makes CUDA calls that can wait
  // for every kernel on the device. Setting up a second sender on the serving thread therefore
  // deadlocked two senders into one receiver: the new sender's init waited on the first sender's
  // kernels, which waited on receives this thread no longer posted, until the connect deadline.
  struct Setup {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  // Admitted senders only: a set-up thread, a communicator and buffers are spent on no one else.
  void start_setup(net::Socket s, const Admission& granted) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread t([this, done, granted, sock = std::move(s)]() mutable {
      Result<std::unique_ptr<Peer>> p =
          cudaSetDevice(device_) == cudaSuccess
              ? accept_peer(std::move(sock), granted)
              : Result<std::unique_ptr<Peer>>(Status::internal("nccl: receiver set-up thread cannot use its device"));
      if (!p.ok()) FERRY_LOG_WARN("nccl: refused a sender: {}", p.status().to_string());
      {
        std::lock_guard<std::mutex> lock(setup_mu_);
        if (p.ok()) joined_.push_back(std::move(*p));
      }
      done->store(true, std::memory_order_release);
      wake();
    });
    std::lock_guard<std::mutex> lock(setup_mu_);
    setups_.push_back({std::move(t), std::move(done)});
  }

  void on_admitted(net::Socket s, const Admission& granted) override { start_setup(std::move(s), granted); }

  // Takes in senders whose set-up finished and joins their threads.
  void adopt(bool* progress) override {
    std::vector<Setup> finished;
    {
      std::lock_guard<std::mutex> lock(setup_mu_);
      for (auto& p : joined_) peers_.push_back(std::move(p));
      if (!joined_.empty()) *progress = true;
      joined_.clear();
      for (size_t i = 0; i < setups_.size();) {
        if (setups_[i].done->load(std::memory_order_acquire)) {
          finished.push_back(std::move(setups_[i]));
          setups_.erase(setups_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    }
    for (auto& s : finished) s.thread.join();
  }

  Result<std::unique_ptr<Peer>> accept_peer(net::Socket s, const Admission& granted) {
    const Deadline deadline = Clock::now() + kSetup;
    Hello hello{};
    FERRY_RETURN_IF_ERROR(s.read_all(&hello, sizeof hello, deadline));
    if (hello.magic != kMagic) return Status::invalid_argument("a connection without the nccl hello");
    hello.bus_id[sizeof hello.bus_id - 1] = '\0';
    auto p = std::make_unique<Peer>();
    p->device = device_;
    p->pid = hello.pid;
    p->identity = granted.peer;
    p->max_bucket = granted.max_bucket_bytes;
    Welcome w{};
    w.magic = kMagic;
    w.pid = getpid();
    std::snprintf(w.bus_id, sizeof w.bus_id, "%s", gpu::bus_id(device_).c_str());
    Status st = nccl_status(ncclGetUniqueId(&w.id), "ncclGetUniqueId", __FILE__, __LINE__);
    w.accepted = st.ok() ? 1 : 0;
    if (!st.ok()) std::snprintf(w.reason, sizeof w.reason, "%s", st.message().c_str());
    FERRY_RETURN_IF_ERROR(s.write_all(&w, sizeof w, deadline));
    FERRY_RETURN_IF_ERROR(st);
    FERRY_RETURN_IF_ERROR(init_comm(&p->comm, w.id, 1, deadline, s.fd())
                              .with_context(fmt::format("communicator with sender pid {} on {}", hello.pid, hello.bus_id)));
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
    for (auto& slot : p->slots) FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    // Slots for buckets of the configured size are allocated now, not while buckets stream: growing
    // a memory pool can wait for the kernels on the device, as connecting a channel can.
    for (auto& slot : p->slots) {
      FERRY_CUDA_CHECK(cudaMallocAsync(&slot.buf, slot_bytes_, p->stream));
      slot.cap = slot_bytes_;
    }
    // The warm-up (nccl_wire.h): the sender's connect() waits for it, so every p2p channel exists
    // before the first bucket.
    FERRY_RETURN_IF_ERROR(warm_up(false, p->slots[0].buf, 0, p->comm, p->stream, p->slots[0].done, deadline, s.fd()));
    FERRY_LOG_DEBUG("nccl: sender pid {} on {} connected to {}", hello.pid, hello.bus_id, w.bus_id);
    p->sock = std::move(s);
    return p;
  }

  // Posts announced receives into free slots, then delivers completed ones in order.
  Status pump(Peer& p, bool* progress, bool* gpu_wait) {
    while (!p.announced.empty() && p.posted - p.delivered < kDepth) {
      RecvSlot& s = p.slots[p.posted % kDepth];
      s.size = p.announced.front();
      if (s.size > s.cap) {
        if (s.buf != nullptr) FERRY_CUDA_CHECK(cudaFreeAsync(s.buf, p.stream));
        s.buf = nullptr;
        s.cap = 0;
        FERRY_CUDA_CHECK(cudaMallocAsync(&s.buf, s.size, p.stream));
        s.cap = s.size;
      }
      // After a clean close the socket is gone but the announced buckets are not: NCCL completes a
      // send once its bytes are in the receiver's buffers, so a sender may close before the receiver
      // has posted their receives. Only the deadline then bounds them (serve()).
      FERRY_RETURN_IF_ERROR(p2p(false, s.buf, s.size, 0, p.comm, p.stream, s.done, Clock::now() + kGroup,
                                p.clean_close ? -1 : p.sock.fd()));
      p.announced.pop_front();
      ++p.posted;
      *progress = true;
    }
    while (p.delivered < p.posted) {
      RecvSlot& s = p.slots[p.delivered % kDepth];
      FERRY_ASSIGN_OR_RETURN(bool done, event_done(s.done, "cudaEventQuery(recv)"));
      if (!done) {
        *gpu_wait = true;
        return ok_status();
      }
      ++p.delivered;
      *progress = true;
      const ReceivedBucket bucket{static_cast<const uint8_t*>(s.buf), s.size, p.identity, Device::cuda(device_), nullptr};
      FERRY_RETURN_IF_ERROR(on_bucket_(bucket));
    }
    return ok_status();
  }

  std::optional<Status> serve(net::DevicePeer& peer, bool* progress, bool* gpu_wait) override {
    Peer& p = static_cast<Peer&>(peer);
    if (Status st = read_control(p); !st.ok()) return st;
    net::Msg m;
    while (net::pop_msg(p.inbuf, &m)) {
      *progress = true;
      if (m.type == kData) {
        if (Status st = check_bucket(p, m.total); !st.ok()) return st;
        p.announced.push_back(m.total);
      } else if (m.type == kClose) {
        p.clean_close = true;
        p.closed_at = Clock::now();
      } else if (m.type == kAbort) {
        return Status::aborted(fmt::format("nccl sender pid {} aborted the connection: {}", p.pid, m.text));
      } else {
        return Status::data_loss(fmt::format("nccl: unknown control message {}", m.type));
      }
    }
    if (p.eof && !p.clean_close) {
      return Status::unavailable(
          fmt::format("nccl sender pid {} closed its control socket without a close (it exited or died)", p.pid));
    }
    Status st = pump(p, progress, gpu_wait);
    if (!st.ok()) return st;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(p.comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      return nccl_status(async, "nccl communicator", __FILE__, __LINE__, p.comm);
    }
    if (p.clean_close && p.announced.empty() && p.delivered == p.posted) return ok_status();
    if (p.clean_close && Clock::now() - p.closed_at > kGroup) {
      return Status::deadline_exceeded(fmt::format("nccl sender pid {} closed; {} announced buckets not received {} s later",
                                                   p.pid, p.announced.size() + (p.posted - p.delivered),
                                                   std::chrono::duration_cast<std::chrono::seconds>(kGroup).count()));
    }
    return std::nullopt;
  }

  void thread_started() override {
    if (cudaSetDevice(device_) != cudaSuccess) FERRY_LOG_ERROR("nccl: receiver thread cannot use device {}", device_);
  }

  int device_;
  uint64_t slot_bytes_;  // each receive slot, allocated at set-up
  BucketCallback on_bucket_;
  std::mutex setup_mu_;
  std::vector<Setup> setups_;                   // set-up threads, joined once done
  std::vector<std::unique_ptr<Peer>> joined_;   // set up, not yet taken in by the serving thread
};

class NcclTransport final : public net::DeviceTransport {
 public:
  NcclTransport(int device, const TransportOptions& options) : DeviceTransport(device, options) {}
  std::string_view name() const override { return "nccl"; }
  Capabilities capabilities() const override { return {true, true, false, true, device_}; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    if (!device.is_cuda() || device.index != device_) {
      return Status::invalid_argument(fmt::format("nccl on cuda:{} moves memory of that device only; got {}", device_,
                                                  device.to_string()));
    }
    if (size > 0) {
      FERRY_ASSIGN_OR_RETURN(int actual, gpu::device_of(data));
      if (actual != device_) return Status::invalid_argument(fmt::format("nccl: memory lives on cuda:{}", actual));
    }
    return std::unique_ptr<MemoryRegion>(std::make_unique<gpu::DeviceRegion>(data, size, device_));
  }

 private:
  Result<Started> start_receiver(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) override {
    const uint64_t bucket = options_.bucket_bytes;
    const std::string& host = options_.listen_host;
    FERRY_ASSIGN_OR_RETURN(net::Listener listener, net::Listener::tcp(host));
    std::string advertised = host;
    if (host == "0.0.0.0" || host == "::") {
      char name[256] = {};
      gethostname(name, sizeof name - 1);
      advertised = name;
    }
    if (advertised.find(':') != std::string::npos) advertised = "[" + advertised + "]";
    const int port = listener.port();
    auto receiver = std::make_unique<NcclReceiver>(std::move(listener), device_, options_.max_received_bucket(),
                                                   bucket + (2ull << 20), std::move(on_bucket), std::move(on_closed),
                                                   std::move(admit));
    return Started{std::move(receiver), fmt::format("{}{}:{}", kScheme, advertised, port)};
  }

  Result<std::unique_ptr<Connection>> connect_sender(const std::string& blob, Deadline deadline,
                                                     std::string_view credential) override {
    return nccl::connect(blob, device_, deadline, credential);
  }
};

}  // namespace

Result<std::unique_ptr<Transport>> create_nccl_transport(const TransportOptions& options) {
  if (!cuda_device_available()) return Status::unavailable("nccl: no CUDA device here");
  // NCCL's bootstrap listens on the interface NCCL_SOCKET_IFNAME names, by default the first that
  // is not loopback: unless the user chose one, it is the interface holding the listen host
  // ("=" asks NCCL for that exact name). NCCL reads it once, at its first communicator.
  if (std::getenv("NCCL_SOCKET_IFNAME") == nullptr) {
    FERRY_ASSIGN_OR_RETURN(std::string iface, interface_of(options.listen_host));
    if (!iface.empty()) setenv("NCCL_SOCKET_IFNAME", ("=" + iface).c_str(), /*overwrite=*/0);
  }
  int device = 0;
  FERRY_CUDA_CHECK(cudaGetDevice(&device));
  return std::unique_ptr<Transport>(std::make_unique<NcclTransport>(device, options));
}

}  // namespace ferry::transport
