// The nccl transport's shared pieces.
//
// Design. The listener blob is "nccl://<host>:<port>", a TCP control socket. Each connection gets
// its own two-rank communicator: the sender says hello, the receiver answers with a FRESH
// ncclUniqueId (one id serves one ncclCommInitRank, and one listener serves many senders and
// reconnects), and both ends run ncclCommInitRankConfig with blocking=0, polling
// ncclCommGetAsyncError against a deadline and the control socket; then a 1-byte warm-up
// send/recv sets up the p2p channel while connect() still has its deadline. Per bucket the sender
// writes a kData header (size) on the socket, then ncclSend in a group on its own stream; the
// receiver posts ncclRecv (up to two ahead, into grow-only stream-ordered buffers) and hands the
// buffer to the callback once the recv's event completes. NCCL cannot see a dead peer, so the
// control socket does: end of stream, a refusal, a deadline or an error ends in ncclCommAbort,
// which also stops kernels still waiting for the peer. Nothing ever waits on the GPU from the host
// except by polling. Users' NCCL_* variables are left as they are.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <poll.h>

#include <functional>
#include <thread>

#include "core/cuda_check.h"
#include "core/status.h"
#include "transport/nccl/nccl_check.h"
#include "transport/transport.h"

namespace ferry::transport::nccl {

constexpr uint64_t kMagic = 0x314e2d797272'6566ull;  // "ferry-N1"
constexpr const char* kScheme = "nccl://";

enum MsgType : uint32_t { kData = 1, kClose = 2, kAbort = 3, kRefuse = 4 };

struct Hello {
  uint64_t magic;
  int32_t pid;
  int32_t device;
  char bus_id[32];
};

struct Welcome {
  uint64_t magic;
  int32_t accepted;
  int32_t pid;
  ncclUniqueId id;
  char bus_id[32];
  char reason[128];
};

// True when the peer closed its end of `fd` (a dead process closes it too); peeks, consumes nothing.
inline bool hung_up(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Polls a non-blocking communicator until it leaves ncclInProgress. DeadlineExceeded at the
// deadline, Unavailable when `peer_fd` hangs up first.
inline Status wait_comm(ncclComm_t comm, Deadline deadline, int peer_fd, const char* what) {
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return nccl_status(r, "ncclCommGetAsyncError", __FILE__, __LINE__, comm);
    if (state != ncclInProgress) return nccl_status(state, what, __FILE__, __LINE__, comm);
    if (Clock::now() >= deadline) return Status::deadline_exceeded(std::string(what) + ": still in progress at the deadline");
    if (peer_fd >= 0 && hung_up(peer_fd)) return Status::unavailable(std::string(what) + ": the peer closed its control socket (exited or died)");
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));  // bounded poll of an NCCL state word
    else std::this_thread::yield();
  }
}

// Creates this rank's end of a two-rank communicator without ever blocking past `deadline`.
inline Status init_comm(ncclComm_t* comm, const ncclUniqueId& id, int rank, Deadline deadline, int peer_fd) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = rank == 0 ? "ferry-sender" : "ferry-receiver";
  *comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(comm, 2, id, rank, &config);
  Status st = (r == ncclSuccess || r == ncclInProgress)
                  ? wait_comm(*comm, deadline, peer_fd, "ncclCommInitRankConfig")
                  : nccl_status(r, "ncclCommInitRankConfig", __FILE__, __LINE__, *comm);
  if (!st.ok() && *comm != nullptr) {
    ncclCommAbort(*comm);
    *comm = nullptr;
  }
  return st;
}

// One grouped send or recv of `bytes` on `stream`, then `done` recorded behind it.
inline Status p2p(bool send, void* buf, size_t bytes, int peer, ncclComm_t comm, cudaStream_t stream, cudaEvent_t done,
                  Deadline deadline, int peer_fd) {
  if (bytes > 0) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      r = send ? ncclSend(buf, bytes, ncclUint8, peer, comm, stream) : ncclRecv(buf, bytes, ncclUint8, peer, comm, stream);
      const ncclResult_t end = ncclGroupEnd();
      if (r == ncclSuccess || r == ncclInProgress) r = end;
    }
    if (r == ncclInProgress) {
      FERRY_RETURN_IF_ERROR(wait_comm(comm, deadline, peer_fd, send ? "ncclSend" : "ncclRecv"));
    } else if (r != ncclSuccess) {
      return nccl_status(r, send ? "ncclSend group" : "ncclRecv group", __FILE__, __LINE__, comm);
    }
  }
  FERRY_CUDA_CHECK(cudaEventRecord(done, stream));
  return ok_status();
}

// The warm-up both ends run right after the communicator exists, under connect()'s deadline: one
// large transfer, then kWarmupSmallOps 1-byte ones. NCCL connects a p2p channel lazily, on the
// first operation that uses it; a large operation spreads over every channel for the peer and
// successive ones start on different channels. Connecting a channel makes CUDA calls that wait for
// the kernels running on the device. Done while buckets stream, on a GPU that another sender's
// NCCL kernels keep busy until their receives are posted, that deadlocked two senders into one
// receiver; after the warm-up no bucket connects anything.
constexpr size_t kWarmupBytes = size_t{64} << 20;
constexpr int kWarmupSmallOps = 64;

// Runs the warm-up's operations on `stream` from `buf` (kWarmupBytes of device memory), then waits
// for them by polling `done`, until `deadline` or the peer hangs up.
inline Status warm_up(bool send, void* buf, int peer, ncclComm_t comm, cudaStream_t stream, cudaEvent_t done,
                      Deadline deadline, int peer_fd) {
  FERRY_RETURN_IF_ERROR(p2p(send, buf, kWarmupBytes, peer, comm, stream, done, deadline, peer_fd));
  for (int i = 0; i < kWarmupSmallOps; ++i) {
    FERRY_RETURN_IF_ERROR(p2p(send, buf, 1, peer, comm, stream, done, deadline, peer_fd));
  }
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return ok_status();
    if (q != cudaErrorNotReady) return cuda_status(q, "cudaEventQuery(warm-up)", __FILE__, __LINE__);
    if (Clock::now() >= deadline) return Status::deadline_exceeded("nccl warm-up did not complete before the deadline");
    if (hung_up(peer_fd)) return Status::unavailable("the nccl peer closed its socket during set-up");
    std::this_thread::yield();
  }
}

}  // namespace ferry::transport::nccl
