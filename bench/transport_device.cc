#include "bench/transport_device.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

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

// The two ranks' communicators: after a clean run finalized together (finalizing is collective,
// so one thread groups both ranks' calls) and destroyed; aborted otherwise.
struct Comms {
  ncclComm_t comm[2] = {nullptr, nullptr};
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
#if defined(FERRY_HAVE_CUDA)
  if (iters <= 0 || bytes == 0) return Status::invalid_argument("device_copy: bytes and iterations must be positive");
  FERRY_ASSIGN_OR_RETURN(Buffer a, Buffer::allocate(bytes, Device::cuda(src)));
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(bytes, Device::cuda(dst)));
  FERRY_RETURN_IF_ERROR(fill_device(a.data(), bytes, 1, src));
  FERRY_RETURN_IF_ERROR(fill_device(b.data(), bytes, 2, dst));
  enable_peer(src, dst);
  enable_peer(dst, src);
  Stream stream;
  FERRY_RETURN_IF_ERROR(stream.create(src));
  ScopedDevice d(src);
  auto copy = [&]() -> Status {
    FERRY_CUDA_CHECK(cudaMemcpyPeerAsync(b.data(), dst, a.data(), src, bytes, stream.get()));
    return wait_stream(stream.get(), Clock::now() + kWait, "device_copy");
  };
  FERRY_RETURN_IF_ERROR(copy());  // warm-up
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) FERRY_RETURN_IF_ERROR(copy());
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
#else
  (void)bytes, (void)iters, (void)src, (void)dst;
  return Status::unavailable("device_copy: this ferry was built without CUDA");
#endif
}

Result<double> nccl_sendrecv_seconds(size_t bytes, int iters, int src, int dst) {
#if defined(FERRY_BENCH_NCCL)
  if (iters <= 0 || bytes == 0) return Status::invalid_argument("nccl: bytes and iterations must be positive");
  if (src == dst) {
    return Status::failed_precondition(
        fmt::format("nccl: needs two GPUs (NCCL refuses two ranks on one GPU), this machine shows {}",
                    cuda_device_count()));
  }
  FERRY_ASSIGN_OR_RETURN(Buffer a, Buffer::allocate(bytes, Device::cuda(src)));
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(bytes, Device::cuda(dst)));
  FERRY_RETURN_IF_ERROR(fill_device(a.data(), bytes, 1, src));
  FERRY_RETURN_IF_ERROR(fill_device(b.data(), bytes, 2, dst));
  Stream streams[2];
  FERRY_RETURN_IF_ERROR(streams[0].create(src));
  FERRY_RETURN_IF_ERROR(streams[1].create(dst));
  Comms comms;
  const int devs[2] = {src, dst};
  {
    ScopedDevice d(src);
    BENCH_NCCL_CHECK(ncclCommInitAll(comms.comm, 2, devs));
  }
  auto once = [&]() -> Status {
    BENCH_NCCL_CHECK(ncclGroupStart());
    const ncclResult_t s = ncclSend(a.data(), bytes, ncclUint8, 1, comms.comm[0], streams[0].get());
    const ncclResult_t r = ncclRecv(b.data(), bytes, ncclUint8, 0, comms.comm[1], streams[1].get());
    const ncclResult_t e = ncclGroupEnd();
    BENCH_NCCL_CHECK(s);
    BENCH_NCCL_CHECK(r);
    BENCH_NCCL_CHECK(e);
    const auto deadline = Clock::now() + kWait;
    FERRY_RETURN_IF_ERROR(wait_stream(streams[0].get(), deadline, "nccl send"));
    return wait_stream(streams[1].get(), deadline, "nccl recv");
  };
  FERRY_RETURN_IF_ERROR(once());  // warm-up: connection set-up
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) FERRY_RETURN_IF_ERROR(once());
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
  comms.clean = true;
  return seconds;
#else
  (void)bytes, (void)iters, (void)src, (void)dst;
  return Status::unavailable(built_with_cuda() ? "nccl: this ferry was built without NCCL"
                                               : "nccl: this ferry was built without CUDA");
#endif
}

}  // namespace ferry::bench
