// Direct reads of a colocated trainer's device tensors: the trainer exports each device allocation
// its tensors live in ONCE by CUDA IPC (keyed by the allocation's CUDA buffer id, which CUDA never
// reuses within a process), and a rank on the same node maps each one once and reads pieces
// straight out of it. No tensor is packed or copied on the way: the rank's kernels read the
// trainer's memory and write the rank's storage.
//
// Contract (see coordinator/trainer.h): the trainer leaves its weights unmodified from
// start_weight_update until finish_weight_update returns; the trainer synchronizes its device
// before the first direct piece of an update, and finish returns only after every rank's reads
// completed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry::transport {

// One exported allocation, as announced to ranks.
struct SharedAllocation {
  uint64_t id = 0;
  std::string handle;  // cudaIpcMemHandle_t bytes
  uint64_t size = 0;
  uint64_t process_nonce = 0;
  uint64_t base = 0;  // address in the exporting process
  int device = 0;
  int pid = 0;
};

// Where bytes of a tensor lie: allocation `id`, `offset` bytes from its start.
struct SharedRef {
  uint64_t id = 0;
  uint64_t offset = 0;
};

// True when this build can export and map device memory (CUDA).
bool ipc_share_available();
// A random value fixed for the life of this process (0 without CUDA): a rank told the same nonce
// shares the sender's address space and uses its pointers as they are.
uint64_t ipc_process_nonce();
// Waits for all work this process queued on `device` (the trainer, before ranks read its tensors).
Status ipc_device_synchronize(int device);

// Trainer side. Thread-compatible (one caller at a time).
class IpcExporter {
 public:
  IpcExporter();
  ~IpcExporter();
  IpcExporter(const IpcExporter&) = delete;
  IpcExporter& operator=(const IpcExporter&) = delete;

  // The allocation holding [ptr, ptr + bytes) of device memory, exported on first sight.
  Result<SharedRef> locate(const void* ptr, size_t bytes);
  // The record of allocation `id` (after locate() returned it).
  const SharedAllocation* allocation(uint64_t id) const;

 private:
  std::map<uint64_t, SharedAllocation> by_id_;
  std::map<uintptr_t, uint64_t> by_base_;  // base -> id, for a fast lookup of known allocations
};

// Copies `rows` rows of `row_bytes`, `stride` bytes apart from `src`, to `dst` packed (device
// memory of `device`, queued on its legacy default stream, ahead of the kernels that read `dst`).
Status gather_rows(void* dst, const void* src, size_t rows, size_t row_bytes, size_t stride, int device);

// What this process spent exporting its allocations (cudaIpcGetMemHandle, a trainer) and mapping
// other processes' (cudaIpcOpenMemHandle, a rank), since it started: the one-time cost of a
// colocated first update, which grows with the trainer's allocations, not its bytes.
struct IpcStats {
  uint64_t exported = 0;
  double export_seconds = 0;
  uint64_t mapped = 0;
  double map_seconds = 0;
};
IpcStats ipc_stats();

// Rank side: maps each announced allocation once and keeps it mapped while its exporter lives.
class IpcImporter {
 public:
  explicit IpcImporter(int device);
  ~IpcImporter();
  IpcImporter(const IpcImporter&) = delete;
  IpcImporter& operator=(const IpcImporter&) = delete;

  // Records an announced allocation (mapping it lazily). The first allocation of an exporter not
  // seen before (a restarted or new trainer) drops the mappings of exporters that exited.
  Status announce(const SharedAllocation& a);
  // Device address of [offset, offset + bytes) in allocation `id` of the exporter `nonce`.
  Result<const uint8_t*> resolve(uint64_t nonce, uint64_t id, uint64_t offset, uint64_t bytes);

 private:
  struct Mapping;
  int device_;
  std::mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<Mapping>> maps_;  // (nonce, id)
  std::map<uint64_t, int> exporters_;  // nonce -> pid of every exporter with mappings here
};

}  // namespace ferry::transport
