// A fork-join loop for the CPU kernels, on the process's work pool (core/work_pool.h).
#include <algorithm>

#include "core/parallel.h"
#include "core/work_pool.h"
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
  const auto pieces = static_cast<size_t>((n + chunk - 1) / chunk);
  run_pieces(pieces, [&](size_t w) {
    const int64_t b = static_cast<int64_t>(w) * chunk;
    fn(b, std::min(n, b + chunk));
  });
}

}  // namespace ferry::kernels::detail
