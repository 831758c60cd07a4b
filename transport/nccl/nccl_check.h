// FERRY_NCCL_CHECK: turns an ncclResult_t into a Status carrying the expression, NCCL's own last
// error text and file:line. ncclInProgress (a non-blocking communicator still working) is not an
// error for callers that poll; they test for it before checking.
#pragma once

#include <nccl.h>

#include <string>

#include "core/status.h"

namespace ferry {

inline StatusCode nccl_code(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return StatusCode::kOk;
    case ncclSystemError:
    case ncclRemoteError:
      return StatusCode::kUnavailable;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kInternal;
  }
}

inline Status nccl_status(ncclResult_t r, const char* expr, const char* file, int line, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return ok_status();
  std::string msg = std::string(expr) + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += std::string(" (") + last + ")";
  return Status(nccl_code(r), msg + " at " + file + ":" + std::to_string(line));
}

}  // namespace ferry

#define FERRY_NCCL_CHECK(expr) FERRY_RETURN_IF_ERROR(::ferry::nccl_status((expr), #expr, __FILE__, __LINE__))
