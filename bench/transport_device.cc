#include "bench/transport_device.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/buffer.h"
#include "transport/transport.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#endif
#if defined(FERRY_BENCH_NCCL)
#include <nccl.h>
#endif

namespace ferry::bench {
namespace {

#if defined(FERRY_HAVE_CUDA)
using Clock = std::chrono::steady_clock;
constexpr auto kWait = std::chrono::seconds(600);  // one iteration of a baseline, at most

// Waits for `stream` without ever blocking past `deadline` (polls; yields between polls).
Status wait_stream(cudaStream_t stream, Clock::time_point deadline, const char* what) {
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return ok_status();
    if (e != cudaErrorNotReady) return cuda_status(e, what, __FILE__, __LINE__);
    if (Clock::now() >= deadline) {
      return Status::deadline_exceeded(fmt::format("{}: still running at the deadline", what));
    }
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    else std::this_thread::yield();
  }
}

// Lets `from`'s context reach `to`'s memory where the hardware allows it; already enabled is fine.
void enable_peer(int from, int to) {
  if (from == to) return;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess || !can) return;
  ScopedDevice d(from);
  if (cudaDeviceEnablePeerAccess(to, 0) != cudaSuccess) (void)cudaGetLastError();
}

class Stream {
 public:
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (stream_ != nullptr) {
      ScopedDevice d(device_);
      cudaStreamDestroy(stream_);
    }
  }
  Status create(int device) {
    device_ = device;
    ScopedDevice d(device);
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return ok_status();
  }
  cudaStream_t get() const { return stream_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};
#endif

#if defined(FERRY_BENCH_NCCL)
Status nccl_check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return ok_status();
  return Status::internal(fmt::format("{} failed: {} ({})", what, ncclGetErrorString(r), ncclGetLastError(nullptr)));
}
#define BENCH_NCCL_CHECK(expr) FERRY_RETURN_IF_ERROR(nccl_check((expr), #expr))

// The ranks' communicators: after a clean run finalized together (finalizing is collective, so one
// thread groups every rank's calls) and destroyed; aborted otherwise.
struct Comms {
  std::vector<ncclComm_t> comm;
  bool clean = false;
  ~Comms() {
    if (clean) {
      ncclGroupStart();
      for (ncclComm_t c : comm) ncclCommFinalize(c);
      clean = ncclGroupEnd() == ncclSuccess;
    }
    for (ncclComm_t c : comm) {
      if (c == nullptr) continue;
      if (clean) ncclCommDestroy(c);
      else ncclCommAbort(c);
    }
  }
};
#endif

}  // namespace

Result<Placement> place(const std::string& transport) {
  auto probe = transport::create_transport(transport);
  if (!probe.ok()) {
    if ((transport == "nccl" || transport == "cuda_ipc") && !built_with_cuda()) {
      return Status::unavailable(fmt::format(
          "{} (this ferry was built without CUDA; nccl and cuda_ipc move device memory only)", probe.status().message()));
    }
    return probe.status();
  }
  const transport::Capabilities caps = (*probe)->capabilities();
  Placement at;
  at.device = caps.device_memory && !caps.host_memory;
  if (!at.device) return at;
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  const int n = cuda_device_count();
  if (transport == "nccl" && n < 2) {
    return Status::failed_precondition(fmt::format(
        "nccl needs two GPUs (NCCL refuses two ranks of a communicator on one GPU); this machine shows {}", n));
  }
  at.rx = std::max(n - 1, 0);
  return at;
}

bool built_with_cuda() {
#if defined(FERRY_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

bool built_with_nccl() {
#if defined(FERRY_BENCH_NCCL)
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#if defined(FERRY_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

Status set_device(int device) {
#if defined(FERRY_HAVE_CUDA)
  FERRY_CUDA_CHECK(cudaSetDevice(device));
  return ok_status();
#else
  (void)device;
  return Status::unavailable("this ferry was built without CUDA");
#endif
}

Status fill_device(void* data, size_t bytes, int value, int device) {
#if defined(FERRY_HAVE_CUDA)
  ScopedDevice d(device);
  FERRY_CUDA_CHECK(cudaMemset(data, value, bytes));
  FERRY_CUDA_CHECK(cudaDeviceSynchronize());
  return ok_status();
#else
  (void)data, (void)bytes, (void)value, (void)device;
  return Status::unavailable("this ferry was built without CUDA");
#endif
}

Result<double> device_copy_seconds(size_t bytes, int iters, int src, int dst) {
  return device_copy_fanout_seconds(bytes, iters, src, {dst});
}

Result<double> device_copy_fanout_seconds(size_t bytes, int iters, int src, const std::vector<int>& dsts) {
#if defined(FERRY_HAVE_CUDA)
  if (iters <= 0 || bytes == 0 || dsts.empty()) {
    return Status::invalid_argument("device_copy: bytes, iterations and destinations must be positive");
  }
  FERRY_ASSIGN_OR_RETURN(Buffer a, Buffer::allocate(bytes, Device::cuda(src)));
  FERRY_RETURN_IF_ERROR(fill_device(a.data(), bytes, 1, src));
  std::vector<Buffer> b;
  std::vector<Stream> streams(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    FERRY_ASSIGN_OR_RETURN(Buffer x, Buffer::allocate(bytes, Device::cuda(dsts[i])));
    FERRY_RETURN_IF_ERROR(fill_device(x.data(), bytes, 2, dsts[i]));
    b.push_back(std::move(x));
    enable_peer(src, dsts[i]);
    enable_peer(dsts[i], src);
    FERRY_RETURN_IF_ERROR(streams[i].create(src));
  }
  ScopedDevice d(src);
  auto copy = [&]() -> Status {
    for (size_t i = 0; i < dsts.size(); ++i) {
      FERRY_CUDA_CHECK(cudaMemcpyPeerAsync(b[i].data(), dsts[i], a.data(), src, bytes, streams[i].get()));
    }
    const auto deadline = Clock::now() + kWait;
    for (auto& s : streams) FERRY_RETURN_IF_ERROR(wait_stream(s.get(), deadline, "device_copy"));
    return ok_status();
  };
  FERRY_RETURN_IF_ERROR(copy());  // warm-up
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) FERRY_RETURN_IF_ERROR(copy());
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
#else
  (void)bytes, (void)iters, (void)src, (void)dsts;
  return Status::unavailable("device_copy: this ferry was built without CUDA");
#endif
}

Result<double> nccl_sendrecv_seconds(size_t bytes, int iters, int src, int dst) {
  return nccl_fanout_seconds(bytes, iters, src, {dst});
}

Result<double> nccl_fanout_seconds(size_t bytes, int iters, int src, const std::vector<int>& dsts) {
#if defined(FERRY_BENCH_NCCL)
  if (iters <= 0 || bytes == 0 || dsts.empty()) {
    return Status::invalid_argument("nccl: bytes, iterations and destinations must be positive");
  }
  std::vector<int> devs = {src};
  for (int d : dsts) {
    if (std::find(devs.begin(), devs.end(), d) != devs.end()) {
      return Status::failed_precondition(
          fmt::format("nccl: every end needs a GPU of its own (NCCL refuses two ranks on one GPU); cuda:{} is "
                      "given twice, this machine shows {} GPUs",
                      d, cuda_device_count()));
    }
    devs.push_back(d);
  }
  const size_t n = devs.size();
  std::vector<Buffer> buf;
  std::vector<Stream> streams(n);
  for (size_t i = 0; i < n; ++i) {
    FERRY_ASSIGN_OR_RETURN(Buffer x, Buffer::allocate(bytes, Device::cuda(devs[i])));
    FERRY_RETURN_IF_ERROR(fill_device(x.data(), bytes, i == 0 ? 1 : 2, devs[i]));
    buf.push_back(std::move(x));
    FERRY_RETURN_IF_ERROR(streams[i].create(devs[i]));
  }
  Comms comms;
  comms.comm.assign(n, nullptr);
  {
    ScopedDevice d(src);
    BENCH_NCCL_CHECK(ncclCommInitAll(comms.comm.data(), static_cast<int>(n), devs.data()));
  }
  auto once = [&]() -> Status {
    BENCH_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (size_t i = 1; i < n && first == ncclSuccess; ++i) {
      first = ncclSend(buf[0].data(), bytes, ncclUint8, static_cast<int>(i), comms.comm[0], streams[0].get());
      if (first == ncclSuccess) first = ncclRecv(buf[i].data(), bytes, ncclUint8, 0, comms.comm[i], streams[i].get());
    }
    const ncclResult_t e = ncclGroupEnd();
    BENCH_NCCL_CHECK(first);
    BENCH_NCCL_CHECK(e);
    const auto deadline = Clock::now() + kWait;
    for (auto& s : streams) FERRY_RETURN_IF_ERROR(wait_stream(s.get(), deadline, "nccl send/recv"));
    return ok_status();
  };
  FERRY_RETURN_IF_ERROR(once());  // warm-up: connection set-up
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) FERRY_RETURN_IF_ERROR(once());
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  comms.clean = true;
  return seconds;
#else
  (void)bytes, (void)iters, (void)src, (void)dsts;
  return Status::unavailable(built_with_cuda() ? "nccl: this ferry was built without NCCL"
                                               : "nccl: this ferry was built without CUDA");
#endif
}

}  // namespace ferry::bench
