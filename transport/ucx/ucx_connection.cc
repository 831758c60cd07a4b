#include "transport/ucx/ucx_connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "transport/ucx/ucx_engine.h"
#include "transport/ucx/ucx_regions.h"

namespace ferry::transport::ucx {

// What a UCX request of a connection carries to its callback. Every one is listed in the
// connection's `requests_` until its callback ran: a request on a torn-down worker never calls
// back, and its context is freed by the connection instead.
struct RequestContext {
  std::shared_ptr<UcxConnection> conn;
  std::shared_ptr<CompletionState> state;  // the bucket's (kData) or the close's (kBye)
  RequestKind kind;
  size_t size = 0;
  LaneHeader header;  // a lane's messages carry it; UCX reads it until the request completes
  std::string payload;  // a hello's credential, read by UCX until the request completes
};

Status UcxConnection::open(const std::string& host, uint16_t port, std::string_view credential, Deadline deadline) {
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
                           RequestKind::kHello, nullptr, &now, 0, credential) &&
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

void UcxConnection::abort() {
  auto self = shared_from_this();
  engine_->run([self] {
    self->tell_aborted();
    self->fail(Status::aborted("ucx connection aborted"), true);
  });
}

std::string UcxConnection::describe() {
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

std::shared_ptr<CompletionState> UcxConnection::begin_close() {
  auto self = shared_from_this();
  auto done = std::make_shared<CompletionState>();
  if (!engine_->run([self, done] { self->say_goodbye(done); })) {
    done->complete(Status::unavailable("ucx: the connection's engine has stopped"));
  }
  return done;
}

void UcxConnection::finish_close() {
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

void UcxConnection::say_goodbye(std::shared_ptr<CompletionState> done) {
  if (ep_ == nullptr || !failure_.ok() || !pending_.empty()) {
    tell_aborted();  // buckets still in flight: the receiver must not take this for a clean close
    fail(Status::aborted("ucx connection closed"), true);
    return done->complete(ok_status());
  }
  failure_ = Status::aborted("ucx connection closed");  // nothing is sent after the goodbye
  ucs_status_t now = UCS_OK;
  if (!send_am(kByeId, nullptr, 0, nullptr, RequestKind::kBye, done, &now)) goodbye_sent(now, done);
}

void UcxConnection::goodbye_sent(ucs_status_t sent, std::shared_ptr<CompletionState> done) {
  if (ep_ == nullptr) return done->complete(ok_status());  // the receiver's close came first
  if (private_) {
    if (sent != UCS_OK) return done->complete(ok_status());  // finish_close() tears down
    closing_ = std::move(done);
    return;
  }
  auto self = shared_from_this();  // the endpoint's error handler points here until it is closed
  engine_->forget_refusal(ep_);
  engine_->close_ep(std::exchange(ep_, nullptr), sent != UCS_OK,
                    [self, done](ucs_status_t) { done->complete(ok_status()); });
  keepalive_.reset();
}

void UcxConnection::bye_acknowledged() {
  if (closing_) std::exchange(closing_, nullptr)->complete(ok_status());
}

void UcxConnection::tell_aborted() {
  if (ep_ == nullptr || !failure_.ok()) return;
  ucs_status_t now = UCS_OK;
  (void)send_am(kAbortId, nullptr, 0, nullptr, RequestKind::kAbort, nullptr, &now);
}

void UcxConnection::flushed(ucs_status_t st) {
  wired_ = true;
  if (!refusal_.ok()) return fail(refusal_, true);
  if (flush_state_) flush_state_->complete(st == UCS_OK ? ok_status() : ucs_error("connect", st));
}

void UcxConnection::fail_when_wired(Status st) {
  if (private_ && !wired_ && failure_.ok()) {
    if (refusal_.ok()) refusal_ = std::move(st);
    return;
  }
  fail(std::move(st), true);
}

void UcxConnection::on_error(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* self = static_cast<UcxConnection*>(arg);
  // The receiver dropping a same-host connection after the goodbye is how a close may end.
  if (self->closing_) std::exchange(self->closing_, nullptr)->complete(ok_status());
  self->fail(ucs_error("peer failed", st), true);
}

void UcxConnection::fail(Status st, bool force) {
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

void UcxConnection::detach() {
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

void request_done(void* req, ucs_status_t st, void* ud) {
  auto* c = static_cast<RequestContext*>(ud);
  UcxConnection& conn = *c->conn;
  conn.requests_.erase(c);
  ucp_request_free(req);
  // While the worker is torn down, buckets are failed only after it is gone (detach()).
  if (c->kind == RequestKind::kData && !conn.tearing_down_) {
    if (st == UCS_OK) conn.bytes_sent_.fetch_add(c->size, std::memory_order_relaxed);
    c->state->complete(st == UCS_OK          ? ok_status()
                       : st == UCS_ERR_CANCELED ? Status::aborted("ucx send cancelled")
                                                : ucs_error("send", st));
    conn.pending_.erase(c->state);
  } else if (c->kind == RequestKind::kBye && !conn.tearing_down_) {
    conn.goodbye_sent(st, c->state);
  }
  delete c;  // may drop the last reference to the connection
}

bool UcxConnection::send_am(unsigned id, const uint8_t* data, size_t size, ucp_mem_h memh, RequestKind kind,
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
  if (!send_am(kDataId, data, size, memh, RequestKind::kData, state, &now, seq)) {
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

}  // namespace ferry::transport::ucx
