// ucx: UCP active messages over whatever UCX picks (UCX_TLS is the user's to set); host memory, and
// device memory through pinned staging when this UCX build lacks CUDA support.
#pragma once

#include <memory>

#include "transport/transport.h"

namespace ferry::transport {

Result<std::unique_ptr<Transport>> create_ucx_transport();

}  // namespace ferry::transport
