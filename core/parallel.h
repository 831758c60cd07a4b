// Host work shared across threads: a large piece's copy, compare or decode is cut into slices (at
// most host_threads(), 8 at most), each on a thread of its own (on_threads), or a single copy's on
// the work pool (copy_parallel).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace ferry {

// The host threads this process spreads its own work over: its large copies, compares and decodes
// (at most 8 of them at a time), a rank's CPU quantization, the lanes of a ucx connection on one
// host. FERRY_THREADS as last applied (apply_process_settings), else the hardware's threads. Set
// it where several processes share a host's cores (trainer ranks and rollout ranks of one node),
// so that together they do not ask for more threads than there are cores.
size_t host_threads();
// 0: the hardware's threads (read once).
void set_host_threads(size_t threads);

// fn(t) for t in [0, count), each on a thread of its own: the last on the caller's, the others on
// threads started for them (or on the caller's too when none is to be had). fn must not throw (on
// a started thread that ends the process); callers catch what they expect inside it.
template <typename Fn>
void on_threads(size_t count, Fn&& fn) {
  if (count == 0) return;
  std::vector<std::jthread> threads;
  threads.reserve(count - 1);
  for (size_t t = 0; t + 1 < count; ++t) {
    try {
      threads.emplace_back([&fn, t] { fn(t); });
    } catch (const std::system_error&) {
      fn(t);
    }
  }
  fn(count - 1);
}

// How many slices of at least `least` units `n` units are cut into: at most host_threads(), and
// `most` (1 when n is under two slices).
inline size_t slices_for(size_t n, size_t least, size_t most = 8) {
  return std::max<size_t>(std::min({host_threads(), most, n / least}), 1);
}

// memcpy of host memory, in slices of at least 512 KiB on the work pool's threads (run_pieces), at
// most host_threads() and 8 at once: the copy-in of a rank's processed layer, a staged piece's rows,
// the copy a sender keeps for deltas.
void copy_parallel(void* dst, const void* src, size_t bytes);

}  // namespace ferry
