#include "reload/buffer_pool.h"

namespace ferry::reload {

Result<Buffer> BufferPool::take(size_t bytes) {
  auto it = idle_.lower_bound(bytes);
  if (it != idle_.end() && it->first <= 2 * bytes + 4096) {
    Buffer b = std::move(it->second);
    idle_bytes_ -= it->first;
    idle_.erase(it);
    return b;
  }
  return Buffer::allocate(bytes, Device::cpu());
}

void BufferPool::give(Buffer buffer) {
  if (buffer.data() == nullptr || !buffer.device().is_cpu()) return;
  if (idle_bytes_ + buffer.size() > cap_) return;  // freed here
  idle_bytes_ += buffer.size();
  const size_t n = buffer.size();
  idle_.emplace(n, std::move(buffer));
}

void BufferPool::clear() {
  idle_.clear();
  idle_bytes_ = 0;
}

}  // namespace ferry::reload
