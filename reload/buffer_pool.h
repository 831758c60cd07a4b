// Host (and device) buffers kept between updates, so that staging and scratch are not allocated (and their
// pages faulted in) anew for every layer of every update. Bounded: the pool keeps at most a cap of
// idle bytes on the host and another on devices. The engine sets both to what its largest layer
// holds at once, so in plan order a rank holds about one layer of staging whether or not an update
// is running. The host cap then rises to the most host bytes taken out at once (settle_host()
// brings it down after an update that needed at most half, and after a staged one), so that input
// which keeps several layers open at once (every trainer rank's buckets span many layers) finds its
// buffers again on the next update; device memory stays with the engine's kernels.
#pragma once

#include <cstdint>
#include <map>
#include <utility>

#include "core/buffer.h"

namespace ferry::reload {

class BufferPool {
 public:
  void set_caps(uint64_t host, uint64_t device) {
    set_host_cap(host);
    device_cap_ = device;
  }
  // Frees idle host buffers, largest first, until what stays fits under `cap`.
  void set_host_cap(uint64_t cap);
  // Starts a period (an update) with nothing out: buffers an earlier one dropped without give() (its
  // error paths) no longer count.
  void begin_period();
  // Ends a period, everything given back: the host cap stays at the most host bytes taken out at
  // once so far, unless this period's most (at least `floor`) was at most half of that, which
  // becomes the cap. `keep_peak` false: `floor` becomes the cap whatever the period held (a staged
  // update holds every layer's staging at once; that is not kept between updates).
  void settle_host(uint64_t floor, bool keep_peak = true);
  // A buffer of at least `bytes` on `device` (at most about twice that, so accounting stays
  // honest); its contents are whatever the last user left.
  Result<Buffer> take(size_t bytes, Device device = Device::cpu());
  // Keeps `buffer` for a later take() on its device when it fits under the cap; frees it otherwise.
  void give(Buffer buffer);
  uint64_t idle_bytes() const { return idle_host_ + idle_device_; }
  // Host bytes take() allocated anew since the pool was made (it found no idle buffer to reuse).
  uint64_t allocated_bytes() const { return allocated_; }
  void clear();

 private:
  // By (device: -1 for the host, else the CUDA index; size).
  std::multimap<std::pair<int, size_t>, Buffer> idle_;
  uint64_t host_cap_ = 0;
  uint64_t device_cap_ = 0;
  uint64_t idle_host_ = 0;
  uint64_t idle_device_ = 0;
  uint64_t allocated_ = 0;
  uint64_t out_host_ = 0;  // host bytes taken and not given back
  uint64_t peak_out_host_ = 0;
};

}  // namespace ferry::reload
