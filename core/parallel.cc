#include "core/parallel.h"

#include <atomic>

namespace ferry {
namespace {

size_t hardware_threads() {
  static const size_t hw = std::max<size_t>(std::thread::hardware_concurrency(), 1);
  return hw;
}

std::atomic<size_t>& chosen() {
  static std::atomic<size_t> n{0};
  return n;
}

}  // namespace

size_t host_threads() {
  const size_t n = chosen().load(std::memory_order_relaxed);
  return n > 0 ? n : hardware_threads();
}

void set_host_threads(size_t threads) { chosen().store(threads, std::memory_order_relaxed); }

}  // namespace ferry
