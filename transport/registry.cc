// The one place transports are listed, in priority order. Adding a transport adds one line here.
#include <fmt/format.h>

#include "core/settings.h"
#if defined(FERRY_TRANSPORT_CUDA_IPC)
#include "transport/cuda_ipc_transport.h"
#endif
#if defined(FERRY_TRANSPORT_NCCL)
#include "transport/nccl_transport.h"
#endif
#include "transport/shm_transport.h"
#include "transport/tcp_transport.h"
#include "transport/ucx_transport.h"
#include "transport/transport.h"

namespace ferry::transport {

namespace {
thread_local std::shared_ptr<const void> t_bucket_owner;
}  // namespace

std::shared_ptr<const void> bucket_owner() { return t_bucket_owner; }

BucketOwnerScope::BucketOwnerScope(std::shared_ptr<const void> owner) : previous_(std::move(t_bucket_owner)) {
  t_bucket_owner = std::move(owner);
}

BucketOwnerScope::~BucketOwnerScope() { t_bucket_owner = std::move(previous_); }

const std::vector<TransportFactory>& transport_factories() {
  // cuda_ipc and nccl hand the receiver DEVICE memory, so "auto" never picks them: they are used
  // only when named (FERRY_TRANSPORT), until receivers take device buckets.
  static const std::vector<TransportFactory> factories = {
#if defined(FERRY_TRANSPORT_CUDA_IPC)
      {"cuda_ipc", create_cuda_ipc_transport, /*automatic=*/false},
#endif
#if defined(FERRY_TRANSPORT_NCCL)
      {"nccl", create_nccl_transport, /*automatic=*/false},
#endif
      {"shm", create_shm_transport},
#if defined(FERRY_TRANSPORT_UCX)
      {"ucx", create_ucx_transport},
#endif
      {"tcp", create_tcp_transport},
  };
  return factories;
}

Result<std::unique_ptr<Transport>> create_transport(std::string_view name) {
  if (name.empty()) {
    FERRY_ASSIGN_OR_RETURN(std::string forced, setting_string("FERRY_TRANSPORT"));
    return create_transport(forced);
  }
  Status last = Status::unavailable("no transport could be created");
  for (const auto& f : transport_factories()) {
    if (name == "auto" ? !f.automatic : f.name != name) continue;
    auto t = f.create();
    if (t.ok()) return t;
    last = t.status().with_context(std::string(f.name));
    if (name != "auto") return last;
  }
  if (name != "auto") {
    return Status::unavailable(fmt::format("transport '{}' is not built into this ferry", name));
  }
  return last;
}

}  // namespace ferry::transport
