// nccl, sending end: connect() joins a fresh two-rank communicator under its deadline; then one
// worker thread per connection (net::DeviceConnection) writes each bucket's header and enqueues its
// grouped ncclSend on a dedicated stream, completing handles as their events land (see nccl_wire.h).
#include <unistd.h>

#include <deque>
#include <vector>

#include <fmt/format.h>

#include "transport/admission.h"
#include "transport/common/device.h"
#include "transport/common/device_connection.h"
#include "transport/common/socket.h"
#include "transport/nccl/nccl_wire.h"

namespace ferry::transport::nccl {
namespace {

using gpu::event_done;

constexpr auto kNotify = std::chrono::seconds(5);
constexpr auto kGroup = std::chrono::seconds(10);
constexpr size_t kMaxInflight = 16;

struct Inflight {
  std::shared_ptr<net::Job> job;
  cudaEvent_t done;
};

class NcclConnection final : public net::DeviceConnection {
 public:
  NcclConnection(net::Socket sock, int device, int receiver_pid, ncclComm_t comm, cudaStream_t stream)
      : DeviceConnection("nccl", {kClose, kAbort, kRefuse}, std::move(sock), device, receiver_pid), comm_(comm),
        stream_(stream) {
    start();
  }

  ~NcclConnection() override {
    close_and_join();
    ScopedDevice d(device_);
    if (comm_ != nullptr) ncclCommAbort(comm_);  // never waits on the peer
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

 private:
  Status check() override {
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
      return nccl_status(async, "nccl communicator", __FILE__, __LINE__, comm_);
    }
    return ok_status();
  }

  Result<bool> reap() override {
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

  Result<bool> issue(bool* /*gpu_wait*/) override {
    bool progress = false;
    while (inflight_.size() < kMaxInflight) {
      std::shared_ptr<net::Job> job = front_job();
      if (!job) return progress;
      pop_job(job);
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

  bool in_flight() const override { return !inflight_.empty(); }

  void fail_in_flight(const Status& why) override {
    // Stops kernels still waiting for the receiver, so nothing on this stream hangs.
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    for (auto& f : inflight_) {
      f.job->state->complete(why);
      events_.push_back(f.done);
    }
    inflight_.clear();
  }

  ncclComm_t comm_;
  cudaStream_t stream_;

  // The worker's own.
  std::deque<Inflight> inflight_;
  std::vector<cudaEvent_t> events_;
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
  std::snprintf(hello.bus_id, sizeof hello.bus_id, "%s", gpu::bus_id(device).c_str());
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
