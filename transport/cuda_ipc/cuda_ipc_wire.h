// The cuda_ipc transport's shared pieces: handshake records, control message types, and device
// helpers both ends use.
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
#include <string>

#include "core/cuda_check.h"
#include "core/status.h"
#include "transport/transport.h"

#include <memory>

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

using ::ferry::ScopedDevice;  // core/cuda_check.h

// cudaSuccess: done; cudaErrorNotReady: not yet; anything else is an error Status.
inline Result<bool> event_done(cudaEvent_t e, const char* what) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) return false;
  return cuda_status(r, what, __FILE__, __LINE__);
}

inline std::string bus_id(int device) {
  char buf[32] = {};
  if (cudaDeviceGetPCIBusId(buf, sizeof buf, device) != cudaSuccess) return "?";
  return buf;
}

// The CUDA device `ptr` lives on; InvalidArgument for host or unknown memory.
inline Result<int> device_of(const void* ptr) {
  cudaPointerAttributes a{};
  FERRY_RETURN_IF_ERROR(cuda_status(cudaPointerGetAttributes(&a, ptr), "cudaPointerGetAttributes", __FILE__, __LINE__));
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged) {
    return Status::invalid_argument("memory is not CUDA device memory");
  }
  return a.device;
}

// Device memory registered with a device transport.
class DeviceRegion final : public MemoryRegion {
 public:
  DeviceRegion(void* data, size_t size, int device) : data_(data), size_(size), device_(device) {}
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }

 private:
  void* data_;
  size_t size_;
  int device_;
};

}  // namespace ferry::transport::cuda_ipc
