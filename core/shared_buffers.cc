#include "core/shared_buffers.h"

#include <algorithm>

namespace ferry {

SharedBufferPool::SharedBufferPool(size_t max_idle) : state_(std::make_shared<State>()) { state_->max_idle = max_idle; }

size_t SharedBufferPool::idle() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->idle.size();
}

Result<std::shared_ptr<Buffer>> SharedBufferPool::take(size_t bytes, Device device) {
  Buffer buf;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto it = state_->idle.begin(); it != state_->idle.end(); ++it) {
      if (it->device() == device && it->size() >= bytes) {
        buf = std::move(*it);
        state_->idle.erase(it);
        break;
      }
    }
  }
  if (buf.data() == nullptr) {
    FERRY_ASSIGN_OR_RETURN(buf, Buffer::allocate(std::max<size_t>(bytes, 1), device));
  }
  std::weak_ptr<State> pool = state_;
  return std::shared_ptr<Buffer>(new Buffer(std::move(buf)), [pool](Buffer* b) {
    std::unique_ptr<Buffer> owned(b);
    if (auto s = pool.lock()) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->idle.size() < s->max_idle) s->idle.push_back(std::move(*owned));
    }
  });
}

}  // namespace ferry
