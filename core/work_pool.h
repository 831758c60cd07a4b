// A process-wide pool of host threads for independent pieces of one job (the CPU kernels' row
// ranges): started once and kept, so that a job costs a wake-up, not a thread started and joined per
// piece. A rank fed by several trainer ranks quantizes many small pieces, each cut over all of
// host_threads(); started threads cost more than the work on a many-core host.
//
// Pieces must be independent (none may wait for another): a caller runs its own pieces that no
// worker took yet, so a job finishes with every worker busy, and a piece may start a job of its own.
#pragma once

#include <cstddef>
#include <functional>

namespace ferry {

// fn(t) for t in [0, count), on the pool's threads and the caller's, at most host_threads() at
// once; returns when all are done. fn must not throw (a throw ends the process).
void run_pieces(size_t count, const std::function<void(size_t)>& fn) noexcept;

}  // namespace ferry
