// Copies through one private CUDA stream per device and thread: they wait for nothing else queued
// on the device (a stalled transfer, a user's kernels), and nothing else waits for them unless
// asked (order_copies_before_default). Pointers may be host memory, memory of `device`, or of a
// peer device (unified addressing). Unavailable when ferry was built without CUDA.
#pragma once

#include <cstddef>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

// Makes `device` this thread's current CUDA device (what transports created afterwards use); no-op
// for the CPU.
Status set_current_device(Device device);

// Queues `rows` rows of `row_bytes`, `src_pitch` bytes apart at `src`, to `dst` rows `dst_pitch`
// bytes apart, on this thread's stream of `device`.
Status copy_rows_async(int device, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                       size_t rows);
inline Status copy_async(int device, void* dst, const void* src, size_t bytes) {
  return copy_rows_async(device, dst, bytes, src, bytes, bytes, 1);
}
// Blocks until every copy this thread queued on `device` has landed.
Status wait_copies(int device);
// copy_async, then wait_copies.
Status copy_now(int device, void* dst, const void* src, size_t bytes);
// Work queued afterwards on `device`'s legacy default stream runs after the copies queued so far.
Status order_copies_before_default(int device);
// The reverse: copies queued afterwards run after the work queued so far on the legacy default
// stream (kernels that may still read a buffer about to be overwritten).
Status order_default_before_copies(int device);

// Byte copy between host and device memory (either side may be either), complete on return: on the
// legacy default stream, then waited for when the destination is a device (other streams and
// processes read it next).
Status copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// Waits for the work enqueued on `device` (nothing on the CPU).
Status device_synchronize(Device device);

}  // namespace ferry
