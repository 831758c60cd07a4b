// The CUDA side of `ferry bench transport` for the device transports (cuda_ipc, nccl): device
// selection and filling, and the baselines measured beside them in the same run. Every function
// compiles without CUDA and then returns Unavailable (or 0 devices) saying why.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/status.h"

namespace ferry::bench {

// Where the two ends of `ferry bench transport` run. Device transports (their receivers get device
// memory: cuda_ipc, nccl) take the CUDA device current at their creation: the receiver runs on `rx`,
// the sender and its source buckets on `tx`.
struct Placement {
  bool device = false;
  int rx = 0;
  int tx = 0;
};
// Host transports: device false. Device transports: sender on cuda:0, receiver on the last visible
// GPU (cuda:0 too when there is one; nccl then fails, NCCL refusing two ranks on one GPU); NCCL's
// NVLink multicast is turned off (NCCL_NVLS_ENABLE=0) unless the user set it. Fails, saying why,
// when the transport cannot be created here (not built, built without CUDA, no device).
Result<Placement> place(const std::string& transport);

// True when this ferry was built with CUDA; with NCCL, for nccl_sendrecv_seconds.
bool built_with_cuda();
bool built_with_nccl();
// CUDA devices visible to this process; 0 without CUDA or without a device.
int cuda_device_count();
// Makes `device` the calling thread's current device (device transports take it at creation).
Status set_device(int device);
// Sets every byte of `bytes` of device memory at `data` on `device` to `value` and waits until done.
Status fill_device(void* data, size_t bytes, int value, int device);

// Seconds per copy of `bytes` from a buffer on `src` to one on `dst`: cudaMemcpyPeerAsync with peer
// access enabled where the devices allow it (a device-to-device copy when src == dst), each copy
// waited for before the next; one warm-up copy first.
Result<double> device_copy_seconds(size_t bytes, int iters, int src, int dst);

// Seconds per plain NCCL send/receive of `bytes` from `src` to `dst` (src != dst): one
// ncclCommInitAll communicator over {src, dst} in this process, one stream per device; per
// iteration ncclGroupStart, ncclSend on src's rank, ncclRecv on dst's rank, ncclGroupEnd, then both
// streams waited for. One warm-up iteration first.
Result<double> nccl_sendrecv_seconds(size_t bytes, int iters, int src, int dst);

// The same from `src` to every GPU of `dsts` at once (a trainer feeding the ranks of a replica on
// GPUs of their own): one communicator over {src, dsts...}; per iteration one group of a send of
// `bytes` to each and their receives. Seconds per iteration (each destination got `bytes`).
Result<double> nccl_fanout_seconds(size_t bytes, int iters, int src, const std::vector<int>& dsts);
// The same with peer copies, one stream per destination (cuda_ipc's link).
Result<double> device_copy_fanout_seconds(size_t bytes, int iters, int src, const std::vector<int>& dsts);

}  // namespace ferry::bench
