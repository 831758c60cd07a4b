// ucx's sending side, one endpoint (ucx_connection.cc): a connection to another host, or one lane
// of a connection to this host (ucx_sender.cc joins a connection's lanes); its posts from the memory
// regions of ucx_regions.cc, and its close. ucx_transport.cc says why same-host lanes look the way
// they do.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "transport/handle.h"
#include "transport/transport.h"

namespace ferry::transport::ucx {

class Engine;
class UcxConnection;
struct RequestContext;

// The lanes of one same-host connection. Set up before any lane is opened and not changed after, so
// every lane's progress thread may read it.
struct LaneGroup {
  uint64_t stream = 0;
  std::atomic<uint64_t> next_seq{0};
  std::vector<std::weak_ptr<UcxConnection>> lanes;
};

// What a UCX request of a connection is for.
enum class RequestKind { kData, kAbort, kBye, kHello };
// Every request's completion (ucx_connection.cc).
void request_done(void* req, ucs_status_t st, void* ud);

// A sender's endpoint. Every member is touched on the progress thread only.
class UcxConnection final : public Connection, public std::enable_shared_from_this<UcxConnection> {
 public:
  // `private_engine`: the engine is this connection's own (same host: ucx_transport.cc).
  // `group`: this connection is one lane of a same-host connection (private engines only).
  UcxConnection(std::shared_ptr<Engine> engine, bool private_engine, std::shared_ptr<LaneGroup> group = nullptr)
      : engine_(std::move(engine)), private_(private_engine), group_(std::move(group)) {}

  // Connects and says hello with `credential` before anything else; completes once the endpoint is
  // wired up.
  Status open(const std::string& host, uint16_t port, std::string_view credential, Deadline deadline);

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override;

  // Bytes of the buckets this endpoint has sent. Any thread.
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  void abort() override;

  // Text UCX prints for the endpoint (its lanes and their transports); empty when not connected.
  std::string describe();

  // A clean close, in two steps, so that every lane of a connection says goodbye before any waits
  // (the receiver answers a lane's goodbye only once every lane has said it). begin_close(): a
  // goodbye, then the endpoint goes; its completion is waited for until a deadline. With buckets
  // still in flight, or after a failure, the endpoint is closed at once instead.
  std::shared_ptr<CompletionState> begin_close();
  // Then finish_close(): a private engine is torn down and its thread joined, whatever happened
  // before the deadline. Past the deadline the close goes on: the engine finishes it before it stops.
  void finish_close();

 private:
  friend void request_done(void* req, ucs_status_t st, void* ud);

  // Sends an active message with this endpoint as its reply endpoint (as every bucket does), so
  // the receiver knows the sender. Returns false if it completed (or failed) at once.
  // `payload`, when given, is copied into the request and sent instead of `data`.
  bool send_am(unsigned id, const uint8_t* data, size_t size, ucp_mem_h memh, RequestKind kind,
               std::shared_ptr<CompletionState> state, ucs_status_t* immediate, uint64_t seq = 0,
               std::string_view payload = {});

  void say_goodbye(std::shared_ptr<CompletionState> done);

  // Another host: a flushing close (forced if the goodbye failed), which completes once the
  // receiver closed its end. The same host: the endpoint stays until the receiver acknowledges the
  // goodbye (bye_acknowledged()) or drops the connection (on_error()); a close from this side could
  // overtake the buckets still waiting in the receiver's shared memory (UCX's connection manager
  // tells the receiver at once, and it drops what is left of a closed endpoint).
  void goodbye_sent(ucs_status_t sent, std::shared_ptr<CompletionState> done);

  void bye_acknowledged();

  // On the progress thread: sends a posted bucket.
  void send(const uint8_t* data, size_t size, ucp_mem_h memh, uint64_t seq, std::shared_ptr<CompletionState> state);

  // Before a close that abort() asks for: the receiver learns of it from this message, in order
  // after the buckets before it, instead of from the connection dropping. Best effort.
  void tell_aborted();

  // The connect's flush is done: the endpoint is wired up. A refusal that came meanwhile fails the
  // connection only now (fail_when_wired()).
  void flushed(ucs_status_t st);

  // fail(), for a refusal (kRefuseId: at admission, or of a bucket later) or another lane's failure.
  // A same-host endpoint still being wired up is failed once it is (flushed()): tearing its worker
  // down while the wire-up holds requests makes UCX 1.13 abort ("pending request ... should have
  // been flushed"), and a receiver that refuses keeps its end open for that long.
  void fail_when_wired(Status st);

  static void on_error(void* arg, ucp_ep_h, ucs_status_t st);

  // Fails every pending bucket and lets go of the endpoint; a lane fails its connection's other
  // lanes too (the receiver waits for each of them, and orders buckets across them).
  // - Private engine (same host): the worker is torn down first (detach()), on the next command
  //   since this may run inside a UCX callback. UCX allows neither a forced close nor freeing an
  //   endpoint under requests without peer error handling; tearing the worker down stops every
  //   request, so a bucket is reported failed only once UCX no longer reads its bytes.
  // - Another host: the pending buckets fail now and the endpoint is closed (forced if `force`;
  //   UCX cancels its requests first in that mode).
  void fail(Status st, bool force);

  // Private engine only; a command, never inside a UCX callback.
  void detach();

  std::shared_ptr<Engine> engine_;
  const bool private_;
  const std::shared_ptr<LaneGroup> group_;
  bool group_told_ = false;
  std::atomic<uint64_t> bytes_sent_{0};
  ucp_ep_h ep_ = nullptr;
  Status failure_;
  bool detached_ = false;
  bool tearing_down_ = false;
  std::set<std::shared_ptr<CompletionState>> pending_;
  std::set<RequestContext*> requests_;
  std::shared_ptr<CompletionState> flush_state_;
  bool wired_ = false;  // the connect's flush completed
  Status refusal_;      // a refusal that came before it did
  std::shared_ptr<CompletionState> closing_;  // a same-host goodbye waiting for its answer
  std::shared_ptr<UcxConnection> keepalive_;
};

}  // namespace ferry::transport::ucx
