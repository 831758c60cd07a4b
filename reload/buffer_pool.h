// Host (and device) buffers kept between updates, so that staging and scratch are not allocated (and their
// pages faulted in) anew for every layer of every update. Bounded: the pool keeps at most `cap`
// idle bytes, and the engine sets the cap to what its largest layer holds at once, so in plan order
// a rank still holds about one layer of staging whether or not an update is running.
#pragma once

#include <cstdint>
#include <map>
#include <utility>

#include "core/buffer.h"

namespace ferry::reload {

class BufferPool {
 public:
  void set_cap(uint64_t cap) { cap_ = cap; }
  // A buffer of at least `bytes` on `device` (at most about twice that, so accounting stays
  // honest); its contents are whatever the last user left.
  Result<Buffer> take(size_t bytes, Device device = Device::cpu());
  // Keeps `buffer` for a later take() on its device when it fits under the cap; frees it otherwise.
  void give(Buffer buffer);
  uint64_t idle_bytes() const { return idle_bytes_; }
  void clear();

 private:
  // By (device: -1 for the host, else the CUDA index; size).
  std::multimap<std::pair<int, size_t>, Buffer> idle_;
  uint64_t cap_ = 0;
  uint64_t idle_bytes_ = 0;
};

}  // namespace ferry::reload
