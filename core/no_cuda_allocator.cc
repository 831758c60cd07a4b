// Stand-ins used when ferry is built without CUDA: every device request is Unavailable.
#include "core/buffer.h"
#include "core/device_copy.h"

namespace ferry {

bool cuda_device_available() { return false; }

Result<Allocator*> cuda_allocator(int) { return Status::unavailable("ferry was built without CUDA"); }

Result<Allocator*> pinned_allocator() { return Status::unavailable("ferry was built without CUDA"); }

Status set_current_device(Device device) {
  if (device.is_cuda()) return Status::unavailable("set " + device.to_string() + ": ferry was built without CUDA");
  return ok_status();
}

Status copy_rows_async(int, void*, size_t, const void*, size_t, size_t, size_t) {
  return Status::unavailable("device copy: ferry was built without CUDA");
}
Status wait_copies(int) { return Status::unavailable("device copy: ferry was built without CUDA"); }
Status copy_now(int, void*, const void*, size_t) { return Status::unavailable("device copy: ferry was built without CUDA"); }
Status order_copies_before_default(int) { return Status::unavailable("device copy: ferry was built without CUDA"); }
Status order_default_before_copies(int) { return Status::unavailable("device copy: ferry was built without CUDA"); }

}  // namespace ferry
