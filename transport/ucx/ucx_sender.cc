// ucx's sending side: a connection's endpoints (one lane to another host, one lane per core to a
// receiver on this host), its posts from the memory regions of ucx_regions.cc, and the close of a
// connection's lanes. ucx_transport.cc says why same-host lanes look the way they do.
#include "transport/ucx/ucx_sender.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "transport/handle.h"
#include "transport/ucx/ucx_engine.h"
#include "transport/ucx/ucx_regions.h"

namespace ferry::transport::ucx {
namespace {


class UcxConnection;
void request_done(void* req, ucs_status_t st, void* ud);

// What a UCX request of a connection carries to its callback. Every one is listed in the
// connection's `requests_` until its callback ran: a request on a torn-down worker never calls
// back, and its context is freed by the connection instead.
struct RequestContext {
  enum class Kind { kData, kAbort, kBye, kHello };
  std::shared_ptr<UcxConnection> conn;
  std::shared_ptr<CompletionState> state;  // the bucket's (kData) or the close's (kBye)
  Kind kind;
  size_t size = 0;
  LaneHeader header;  // a lane's messages carry it; UCX reads it until the request completes
  std::string payload;  // a hello's credential, read by UCX until the request completes
};

// The lanes of one same-host connection (see the top of this file). Set up before any lane is
// opened and not changed after, so every lane's progress thread may read it.
struct LaneGroup {
  uint64_t stream = 0;
  std::atomic<uint64_t> next_seq{0};
  std::vector<std::weak_ptr<UcxConnection>> lanes;
};


// A sender's endpoint. Every member is touched on the progress thread only.
class UcxConnection final : public Connection, public std::enable_shared_from_this<UcxConnection> {
 public:
  // `private_engine`: the engine is this connection's own (same host: see the top of this file).
  // `group`: this connection is one lane of a same-host connection (private engines only).
  UcxConnection(std::shared_ptr<Engine> engine, bool private_engine, std::shared_ptr<LaneGroup> group = nullptr)
      : engine_(std::move(engine)), private_(private_engine), group_(std::move(group)) {}

  // Connects and says hello with `credential` before anything else; completes once the endpoint is
  // wired up.
  Status open(const std::string& host, uint16_t port, std::string_view credential, Deadline deadline) {
    auto self = shared_from_this();
    Status st = engine_->call(
        [self, host, port, credential = std::string(credential)](std::shared_ptr<CompletionState> done) {
          sockaddr_storage ss{};
          auto* sa = reinterpret_cast<sockaddr_in*>(&ss);
          sa->sin_family = AF_INET;
          sa->sin_port = htons(port);
          if (inet_pton(AF_INET, host.c_str(), &sa->sin_addr) != 1) {
            return done->complete(Status::invalid_argument("ucx: '" + host + "' is not an IPv4 address"));
          }
          ucp_ep_params_t ep{};
          ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_ERR_HANDLER;
          ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
          ep.sockaddr.addr = reinterpret_cast<sockaddr*>(sa);
          ep.sockaddr.addrlen = sizeof(sockaddr_in);
          ep.err_mode = self->private_ ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
          // Installed in both modes: UCX calls it when the connection to the peer drops.
          ep.err_handler.cb = &UcxConnection::on_error;
          ep.err_handler.arg = self.get();
          ucs_status_t s = ucp_ep_create(self->engine_->worker(), &ep, &self->ep_);
          if (s != UCS_OK) return done->complete(ucs_error("create endpoint", s));
          self->keepalive_ = self;  // the error handler's argument lives until the endpoint is gone
          std::weak_ptr<UcxConnection> weak = self;
          self->engine_->on_refusal(self->ep_, [weak](const std::string& why, bool acked) {
            auto c = weak.lock();
            if (!c) return;
            if (acked) return c->bye_acknowledged();
            c->fail_when_wired(Status::unavailable("ucx receiver closed the connection: " + why));
          });
          // The receiver reads nothing else from this endpoint before it admits this.
          ucs_status_t now = UCS_OK;
          if (!self->send_am(kHelloId, reinterpret_cast<const uint8_t*>(credential.data()), credential.size(), nullptr,
                             RequestContext::Kind::kHello, nullptr, &now, 0, credential) &&
              now != UCS_OK) {
            return done->complete(ucs_error("send the credential", now));
          }
          // A flush completes once the endpoint is wired up with the listener.
          ucp_request_param_t p{};
          p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
          p.cb.send = [](void* req, ucs_status_t s2, void* ud) {
            static_cast<UcxConnection*>(ud)->flushed(s2);  // keepalive_ holds it
            ucp_request_free(req);
          };
          p.user_data = self.get();
          self->flush_state_ = done;
          ucs_status_ptr_t r = ucp_ep_flush_nbx(self->ep_, &p);
          if (!UCS_PTR_IS_PTR(r)) self->flushed(UCS_PTR_STATUS(r));
        },
        deadline);
    if (!st.ok()) abort();
    return st;
  }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override;

  // Bytes of the buckets this endpoint has sent. Any thread.
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  void abort() override {
    auto self = shared_from_this();
    engine_->run([self] {
      self->tell_aborted();
      self->fail(Status::aborted("ucx connection aborted"), true);
    });
  }

  // Text UCX prints for the endpoint (its lanes and their transports); empty when not connected.
  std::string describe() {
    auto self = shared_from_this();
    auto out = std::make_shared<std::string>();
    Status st = engine_->call(
        [self, out](std::shared_ptr<CompletionState> done) {
          if (self->ep_ != nullptr) {
            char* buf = nullptr;
            size_t len = 0;
            if (FILE* f = open_memstream(&buf, &len)) {
              ucp_ep_print_info(self->ep_, f);
              fclose(f);
              out->assign(buf, len);
            }
            free(buf);
          }
          done->complete(ok_status());
        },
        Clock::now() + std::chrono::seconds(10));
    return st.ok() ? *out : std::string();
  }

  // A clean close: a goodbye, then the endpoint goes, waited for until `deadline`. With buckets
  // still in flight, or after a failure, the endpoint is closed at once instead. A private engine
  // is then torn down and its thread joined, whatever happened before the deadline.
  void close_cleanly(Deadline deadline) {
    begin_close()->wait(deadline).ignore_error();
    finish_close();
  }

  // close_cleanly() in two steps, so that every lane of a connection says goodbye before any
  // waits: the receiver answers a lane's goodbye only once every lane has said it.
  std::shared_ptr<CompletionState> begin_close() {
    auto self = shared_from_this();
    auto done = std::make_shared<CompletionState>();
    if (!engine_->run([self, done] { self->say_goodbye(done); })) {
      done->complete(Status::unavailable("ucx: the connection's engine has stopped"));
    }
    return done;
  }
  // Past the deadline the close goes on: the engine finishes it before it stops.
  void finish_close() {
    auto self = shared_from_this();
    if (private_) {
      engine_->call(
                 [self](std::shared_ptr<CompletionState> done) {
                   self->detach();
                   done->complete(ok_status());
                 },
                 Clock::now() + std::chrono::seconds(30))
          .ignore_error();
      engine_->stop();
    }
  }

 private:
  friend void request_done(void* req, ucs_status_t st, void* ud);

  // Sends an active message with this endpoint as its reply endpoint (as every bucket does), so
  // the receiver knows the sender. Returns false if it completed (or failed) at once.
  // `payload`, when given, is copied into the request and sent instead of `data`.
  bool send_am(unsigned id, const uint8_t* data, size_t size, ucp_mem_h memh, RequestContext::Kind kind,
               std::shared_ptr<CompletionState> state, ucs_status_t* immediate, uint64_t seq = 0,
               std::string_view payload = {});

  void say_goodbye(std::shared_ptr<CompletionState> done) {
    if (ep_ == nullptr || !failure_.ok() || !pending_.empty()) {
      tell_aborted();  // buckets still in flight: the receiver must not take this for a clean close
      fail(Status::aborted("ucx connection closed"), true);
      return done->complete(ok_status());
    }
    failure_ = Status::aborted("ucx connection closed");  // nothing is sent after the goodbye
    ucs_status_t now = UCS_OK;
    if (!send_am(kByeId, nullptr, 0, nullptr, RequestContext::Kind::kBye, done, &now)) goodbye_sent(now, done);
  }

  // Another host: a flushing close (forced if the goodbye failed), which completes once the
  // receiver closed its end. The same host: the endpoint stays until the receiver acknowledges the
  // goodbye (bye_acknowledged()) or drops the connection (on_error()); a close from this side could
  // overtake the buckets still waiting in the receiver's shared memory (UCX's connection manager
  // tells the receiver at once, and it drops what is left of a closed endpoint).
  void goodbye_sent(ucs_status_t sent, std::shared_ptr<CompletionState> done) {
    if (ep_ == nullptr) return done->complete(ok_status());  // the receiver's close came first
    if (private_) {
      if (sent != UCS_OK) return done->complete(ok_status());  // close_cleanly() tears down
      closing_ = std::move(done);
      return;
    }
    auto self = shared_from_this();  // the endpoint's error handler points here until it is closed
    engine_->forget_refusal(ep_);
    engine_->close_ep(std::exchange(ep_, nullptr), sent != UCS_OK,
                      [self, done](ucs_status_t) { done->complete(ok_status()); });
    keepalive_.reset();
  }

  void bye_acknowledged() {
    if (closing_) std::exchange(closing_, nullptr)->complete(ok_status());
  }

  // Before a close that abort() asks for: the receiver learns of it from this message, in order
  // after the buckets before it, instead of from the connection dropping. Best effort.
  void tell_aborted() {
    if (ep_ == nullptr || !failure_.ok()) return;
    ucs_status_t now = UCS_OK;
    (void)send_am(kAbortId, nullptr, 0, nullptr, RequestContext::Kind::kAbort, nullptr, &now);
  }

  // The connect's flush is done: the endpoint is wired up. A refusal that came meanwhile fails the
  // connection only now (fail_when_wired()).
  void flushed(ucs_status_t st) {
    wired_ = true;
    if (!refusal_.ok()) return fail(refusal_, true);
    if (flush_state_) flush_state_->complete(st == UCS_OK ? ok_status() : ucs_error("connect", st));
  }

  // fail(), for a refusal (kRefuseId: at admission, or of a bucket later) or another lane's failure.
  // A same-host endpoint still being wired up is failed once it is (flushed()): tearing its worker
  // down while the wire-up holds requests makes UCX 1.13 abort ("pending request ... should have
  // been flushed"), and a receiver that refuses keeps its end open for that long.
  void fail_when_wired(Status st) {
    if (private_ && !wired_ && failure_.ok()) {
      if (refusal_.ok()) refusal_ = std::move(st);
      return;
    }
    fail(std::move(st), true);
  }

  static void on_error(void* arg, ucp_ep_h, ucs_status_t st) {
    auto* self = static_cast<UcxConnection*>(arg);
    // The receiver dropping a same-host connection after the goodbye is how a close may end.
    if (self->closing_) std::exchange(self->closing_, nullptr)->complete(ok_status());
    self->fail(ucs_error("peer failed", st), true);
  }

  // Fails every pending bucket and lets go of the endpoint; a lane fails its connection's other
  // lanes too (the receiver waits for each of them, and orders buckets across them).
  // - Private engine (same host): the worker is torn down first (detach()), on the next command
  //   since this may run inside a UCX callback. UCX allows neither a forced close nor freeing an
  //   endpoint under requests without peer error handling; tearing the worker down stops every
  //   request, so a bucket is reported failed only once UCX no longer reads its bytes.
  // - Another host: the pending buckets fail now and the endpoint is closed (forced if `force`;
  //   UCX cancels its requests first in that mode).
  void fail(Status st, bool force) {
    if (failure_.ok()) failure_ = st;
    if (group_ && !group_told_) {
      group_told_ = true;
      for (const auto& weak : group_->lanes) {
        auto lane = weak.lock();
        if (!lane || lane.get() == this) continue;
        lane->engine_->run([lane, st] {
          lane->tell_aborted();
          lane->fail_when_wired(st);
        });
      }
    }
    if (flush_state_) flush_state_->complete(failure_);
    if (private_) {
      engine_->run([self = shared_from_this()] { self->detach(); });
      return;
    }
    for (auto& s : pending_) s->complete(failure_);
    pending_.clear();
    if (ep_ == nullptr) return;
    engine_->forget_refusal(ep_);
    // The close holds this connection: the endpoint's error handler points here until it is done.
    engine_->close_ep(std::exchange(ep_, nullptr), force, [self = shared_from_this()](ucs_status_t) {});
    keepalive_.reset();  // may drop the last reference: nothing may follow
  }

  // Private engine only; a command, never inside a UCX callback.
  void detach() {
    if (detached_) return;
    detached_ = true;
    auto self = shared_from_this();
    if (failure_.ok()) failure_ = Status::aborted("ucx connection closed");
    ep_ = nullptr;
    tearing_down_ = true;
    engine_->teardown();  // requests UCX cancels call back from in here; see request_done()
    tearing_down_ = false;
    for (RequestContext* c : std::exchange(requests_, {})) delete c;  // never called back
    for (auto& s : pending_) s->complete(failure_);
    pending_.clear();
    if (flush_state_) flush_state_->complete(failure_);
    if (closing_) std::exchange(closing_, nullptr)->complete(ok_status());
    keepalive_.reset();
  }

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

 public:
  const Engine* engine() const { return engine_.get(); }
  void send(const uint8_t* data, size_t size, ucp_mem_h memh, uint64_t seq, std::shared_ptr<CompletionState> state);
};

void request_done(void* req, ucs_status_t st, void* ud) {
  auto* c = static_cast<RequestContext*>(ud);
  UcxConnection& conn = *c->conn;
  conn.requests_.erase(c);
  ucp_request_free(req);
  // While the worker is torn down, buckets are failed only after it is gone (detach()).
  if (c->kind == RequestContext::Kind::kData && !conn.tearing_down_) {
    if (st == UCS_OK) conn.bytes_sent_.fetch_add(c->size, std::memory_order_relaxed);
    c->state->complete(st == UCS_OK          ? ok_status()
                       : st == UCS_ERR_CANCELED ? Status::aborted("ucx send cancelled")
                                                : ucs_error("send", st));
    conn.pending_.erase(c->state);
  } else if (c->kind == RequestContext::Kind::kBye && !conn.tearing_down_) {
    conn.goodbye_sent(st, c->state);
  }
  delete c;  // may drop the last reference to the connection
}

bool UcxConnection::send_am(unsigned id, const uint8_t* data, size_t size, ucp_mem_h memh, RequestContext::Kind kind,
                            std::shared_ptr<CompletionState> state, ucs_status_t* immediate, uint64_t seq,
                            std::string_view payload) {
  auto* ctx = new RequestContext{shared_from_this(), std::move(state), kind, size, LaneHeader{}, std::string(payload)};
  if (!payload.empty()) data = reinterpret_cast<const uint8_t*>(ctx->payload.data());
  const void* header = nullptr;
  size_t header_length = 0;
  if (group_) {
    ctx->header.stream = group_->stream;
    ctx->header.seq = seq;
    ctx->header.lanes = static_cast<uint32_t>(group_->lanes.size());
    header = &ctx->header;
    header_length = sizeof ctx->header;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  if (memh != nullptr && size > 0) {  // the region's registration, made once when it was registered
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  p.cb.send = &request_done;
  p.user_data = ctx;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep_, id, header, header_length, data, size, &p);
  if (UCS_PTR_IS_PTR(r)) {
    requests_.insert(ctx);
    return true;
  }
  *immediate = UCS_PTR_STATUS(r);
  delete ctx;
  return false;
}

void UcxConnection::send(const uint8_t* data, size_t size, ucp_mem_h memh, uint64_t seq,
                         std::shared_ptr<CompletionState> state) {
  if (!failure_.ok() || ep_ == nullptr) return state->complete(failure_.ok() ? Status::unavailable("ucx: not connected") : failure_);
  if (state->done()) return;  // aborted before it left
  pending_.insert(state);
  ucs_status_t now = UCS_OK;
  if (!send_am(kDataId, data, size, memh, RequestContext::Kind::kData, state, &now, seq)) {
    if (now == UCS_OK) bytes_sent_.fetch_add(size, std::memory_order_relaxed);
    state->complete(now == UCS_OK ? ok_status() : ucs_error("send", now));
    pending_.erase(state);
    // A lane's receiver waits for every sequence number: one that never leaves fails them all.
    if (now != UCS_OK && group_) fail(ucs_error("send", now), true);
  }
}

Result<std::unique_ptr<TransferHandle>> UcxConnection::post(const MemoryRegion& region, size_t offset, size_t size) {
  if (offset > region.size() || size > region.size() - offset) {
    return Status::out_of_range(fmt::format("post of {} bytes at {} exceeds a {}-byte region", size, offset, region.size()));
  }
  const uint8_t* data = static_cast<const uint8_t*>(region.data()) + offset;
  ucp_mem_h memh = nullptr;
  if (const auto* mapped = dynamic_cast<const MappedRegion*>(&region)) {
    memh = mapped->memh_for(engine_.get());
    FERRY_ASSIGN_OR_RETURN(data, mapped->post_bytes(offset, size));
  }
  auto state = std::make_shared<CompletionState>();
  auto self = shared_from_this();
  const uint64_t seq = group_ ? group_->next_seq.fetch_add(1) : 0;  // after every check that can fail
  engine_->run([self, data, size, memh, seq, state] { self->send(data, size, memh, seq, state); });
  std::weak_ptr<UcxConnection> weak = self;
  return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(state, [weak] {
    if (auto c = weak.lock()) c->abort();
  }));
}


// Closes every lane of a connection: all say goodbye, then each waits for its answer (until
// `deadline`), then each private engine is torn down.
void close_lanes(const std::vector<std::shared_ptr<UcxConnection>>& lanes, Deadline deadline) {
  std::vector<std::shared_ptr<CompletionState>> closing;
  for (const auto& lane : lanes) closing.push_back(lane->begin_close());
  for (const auto& done : closing) done->wait(deadline).ignore_error();
  for (const auto& lane : lanes) lane->finish_close();
}

// The caller's handle: closing it says goodbye and closes the endpoints. Buckets go to the lanes in
// turn (one lane unless the receiver is on this host).
class OwnedUcxConnection final : public Connection {
 public:
  explicit OwnedUcxConnection(std::vector<std::shared_ptr<UcxConnection>> lanes) : lanes_(std::move(lanes)) {}
  ~OwnedUcxConnection() override { close_lanes(lanes_, Clock::now() + std::chrono::seconds(10)); }
  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& r, size_t o, size_t s) override {
    return lanes_[next_lane_.fetch_add(1, std::memory_order_relaxed) % lanes_.size()]->post(r, o, s);
  }
  void abort() override {
    for (const auto& lane : lanes_) lane->abort();
  }
  std::string describe() { return lanes_.front()->describe(); }
  std::vector<uint64_t> lane_bytes() const {
    std::vector<uint64_t> out;
    for (const auto& lane : lanes_) out.push_back(lane->bytes_sent());
    return out;
  }

 private:
  std::vector<std::shared_ptr<UcxConnection>> lanes_;
  std::atomic<uint64_t> next_lane_{0};
};

}  // namespace

uint32_t same_host_lanes() {
  return std::clamp<uint32_t>(std::thread::hardware_concurrency(), 1, kMaxSameHostLanes);
}

Result<std::unique_ptr<Connection>> connect_sender(const std::shared_ptr<Engine>& shared, const std::string& host,
                                                   uint16_t port, const std::vector<uint16_t>& local_ports,
                                                   bool same_host, std::string_view credential, Deadline deadline) {
  std::vector<std::shared_ptr<UcxConnection>> lanes;
  if (same_host) {  // lanes, each on a worker of its own, torn down to stop its requests (ucx_transport.cc)
    static std::atomic<uint32_t> streams{0};
    auto group = std::make_shared<LaneGroup>();
    group->stream = (static_cast<uint64_t>(getpid()) << 32) | (streams.fetch_add(1) + 1);
    const uint32_t n = local_ports.size() >= 2 ? std::min<uint32_t>(same_host_lanes(), local_ports.size()) : 1;
    for (uint32_t i = 0; i < n; ++i) {
      auto engine = std::make_shared<Engine>();
      FERRY_RETURN_IF_ERROR(engine->init(shared->listen_host(), /*indirect_ids=*/false));
      lanes.push_back(std::make_shared<UcxConnection>(std::move(engine), true, group));
      group->lanes.push_back(lanes.back());
    }
  } else {
    lanes.push_back(std::make_shared<UcxConnection>(shared, false));
  }
  Status st;
  for (size_t i = 0; i < lanes.size(); ++i) {
    const uint16_t to = same_host && local_ports.size() >= 2 ? local_ports[i] : port;
    st = lanes[i]->open(host, to, credential, deadline);
    if (!st.ok()) break;
  }
  if (!st.ok() && same_host) close_lanes(lanes, Clock::now());
  FERRY_RETURN_IF_ERROR(st);
  return std::unique_ptr<Connection>(std::make_unique<OwnedUcxConnection>(std::move(lanes)));
}

std::string describe_connection(Connection& c) {
  auto* owned = dynamic_cast<OwnedUcxConnection*>(&c);
  return owned != nullptr ? owned->describe() : std::string();
}

std::vector<uint64_t> lane_bytes(Connection& c) {
  auto* owned = dynamic_cast<OwnedUcxConnection*>(&c);
  return owned != nullptr ? owned->lane_bytes() : std::vector<uint64_t>();
}

}  // namespace ferry::transport::ucx
