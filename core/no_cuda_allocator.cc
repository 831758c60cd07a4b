// Stand-ins used when ferry is built without CUDA: every device request is Unavailable.
#include "core/buffer.h"

namespace ferry {

bool cuda_device_available() { return false; }

Result<Allocator*> cuda_allocator(int) { return Status::unavailable("ferry was built without CUDA"); }

Result<Allocator*> pinned_allocator() { return Status::unavailable("ferry was built without CUDA"); }

}  // namespace ferry
