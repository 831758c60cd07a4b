#include "reload/buffer_pool.h"

namespace ferry::reload {

namespace {
int device_key(Device d) { return d.is_cpu() ? -1 : d.index; }
}  // namespace

Result<Buffer> BufferPool::take(size_t bytes, Device device) {
  const int key = device_key(device);
  auto it = idle_.lower_bound({key, bytes});
  if (it != idle_.end() && it->first.first == key && it->first.second <= 2 * bytes + 4096) {
    Buffer b = std::move(it->second);
    idle_bytes_ -= it->first.second;
    idle_.erase(it);
    return b;
  }
  return Buffer::allocate(bytes, device);
}

void BufferPool::give(Buffer buffer) {
  if (buffer.data() == nullptr) return;
  if (idle_bytes_ + buffer.size() > cap_) return;  // freed here
  idle_bytes_ += buffer.size();
  const std::pair<int, size_t> key{device_key(buffer.device()), buffer.size()};
  idle_.emplace(key, std::move(buffer));
}

void BufferPool::clear() {
  idle_.clear();
  idle_bytes_ = 0;
}

}  // namespace ferry::reload
