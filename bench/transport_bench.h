// `ferry bench transport`: bandwidth of one transport, beside baselines measured in the same run.
#pragma once

#include <cstddef>
#include <string>

namespace ferry {

// Moves `iters` buckets of `bytes` each from a sender to a receiver transport instance named
// `transport` (two in-process instances; for shm the bytes still cross the shared-memory ring)
// with two buckets in flight, and prints one line per baseline. With `json`, each line is
//   {"bench":"transport","case":"<transport>","device":"<cpu|cuda>","bytes":N,"seconds":S,"gbps":G,
//    "baseline":"<memcpy|ucx_perftest|ucx_perftest_no_err_handling|mpi|device_copy|nccl>",
//    "baseline_gbps":B,"ratio":R}
// bytes: bytes moved per bucket; seconds: wall time per bucket, from the first post until the last
// bucket has reached the receiver's callback; gbps: bytes moved per second / 1e9.
// Host transports (device "cpu"), baselines: host memcpy of the same bytes (counting bytes moved,
// not read plus written); ucx_perftest tag_bw at the same message size between two processes on
// loopback (over tcp for tcp, over the user's UCX_TLS or UCX's default for ucx; needs the
// ucx_perftest binary). For ucx it runs with peer error handling (-e), as ferry's endpoints have
// it, so that UCX picks the same transports for both; the run without it (UCX 1.13 then adds
// shared memory and cma, which error handling rules out) is printed beside it as
// ucx_perftest_no_err_handling. An OpenMPI two-process send/receive of the same bytes (needs mpirun
// and ferry's mpi_sendrecv program).
// Device transports (cuda_ipc, nccl; device "cuda"): the sender's buckets are device memory on
// cuda:0, the receiver runs on the last visible GPU (cuda:1 on two GPUs; nccl needs two). Baselines:
// device_copy, cudaMemcpyPeer of the same bytes between the same two devices (device to device on
// one GPU); nccl, a plain NCCL send/receive of the same bytes between the same two devices (see
// bench/transport_device.h). Without CUDA (or a device) these fail, saying why.
// A baseline that cannot run here is left out (device baselines say why on stderr). Returns 0, or 1
// after printing the error.
int run_transport_bench(const std::string& transport, size_t bytes, int iters, bool json);

}  // namespace ferry
