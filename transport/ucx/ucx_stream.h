// ucx's receiving side, shared state (ucx_receiver.cc): a sender's stream and the order of its
// buckets, the table of streams that the receivers of one host's lanes share, and the lock over it
// (ucx_stream.cc).
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "transport/ucx/ucx_buffer_pool.h"
#include "transport/ucx/ucx_engine.h"

namespace ferry::transport::ucx {

class Receiver;

// One sender's connection (a stream): its endpoints (one, or a same-host sender's lanes, joined by
// their LaneHeader) and its buckets, queued by sequence number while one ahead of them is still
// arriving.
struct Inbound {
  std::vector<ucp_ep_h> eps;
  std::map<ucp_ep_h, std::weak_ptr<Receiver>> owners;  // the receiver that accepted each of `eps`
  uint64_t stream = 0;  // the lanes' stream id; 0: one endpoint without a header
  uint32_t lanes = 1;
  int64_t peer = 0;  // the identity admission returned (every lane's is the same)
  uint64_t max_bucket = 0;  // the largest bucket admission lets it deliver (the least of its lanes')
  std::set<ucp_ep_h> byes;  // the endpoints that said goodbye
  bool bye = false;         // every lane said goodbye
  bool closed = false;
  uint64_t next_seq = 0;      // the next sequence number a bucket without a header gets
  uint64_t next_deliver = 0;  // the sequence number delivered next
  // A bucket received into memory of ours, handed over when delivered: the callback may keep it
  // (ReceivedBucket::owner) and drop it later on any thread; its block then returns to the pool.
  struct Pending {
    std::shared_ptr<BufferPool> pool;
    std::unique_ptr<BufferPool::Block> block;  // rendezvous buckets
    std::vector<uint8_t> copy;                 // eager ones that arrived behind a rendezvous
    size_t size = 0;
    bool ready = false;
    const uint8_t* data() const { return block ? block->buffer.data_as<uint8_t>() : copy.data(); }
    ~Pending() {
      if (pool) pool->give(std::move(block));
    }
  };
  std::map<uint64_t, std::shared_ptr<Pending>> queue;  // by sequence number

  // The place of a bucket arriving with `header` (a LaneHeader, or none) in the stream: the lane
  // header's sequence number, or without one the next in arrival order.
  uint64_t sequence(const void* header, size_t header_length);
  // Whether a bucket numbered `seq` arrived before.
  bool seen(uint64_t seq) const { return seq < next_deliver || queue.count(seq) != 0; }
  // Whether a bucket numbered `seq` may be delivered at once: it is next and nothing is queued.
  bool next(uint64_t seq) const { return queue.empty() && seq == next_deliver; }
  // The next bucket in order, taken off the queue, once it has arrived; else null.
  std::shared_ptr<Pending> pop_ready();
};

// The streams of the receivers that share it, by id. The lanes of one same-host connection reach
// different receivers (one per lane, each on a progress thread of its own: ucx_transport.cc), so a
// stream and its Inbound are shared between those threads: every handler holds `mu` (through a
// TableLock, below; recursive: a close may call back into the handlers on the same thread) while it
// touches either.
// They also share one pool of receive buffers (unmapped: see BufferPool), so a buffer that one
// lane's bucket left is there for the next bucket, whichever lane brings it.
struct StreamTable {
  std::recursive_mutex mu;
  std::map<uint64_t, std::shared_ptr<Inbound>> streams;
  // The ids of the streams that ended here (their last endpoint gone), the newest kEndedKept. UCX
  // keeps no order between endpoints, so a lane's hello can come after its stream was refused and
  // closed on the other lanes: join() refuses such a lane instead of starting a new stream with it,
  // whose close would be reported as a second end of the same connection.
  std::deque<uint64_t> ended;
  static constexpr size_t kEndedKept = 4096;
  std::shared_ptr<BufferPool> pool;  // null: each receiver maps a pool of its own

  // A lane's admission: joins endpoint `ep` (accepted by `owner`; `lane` its record so far) to the
  // stream `h` names, and points `lane` at that stream's record. False (logged) when the stream is
  // another peer's: no admitted sender can slip buckets into another's stream, or when the stream
  // has ended.
  bool join(std::shared_ptr<Inbound>& lane, const LaneHeader& h, ucp_ep_h ep, std::weak_ptr<Receiver> owner);
  // Takes `e` out of its stream; the stream's id goes with its last endpoint.
  void forget(Inbound& in, ucp_ep_h e);
};

// Holds a table's lock. Nothing calls into UCX while a thread holds it: UCX calls back into the
// handlers (which take it) while holding a lock of its own (a receive completing in
// ucp_ep_req_purge, when an endpoint is closed under a rendezvous), so a UCX call made under the
// table's lock (ucp_rndv_receive takes that lock) could deadlock with it. What must call into UCX
// under the lock goes through later(): it runs once the thread's outermost TableLock lets go.
class TableLock {
 public:
  explicit TableLock(StreamTable& t) : table_(t) {
    table_.mu.lock();
    ++depth();
  }
  ~TableLock() {
    std::vector<std::function<void()>> deferred;
    if (--depth() == 0) deferred.swap(queue());
    table_.mu.unlock();
    for (auto& fn : deferred) fn();
  }
  TableLock(const TableLock&) = delete;
  TableLock& operator=(const TableLock&) = delete;

  // Runs `fn` now if this thread holds no table's lock, else as soon as it lets go of it. Also
  // drops what `fn` holds only then (a bucket's buffer: unmapping it calls into UCX).
  static void later(std::function<void()> fn) {
    if (depth() == 0) return fn();
    queue().push_back(std::move(fn));
  }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::vector<std::function<void()>>& queue() {
    thread_local std::vector<std::function<void()>> q;
    return q;
  }
  StreamTable& table_;
};

// A message to the sender at the other end of `ep` (kRefuseId with the reason, kByeAckId). Sent
// once no table lock is held.
void notify(ucp_ep_h ep, unsigned id, std::string text);

}  // namespace ferry::transport::ucx
