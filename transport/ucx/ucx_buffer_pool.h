// Receive buffers of ucx's receivers (ucx_receiver.cc).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "core/buffer.h"

namespace ferry::transport::ucx {

class Engine;

// Receive buffers for rendezvous buckets, kept and reused: each is allocated and mapped with the
// UCP context once, and UCX writes the bucket straight into it (no fresh pages, no registration per
// bucket). Idle ones stay up to the most that were out at once over the pool's life (at least
// kKeepAtLeast; beyond that, at most kKeepBytes of them): a rank holds a delivered bucket until the
// layers its pieces belong to are complete, which with several senders interleaving their layers
// is many buckets, and each one more than the pool kept was fresh pages for UCX to fault in, every
// update. So a pool (a receiver's, or the one a host's lanes share) keeps up to that much host
// memory, mapped with its context, while it lives.
//
// A delivered bucket's block is handed over (ReceivedBucket::owner), so it comes back whenever its last
// holder lets go: on any thread, possibly after the receiver stopped and the transport is gone. So
// take() and give() lock, and the pool holds the Engine: every Pending holds the pool, so the UCP
// context outlives every block mapped with it, and the last block's release unmaps it, then frees the
// pool, then maybe the Engine (whose progress thread the transport has joined by then). Mapping and
// unmapping from a thread other than the progress thread is allowed: the context is created with
// mt_workers_shared (ucx_engine.h), and neither touches the worker.
class BufferPool {
 public:
  struct Block {
    Buffer buffer;
    ucp_mem_h memh = nullptr;
  };
  // Without an engine the blocks are not mapped (memh stays null): the pool that the receivers of
  // one host's lanes share, each with a UCP context of its own (StreamTable); UCX registers per
  // operation what it needs, which for shared memory and cma is nothing.
  explicit BufferPool(std::shared_ptr<Engine> engine);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A block of at least `size` bytes (size > 0), or nullptr if the memory cannot be had. Any thread.
  std::unique_ptr<Block> take(size_t size);
  // Any thread.
  void give(std::unique_ptr<Block> b);
  // Blocks allocated over the pool's life. Any thread.
  size_t allocations() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allocations_;
  }

 private:
  static constexpr size_t kKeepAtLeast = 2;
  static constexpr size_t kKeepBytes = size_t{1} << 30;
  const std::shared_ptr<Engine> engine_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Block>> idle_;
  size_t idle_bytes_ = 0;
  size_t out_ = 0;       // blocks taken and not given back yet
  size_t most_out_ = 0;  // the most at once
  size_t allocations_ = 0;
};

}  // namespace ferry::transport::ucx
