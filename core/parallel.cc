#include "core/parallel.h"

#include <atomic>
#include <cstring>

#include "core/work_pool.h"

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

void copy_parallel(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;  // (either pointer may then be null)
  const size_t slices = slices_for(bytes, size_t{512} << 10);
  if (slices < 2) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t step = bytes / slices / 64 * 64;
  run_pieces(slices, [&](size_t t) {
    const size_t lo = t * step, hi = t + 1 == slices ? bytes : lo + step;
    std::memcpy(static_cast<uint8_t*>(dst) + lo, static_cast<const uint8_t*>(src) + lo, hi - lo);
  });
}

}  // namespace ferry
