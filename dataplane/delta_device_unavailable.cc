// The CUDA side of dataplane/delta_device.h on a build without CUDA.
#include "dataplane/delta_device.h"

namespace ferry::dataplane::detail {
namespace {
Status unavailable() { return Status::unavailable("device deltas: ferry was built without CUDA"); }
}  // namespace

Status scan_changes(int, const void*, const void*, uint64_t, size_t, bool, void*, void*, uint64_t*) {
  return unavailable();
}
Status apply_bitmap(int, void*, uint64_t, size_t, const uint8_t*, const void*, bool, const RowMarks*) {
  return unavailable();
}
Status find_runs(int, const uint8_t*, uint64_t, uint64_t, uint8_t*, DeviceRuns*) { return unavailable(); }
Status copy_in_order(int, void*, const void*, size_t) { return unavailable(); }
Status wait_in_order(int) { return unavailable(); }
Status apply_runs(int, void*, uint64_t, size_t, const uint8_t*, uint64_t, uint64_t, const void*, uint64_t, bool,
                  const RowMarks*) {
  return unavailable();
}

}  // namespace ferry::dataplane::detail
