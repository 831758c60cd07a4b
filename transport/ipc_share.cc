#include "transport/ipc_share.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/log.h"

#if FERRY_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "transport/common/socket.h"
#endif

namespace ferry::transport {

namespace {

std::atomic<uint64_t> g_exported{0}, g_export_nanos{0}, g_mapped{0}, g_map_nanos{0};

// Counts one call of `count` and the time since `t0` in `nanos`.
[[maybe_unused]] void tally(std::atomic<uint64_t>& count, std::atomic<uint64_t>& nanos,
                            std::chrono::steady_clock::time_point t0) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  nanos.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
  count.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

IpcStats ipc_stats() {
  auto seconds = [](const std::atomic<uint64_t>& ns) {
    return static_cast<double>(ns.load(std::memory_order_relaxed)) / 1e9;
  };
  return {g_exported.load(std::memory_order_relaxed), seconds(g_export_nanos), g_mapped.load(std::memory_order_relaxed),
          seconds(g_map_nanos)};
}

#if FERRY_HAVE_CUDA

namespace {

using PointerGetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

// cuPointerGetAttributes through the runtime's driver entry point: no link against libcuda.
Result<PointerGetAttributes> pointer_get_attributes() {
  static PointerGetAttributes fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<PointerGetAttributes>(nullptr);
    }
    return reinterpret_cast<PointerGetAttributes>(p);
  }();
  if (fn == nullptr) return Status::unavailable("the CUDA driver offers no cuPointerGetAttributes");
  return fn;
}

bool process_alive(int pid) { return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH; }

}  // namespace

bool ipc_share_available() { return true; }
uint64_t ipc_process_nonce() { return net::process_nonce(); }

Status ipc_device_synchronize(int device) {
  ScopedDevice d(device);
  FERRY_CUDA_CHECK(cudaDeviceSynchronize());
  return ok_status();
}

IpcExporter::IpcExporter() = default;
IpcExporter::~IpcExporter() = default;

Result<SharedRef> IpcExporter::locate(const void* ptr, size_t bytes) {
  FERRY_ASSIGN_OR_RETURN(PointerGetAttributes get, pointer_get_attributes());
  unsigned long long buffer_id = 0;
  CUdeviceptr start = 0;
  size_t range = 0;
  int type = 0, ordinal = -1;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* out[] = {&buffer_id, &start, &range, &type, &ordinal};
  const CUresult r = get(5, attrs, out, reinterpret_cast<CUdeviceptr>(ptr));
  if (r != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE || buffer_id == 0) {
    return Status::invalid_argument(fmt::format("{} is not CUDA device memory this process allocated (error {})", ptr,
                                                static_cast<int>(r)));
  }
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (p < start || p + bytes > start + range) {
    return Status::invalid_argument(fmt::format("{} + {} bytes runs past its allocation of {} bytes", ptr, bytes, range));
  }
  auto it = by_id_.find(buffer_id);
  if (it == by_id_.end()) {
    SharedAllocation a;
    a.id = buffer_id;
    a.size = range;
    a.base = start;
    a.device = ordinal;
    a.pid = static_cast<int>(getpid());
    a.process_nonce = net::process_nonce();
    cudaIpcMemHandle_t h{};
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(start));
    tally(g_exported, g_export_nanos, t0);
    if (e != cudaSuccess) {
      // Memory from cudaMallocAsync pools or virtual memory management has no legacy IPC handle.
      // The caller handles this (the weights travel as bytes), so the failure must not stay behind
      // as this thread's last CUDA error: the application's next error check (PyTorch checks after
      // every kernel launch) would report it as its own.
      (void)cudaGetLastError();
      return cuda_status(e, "cudaIpcGetMemHandle", __FILE__, __LINE__)
          .with_context(fmt::format("exporting the allocation of {} bytes holding {} (allocate weights with cudaMalloc, "
                                    "or set FERRY_DIRECT=off)", range, ptr));
    }
    a.handle.assign(reinterpret_cast<const char*>(&h), sizeof h);
    // A new allocation at the base of a freed one replaces it.
    auto old = by_base_.find(start);
    if (old != by_base_.end()) by_id_.erase(old->second);
    by_base_[start] = buffer_id;
    it = by_id_.emplace(buffer_id, std::move(a)).first;
  }
  return SharedRef{buffer_id, p - start};
}

const SharedAllocation* IpcExporter::allocation(uint64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &it->second;
}

Status gather_rows(void* dst, const void* src, size_t rows, size_t row_bytes, size_t stride, int device) {
  ScopedDevice d(device);
  FERRY_CUDA_CHECK(cudaMemcpy2DAsync(dst, row_bytes, src, stride, row_bytes, rows, cudaMemcpyDeviceToDevice, nullptr));
  return ok_status();
}

struct IpcImporter::Mapping {
  SharedAllocation info;
  void* ptr = nullptr;
  bool opened = false;  // by cudaIpcOpenMemHandle (closed on destruction)
  int device = 0;
  ~Mapping() {
    if (!opened) return;
    ScopedDevice d(device);
    cudaIpcCloseMemHandle(ptr);
  }
};

IpcImporter::IpcImporter(int device) : device_(device) {}
IpcImporter::~IpcImporter() = default;

Status IpcImporter::announce(const SharedAllocation& a) {
  if (a.handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return Status::data_loss(fmt::format("allocation #{}: IPC handle of {} bytes", a.id, a.handle.size()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Mappings of exporters that exited go: their memory is released once nobody maps it. Checked
  // when a new exporter appears, once per exporter: sweeping every mapping on every announcement
  // cost a first update from 18,867 trainer allocations 178 million kill() calls, 33 s.
  if (!exporters_.contains(a.process_nonce)) {
    for (auto e = exporters_.begin(); e != exporters_.end();) {
      if (process_alive(e->second)) {
        ++e;
        continue;
      }
      const uint64_t dead = e->first;
      std::erase_if(maps_, [dead](const auto& kv) { return kv.first.first == dead; });
      e = exporters_.erase(e);
    }
    exporters_[a.process_nonce] = a.pid;
  }
  auto& m = maps_[{a.process_nonce, a.id}];
  if (m && m->info.handle == a.handle && m->info.base == a.base) return ok_status();
  m = std::make_unique<Mapping>();
  m->info = a;
  m->device = device_;
  return ok_status();
}

Result<const uint8_t*> IpcImporter::resolve(uint64_t nonce, uint64_t id, uint64_t offset, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = maps_.find({nonce, id});
  if (it == maps_.end()) {
    return Status::data_loss(fmt::format("direct piece in allocation #{} that its sender never announced", id));
  }
  Mapping& m = *it->second;
  if (offset > m.info.size || bytes > m.info.size - offset) {
    return Status::data_loss(
        fmt::format("direct piece {}+{} lies outside allocation #{} of {} bytes", offset, bytes, id, m.info.size));
  }
  if (m.ptr == nullptr) {
    if (m.info.process_nonce == net::process_nonce()) {
      m.ptr = reinterpret_cast<void*>(m.info.base);  // the sender is this process
    } else {
      ScopedDevice d(device_);
      cudaIpcMemHandle_t h;
      std::memcpy(&h, m.info.handle.data(), sizeof h);
      void* p = nullptr;
      const auto t0 = std::chrono::steady_clock::now();
      const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      tally(g_mapped, g_map_nanos, t0);
      if (e != cudaSuccess) {
        return cuda_status(e, "cudaIpcOpenMemHandle", __FILE__, __LINE__)
            .with_context(fmt::format("mapping allocation #{} of pid {} (cuda:{}) into cuda:{}: both GPUs must be on "
                                      "this node with peer access; FERRY_DIRECT=off sends bytes instead",
                                      id, m.info.pid, m.info.device, device_));
      }
      m.ptr = p;
      m.opened = true;
    }
  }
  return static_cast<const uint8_t*>(m.ptr) + offset;
}


#else  // no CUDA

bool ipc_share_available() { return false; }
uint64_t ipc_process_nonce() { return 0; }
Status ipc_device_synchronize(int) { return Status::unavailable("CUDA device: ferry was built without CUDA"); }

IpcExporter::IpcExporter() = default;
IpcExporter::~IpcExporter() = default;
Result<SharedRef> IpcExporter::locate(const void*, size_t) {
  return Status::unavailable("direct device reads: ferry was built without CUDA");
}
const SharedAllocation* IpcExporter::allocation(uint64_t) const { return nullptr; }

Status gather_rows(void*, const void*, size_t, size_t, size_t, int) {
  return Status::unavailable("direct device reads: ferry was built without CUDA");
}

struct IpcImporter::Mapping {
  SharedAllocation info;
};
IpcImporter::IpcImporter(int device) : device_(device) {}
IpcImporter::~IpcImporter() = default;
Status IpcImporter::announce(const SharedAllocation&) {
  return Status::unavailable("direct device reads: ferry was built without CUDA");
}
Result<const uint8_t*> IpcImporter::resolve(uint64_t, uint64_t, uint64_t, uint64_t) {
  return Status::unavailable("direct device reads: ferry was built without CUDA");
}

#endif

}  // namespace ferry::transport
