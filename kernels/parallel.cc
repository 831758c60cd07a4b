// A fork-join loop over std::thread for the CPU kernels.
#include <algorithm>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "kernels/internal.h"

namespace ferry::kernels::detail {

void parallel_for(int64_t n, int64_t grain, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t workers = threads > 0 ? threads : static_cast<int64_t>(host_threads());
  workers = std::min(workers, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  const int64_t chunk = (n + workers - 1) / workers;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t b = w * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(0, std::min(n, chunk));
  for (auto& t : pool) t.join();
}

}  // namespace ferry::kernels::detail
