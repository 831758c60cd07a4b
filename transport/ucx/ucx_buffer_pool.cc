#include "transport/ucx/ucx_buffer_pool.h"

#include <algorithm>

#include "transport/ucx/ucx_engine.h"

namespace ferry::transport::ucx {

BufferPool::BufferPool(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {}

BufferPool::~BufferPool() {
  if (engine_) {
    for (auto& b : idle_) engine_->unmap(b->memh);
  }
}

std::unique_ptr<BufferPool::Block> BufferPool::take(size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++out_;
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->buffer.size() >= size && (best == idle_.end() || (*it)->buffer.size() < (*best)->buffer.size())) best = it;
    }
    if (best != idle_.end()) {
      auto b = std::move(*best);
      idle_.erase(best);
      idle_bytes_ -= b->buffer.size();
      most_out_ = std::max(most_out_, out_);
      return b;
    }
  }
  auto buf = Buffer::allocate(size);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!buf.ok()) {
      --out_;
      return nullptr;
    }
    ++allocations_;
    most_out_ = std::max(most_out_, out_);
  }
  auto b = std::make_unique<Block>();
  b->buffer = std::move(*buf);
  if (engine_) b->memh = engine_->map(b->buffer.data(), b->buffer.size());
  return b;
}

void BufferPool::give(std::unique_ptr<Block> b) {
  if (!b) return;
  std::vector<std::unique_ptr<Block>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --out_;
    idle_bytes_ += b->buffer.size();
    idle_.push_back(std::move(b));
    const size_t keep = std::max(kKeepAtLeast, most_out_);
    while (idle_.size() > keep || (idle_.size() > kKeepAtLeast && idle_bytes_ > kKeepBytes)) {
      // Drop the smallest: buckets are of few sizes, and a larger block serves a smaller bucket.
      auto smallest = std::min_element(idle_.begin(), idle_.end(),
                                       [](const auto& x, const auto& y) { return x->buffer.size() < y->buffer.size(); });
      idle_bytes_ -= (*smallest)->buffer.size();
      dropped.push_back(std::move(*smallest));
      idle_.erase(smallest);
    }
  }
  for (auto& d : dropped) {
    if (engine_) engine_->unmap(d->memh);  // then its buffer is freed
  }
}

}  // namespace ferry::transport::ucx
