#pragma once

#include <memory>

#include "transport/transport.h"

namespace ferry::transport {

// CUDA IPC between processes (or threads) on one node: the receiver's callback gets DEVICE memory
// on the device that was current when the transport was created, read in place from a ring the
// receiver owns (see cuda_ipc_wire.h). Unavailable without a CUDA device.
Result<std::unique_ptr<Transport>> create_cuda_ipc_transport(const TransportOptions& options);

namespace cuda_ipc {
// Sender side (cuda_ipc_sender.cc): connects `device`'s memory to a listener blob
// "cuda_ipc://<boot id>/<socket name>", presenting `credential` first.
Result<std::unique_ptr<Connection>> connect(const std::string& blob, int device, Deadline deadline,
                                            std::string_view credential);
}  // namespace cuda_ipc

}  // namespace ferry::transport
