// The cuda_ipc transport's shared pieces: handshake records, control message types, and the ring's
// device resources both ends use.
//
// Design. The receiver owns one device ring per sending connection: `slots` slots of `slot_bytes`,
// allocated with cudaMalloc on the receiver's device and exported ONCE (cudaIpcGetMemHandle) when
// the connection is accepted. Record n goes to slot n % slots. Each slot has two interprocess
// events (cudaEventInterprocess | cudaEventDisableTiming): `filled`, created and recorded by the
// sender after its copy into the slot, and `freed`, created and recorded by the receiver on its
// device's legacy default stream after the callback returned (so any work the callback left on a
// blocking stream is ordered before the slot is reused). A Unix control socket carries kReady
// (slot, bucket size, fragment) and kFree (slot); the side that learns of a record never waits on
// the GPU for the other process's event: it polls it, between polls of the control socket, so a
// dead peer (end of stream) turns into a Status and nothing waits forever.
//
// Both ends in one process (the process nonces match) cannot open their own IPC handles: they find
// each other's ring and events through a process-local table by `local_id` instead, holding a
// reference so neither side frees what the other still polls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "transport/common/device.h"
#include "transport/transport.h"

namespace ferry::transport::cuda_ipc {

constexpr uint64_t kMagic = 0x31432d797272'6566ull;  // "ferry-C1"
constexpr uint32_t kMaxSlots = 16;
constexpr const char* kScheme = "cuda_ipc://";

enum MsgType : uint32_t { kReady = 1, kFree = 2, kClose = 3, kAbort = 4, kRefuse = 5 };

struct Hello {
  uint64_t magic;
  uint64_t process_nonce;
  int32_t pid;
  int32_t device;
  char bus_id[32];
};

struct RingInfo {
  uint64_t magic;
  int32_t accepted;  // 0: refused, see reason
  uint32_t slots;
  uint64_t slot_bytes;
  uint64_t process_nonce;
  int32_t device;
  int32_t pid;
  cudaIpcMemHandle_t ring;
  cudaIpcEventHandle_t freed[kMaxSlots];
  uint64_t local_id;
  char bus_id[32];
  char reason[128];
};

struct SenderEvents {
  uint64_t magic;
  int32_t ok;  // 0: the sender could not map the ring, see reason
  int32_t reserved;
  cudaIpcEventHandle_t filled[kMaxSlots];
  uint64_t local_id;
  char reason[128];
};

// Device resources one end created; freed when the last holder (possibly the other end, in the
// same process) lets go.
struct RingResources {
  int device = 0;
  void* ring = nullptr;
  uint32_t slots = 0;
  cudaEvent_t freed[kMaxSlots] = {};
  ~RingResources();
};
struct FilledEvents {
  int device = 0;
  uint32_t slots = 0;
  cudaEvent_t filled[kMaxSlots] = {};
  ~FilledEvents();
};
// The process-local table: publish returns an id that find turns back into a reference while the
// publisher still holds one.
uint64_t publish_local(const std::shared_ptr<void>& p);
std::shared_ptr<void> find_local(uint64_t id);

// Creates `n` interprocess events on the current device.
Status create_ipc_events(cudaEvent_t* events, uint32_t n);

using gpu::bus_id;
using gpu::device_of;
using gpu::DeviceRegion;
using gpu::event_done;

}  // namespace ferry::transport::cuda_ipc
