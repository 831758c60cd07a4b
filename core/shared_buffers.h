// Buffers handed out as shared pointers and kept for reuse: a buffer whose last holder lets go
// returns to the pool (at most `max_idle` stay idle; more are freed), so that a steady stream of
// buckets does not allocate, and fault in, fresh pages for each. Safe to use from several threads;
// buffers may outlive the pool.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "core/buffer.h"

namespace ferry {

class SharedBufferPool {
 public:
  explicit SharedBufferPool(size_t max_idle);
  // An idle buffer of at least `bytes` on `device`, or a new one; its contents are whatever the
  // last holder left.
  Result<std::shared_ptr<Buffer>> take(size_t bytes, Device device = Device::cpu());
  size_t idle() const;

 private:
  struct State {
    mutable std::mutex mu;
    std::vector<Buffer> idle;
    size_t max_idle = 0;
  };
  std::shared_ptr<State> state_;
};

}  // namespace ferry
