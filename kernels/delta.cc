// kernels/delta.h: checks, then the CUDA back end (Unavailable without CUDA).
#include "kernels/delta.h"

#include <cstdint>

#include "core/device_copy.h"
#include "kernels/internal.h"

namespace ferry::kernels {
namespace {

bool aligned(const void* p, size_t elem) { return reinterpret_cast<uintptr_t>(p) % elem == 0; }

Status check_width(size_t elem) {
  if (elem == 1 || elem == 2 || elem == 4 || elem == 8) return ok_status();
  return Status::invalid_argument("delta kernels take elements of 1, 2, 4 or 8 bytes");
}

}  // namespace

Result<uint64_t> scan_changes_on_device(int device, const void* before, const void* after, size_t n, size_t elem,
                                        bool xor_values, void* bitmap, void* values, const Exec& exec) {
  FERRY_RETURN_IF_ERROR(check_width(elem));
  if (!aligned(before, elem) || !aligned(after, elem) || !aligned(values, elem)) {
    return Status::invalid_argument("delta kernels: elements not aligned to their width");
  }
  FERRY_RETURN_IF_ERROR(set_current_device(Device::cuda(device)));
  uint64_t changed = 0;
  FERRY_RETURN_IF_ERROR(
      detail::cuda::scan_changes(before, after, n, elem, xor_values, bitmap, values, &changed, exec.stream));
  return changed;
}

Status scatter_delta_on_device(int device, void* dst, size_t elem, const DeltaChunk* chunks, size_t count,
                               const void* values, bool xor_values, const Exec& exec) {
  FERRY_RETURN_IF_ERROR(check_width(elem));
  if (!aligned(dst, elem) || !aligned(values, elem)) {
    return Status::invalid_argument("delta kernels: elements not aligned to their width");
  }
  FERRY_RETURN_IF_ERROR(set_current_device(Device::cuda(device)));
  return detail::cuda::scatter_delta(dst, elem, chunks, count, values, xor_values, exec.stream);
}

}  // namespace ferry::kernels
