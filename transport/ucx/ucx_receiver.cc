#include "transport/ucx/ucx_receiver.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <mutex>
#include <vector>

#include "core/log.h"
#include "transport/admission.h"
#include "transport/ucx/ucx_buffer_pool.h"
#include "transport/ucx/ucx_stream.h"

namespace ferry::transport::ucx {

std::shared_ptr<StreamTable> make_stream_table() {
  auto t = std::make_shared<StreamTable>();
  t->pool = std::make_shared<BufferPool>(nullptr);
  return t;
}

// Every member but `table_`'s contents is touched on the progress thread only.
class Receiver : public std::enable_shared_from_this<Receiver> {
 public:
  Receiver(std::shared_ptr<Engine> e, uint64_t max_bucket, BucketCallback b, PeerClosedCallback c, AdmitCallback a,
           std::shared_ptr<StreamTable> table)
      : engine_(std::move(e)), pool_(table ? table->pool : std::make_shared<BufferPool>(engine_)),
        max_bucket_(max_bucket), on_bucket_(std::move(b)), on_closed_(std::move(c)), admit_(std::move(a)),
        table_(table ? std::move(table) : std::make_shared<StreamTable>()) {}

  void start(const std::string& host, std::shared_ptr<CompletionState> done, Listening* out) {
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.id = kDataId;
    h.cb = &Receiver::on_data;
    h.arg = this;
    ucs_status_t st = ucp_worker_set_am_recv_handler(engine_->worker(), &h);
    h.id = kByeId;
    h.cb = &Receiver::on_bye;
    if (st == UCS_OK) st = ucp_worker_set_am_recv_handler(engine_->worker(), &h);
    h.id = kAbortId;
    h.cb = &Receiver::on_abort;
    if (st == UCS_OK) st = ucp_worker_set_am_recv_handler(engine_->worker(), &h);
    h.id = kHelloId;
    h.cb = &Receiver::on_hello;
    if (st == UCS_OK) st = ucp_worker_set_am_recv_handler(engine_->worker(), &h);
    if (st != UCS_OK) return done->complete(ucs_error("set handler", st));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
      return done->complete(Status::invalid_argument("ucx: FERRY_LISTEN_HOST '" + host + "' is not an IPv4 address"));
    }
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = sizeof sa;
    lp.conn_handler.cb = &Receiver::on_connect;
    lp.conn_handler.arg = this;
    st = ucp_listener_create(engine_->worker(), &lp, &listener_);
    if (st != UCS_OK) return done->complete(ucs_error("listen on " + host, st));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    st = ucp_listener_query(listener_, &attr);
    if (st != UCS_OK) return done->complete(ucs_error("query listener", st));
    const auto* bound = reinterpret_cast<const sockaddr_in*>(&attr.sockaddr);
    // The boot id tells a sender whether it is on this host (ucx_transport.cc).
    out->port = ntohs(bound->sin_port);
    out->blob = fmt::format("ucx://{}:{}", host, out->port);
    if (!host_identity().empty()) out->blob += "/" + host_identity();
    self_ = shared_from_this();
    done->complete(ok_status());
  }

  std::shared_ptr<Engine> engine() const { return engine_; }

  void stop() {
    std::vector<ucp_ep_h> eps;
    {
      TableLock lock(*table_);
      for (auto& [ep, in] : inbound_) {
        in->closed = true;
        forget(*in, ep);
        eps.push_back(ep);
      }
      inbound_.clear();
    }
    if (listener_) ucp_listener_destroy(std::exchange(listener_, nullptr));
    for (ucp_ep_h ep : eps) engine_->close_ep(ep, true);
    for (auto& [ep, a] : unadmitted_) engine_->close_ep(ep, true);
    unadmitted_.clear();
    // The handlers point at this receiver, which may go once stopped.
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
    h.cb = nullptr;
    for (unsigned id : {kDataId, kByeId, kAbortId, kHelloId}) {
      h.id = id;
      (void)ucp_worker_set_am_recv_handler(engine_->worker(), &h);
    }
    self_.reset();
  }

 private:
  // The accepted endpoint takes the sender's error handling mode (UCX carries it in the connection
  // request and refuses a different one): peer error handling from another host, none from this
  // one (ucx_transport.cc says why). The error handler is installed in both: UCX calls it when the
  // connection to the sender drops. The endpoint is not admitted yet: until its hello's credential
  // is (on_hello), anything else it sends closes it, and without a hello within kAdmissionDeadline
  // it is closed.
  static void on_connect(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Receiver*>(arg);
    std::string who = "an unknown address";
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(req, &attr) == UCS_OK && attr.client_address.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&attr.client_address);
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      who = fmt::format("{}:{}", text, ntohs(a->sin_port));
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = req;
    p.err_handler.cb = &Receiver::on_ep_error;
    p.err_handler.arg = self;
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(self->engine_->worker(), &p, &ep) != UCS_OK) {
      (void)ucp_listener_reject(self->listener_, req);
      return;
    }
    const uint64_t ticket = ++self->admission_tickets_;
    self->unadmitted_[ep] = Unadmitted{ticket, who, false};
    self->engine_->at(Clock::now() + kAdmissionDeadline, [weak = self->weak_from_this(), ep, ticket] {
      auto r = weak.lock();
      if (!r) return;
      auto it = r->unadmitted_.find(ep);
      if (it == r->unadmitted_.end() || it->second.ticket != ticket) return;  // admitted, closed, or another endpoint
      r->refuse_unadmitted(ep, fmt::format("no credential within {} ms", kAdmissionDeadline.count()));
    });
  }

  // An endpoint's credential: admitted, it becomes a stream of its own (lanes join theirs with
  // their first message); refused, the sender is told why and the endpoint is closed when the
  // sender closes its end or at the admission deadline, whichever comes first (a same-host sender
  // may still be wiring its endpoint up, and UCX 1.13 aborts a worker torn down in the middle of
  // that: ucx_sender.cc's refused()). Only the first kMaxCredentialBytes would be read, and a hello
  // too large to come eagerly is refused unread.
  static ucs_status_t on_hello(void* arg, const void*, size_t, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    const ucp_ep_h ep = param->reply_ep;
    auto it = self->unadmitted_.find(ep);
    if (it == self->unadmitted_.end() || it->second.refused) return UCS_OK;  // admitted already, or refused
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length > kMaxCredentialBytes) {
      self->refuse_unadmitted(ep, fmt::format("a {}-byte credential", length));
      return UCS_OK;
    }
    const std::string who = it->second.who;
    auto id = admit_peer(self->admit_, std::string_view(static_cast<const char*>(data), length), "ucx", who);
    if (!id.ok()) {  // admit_peer() logged why
      it->second.refused = true;
      self->notify(ep, kRefuseId, id.status().message());
      return UCS_OK;
    }
    self->unadmitted_.erase(it);
    auto in = std::make_shared<Inbound>();
    in->eps.push_back(ep);
    in->owners[ep] = self->weak_from_this();
    in->peer = *id;
    self->inbound_[ep] = in;
    return UCS_OK;
  }

  // Closes an endpoint that was never admitted, logging why.
  void refuse_unadmitted(ucp_ep_h ep, const std::string& why) {
    auto it = unadmitted_.find(ep);
    if (it == unadmitted_.end()) return;
    if (!it->second.refused) log_unadmitted("ucx", it->second.who, why);
    refuse(ep);
  }

  // Closes an endpoint that was never admitted (a stranger's: it is not told why).
  void refuse(ucp_ep_h ep) {
    unadmitted_.erase(ep);
    close_endpoint(ep);
  }

  // Closes an endpoint of ours (forced where UCX allows it), once no table lock is held.
  void close_endpoint(ucp_ep_h ep) {
    TableLock::later([self = shared_from_this(), ep] { self->engine_->close_ep(ep, true); });
  }

  // True when a message other than a hello comes from an endpoint not admitted: nothing of it is
  // read, and the endpoint is closed (left to its deadline if it was refused already).
  bool from_unadmitted(const ucp_am_recv_param_t* param) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return false;
    auto it = unadmitted_.find(param->reply_ep);
    if (it == unadmitted_.end()) return false;
    if (!it->second.refused) refuse_unadmitted(param->reply_ep, "sent before presenting a credential");
    return true;
  }

  // Handled once the worker is drained: on one host the buckets and the goodbye come through shared
  // memory and the connection's close through UCX's connection manager, which can overtake them.
  // Whatever the sender sent before it closed has arrived by then, so a clean close stays clean.
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->unadmitted_.erase(ep) != 0) {  // never admitted: nothing to report
      self->engine_->after_drain([r = self->shared_from_this(), ep] { r->engine_->close_ep(ep, true); });
      return;
    }
    auto it = self->inbound_.find(ep);
    if (it == self->inbound_.end()) return;
    std::weak_ptr<Inbound> weak = it->second;
    self->engine_->after_drain([r = self->shared_from_this(), weak, ep, st] {
      TableLock lock(*r->table_);
      auto in = weak.lock();
      auto found = r->inbound_.find(ep);
      if (!in || found == r->inbound_.end() || found->second != in) return;  // closed meanwhile, or stopped
      // A sender that said goodbye was closed here when the goodbye arrived with nothing still
      // arriving; one still open here failed before its last buckets came in (or, if it was
      // reported already, is the aborted or refused sender closing its end).
      r->close(*in, ucs_error(in->bye ? "sender endpoint failed with buckets still arriving" : "sender endpoint failed", st),
               EpClose::kNow, ep);
    });
  }

  // The sender aborted: what it still had on the way is dropped, and the close is reported as such.
  static ucs_status_t on_abort(void* arg, const void* header, size_t header_length, void*, size_t,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->from_unadmitted(param)) return UCS_OK;
    TableLock lock(*self->table_);
    auto in = self->find(param, header, header_length);
    if (in && !in->closed) self->close(*in, Status::aborted("ucx sender aborted the connection"), EpClose::kAfterSender, nullptr);
    return UCS_OK;
  }

  // How an inbound endpoint is closed once the sender's stream ends.
  enum class EpClose {
    kNow,          // nothing of ours or the sender's is left on it: a goodbye, or the sender is gone
    kAfterSender,  // the sender closes its end first (it aborted, and its last rendezvous may
                   // still be answered here); its close then fails this endpoint: on_ep_error
    kRefuse,       // the sender is told why (kRefuseId) and closes its end first, as above
  };

  // Reports the stream's end once (`why`) and drops what is still queued from it. An endpoint is
  // closed at once only when nothing can still be under way on it: without peer error handling
  // (same host) UCX 1.13 allows neither a forced close nor freeing an endpoint with requests on
  // it, so otherwise the sender's close comes first. kNow closes `ep` (the one that failed), or
  // after every lane's goodbye all of the stream's endpoints; a refusal goes to every lane.
  // The caller holds table_->mu. A lane accepted by another receiver is told, or closed, on that
  // receiver's progress thread.
  void close(Inbound& in, Status why, EpClose how, ucp_ep_h ep) {
    if (!in.closed) {
      in.closed = true;
      // The buckets' buffers go back to their pool (maybe unmapped: a UCX call) after the lock.
      auto dropped = std::make_shared<decltype(in.queue)>(std::move(in.queue));
      in.queue.clear();
      TableLock::later([dropped] {});
      if (how == EpClose::kRefuse) {
        const std::string text = why.to_string();
        for (ucp_ep_h e : in.eps) {
          on_owner(in, e, [text](Receiver& r, ucp_ep_h x) {
            if (r.inbound_.count(x) != 0) r.notify(x, kRefuseId, text);
          });
        }
      }
      if (on_closed_) on_closed_(why);
    }
    if (how != EpClose::kNow) return;
    std::vector<ucp_ep_h> eps;
    const bool ack = in.bye && why.ok();
    if (ack) {
      eps = in.eps;
    } else if (ep != nullptr) {
      eps.push_back(ep);
    }
    for (ucp_ep_h e : eps) {
      on_owner(in, e, [ack](Receiver& r, ucp_ep_h x) { r.release(x, ack); });
    }
  }

  // Runs `fn` with the receiver that accepted `e`: here, or queued to its progress thread (which
  // then holds the table's lock). Nothing if that receiver is gone.
  void on_owner(Inbound& in, ucp_ep_h e, std::function<void(Receiver&, ucp_ep_h)> fn) {
    auto found = in.owners.find(e);
    std::shared_ptr<Receiver> owner = found == in.owners.end() ? nullptr : found->second.lock();
    if (!owner) return;
    if (owner.get() == this) return fn(*this, e);
    owner->engine_->run([owner, e, fn = std::move(fn)] {
      TableLock lock(*owner->table_);
      fn(*owner, e);
    });
  }

  // Closes an endpoint of ours once its stream has ended (`ack`: after every lane's goodbye).
  void release(ucp_ep_h e, bool ack) {
    auto it = inbound_.find(e);
    if (it == inbound_.end()) return;
    auto in = it->second;  // outlives the erasure
    inbound_.erase(it);
    // A same-host sender keeps its endpoint until it hears that its goodbye was handled (see
    // ucx_transport.cc); the flushing close below sends this first.
    if (ack) notify(e, kByeAckId, std::string());
    forget(*in, e);
    close_endpoint(e);
  }

  // Takes `e` out of its stream; the stream's id goes with its last endpoint.
  void forget(Inbound& in, ucp_ep_h e) {
    in.eps.erase(std::remove(in.eps.begin(), in.eps.end(), e), in.eps.end());
    in.owners.erase(e);
    if (in.eps.empty() && in.stream != 0) {
      auto found = table_->streams.find(in.stream);
      if (found != table_->streams.end() && found->second.get() == &in) table_->streams.erase(found);
    }
  }

  // A message to the sender at the other end of `ep` (kRefuseId with the reason, kByeAckId).
  // Sent once no table lock is held.
  void notify(ucp_ep_h ep, unsigned id, std::string why) {
    TableLock::later([self = shared_from_this(), ep, id, why = std::move(why)] { self->send_notice(ep, id, why); });
  }
  void send_notice(ucp_ep_h ep, unsigned id, std::string why) {
    auto* text = new std::string(std::move(why));
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // the sender finds its endpoint by it
    p.cb.send = [](void* req, ucs_status_t, void* ud) {
      delete static_cast<std::string*>(ud);
      ucp_request_free(req);
    };
    p.user_data = text;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, nullptr, 0, text->data(), text->size(), &p);
    if (!UCS_PTR_IS_PTR(r)) delete text;
  }

  // The stream a message's endpoint belongs to. A lane's first message joins its endpoint to the
  // stream its header names (every message on a lane carries it, so the first is the first).
  std::shared_ptr<Inbound> find(const ucp_am_recv_param_t* param, const void* header, size_t header_length) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
    const ucp_ep_h ep = param->reply_ep;
    auto it = inbound_.find(ep);
    if (it == inbound_.end()) return nullptr;
    if (header_length != sizeof(LaneHeader) || it->second->stream != 0) return it->second;
    LaneHeader h;
    std::memcpy(&h, header, sizeof h);
    if (h.stream == 0) return it->second;
    auto joined = table_->streams.find(h.stream);
    if (joined == table_->streams.end()) {
      it->second->stream = h.stream;
      it->second->lanes = std::max<uint32_t>(h.lanes, 1);
      table_->streams[h.stream] = it->second;
      return it->second;
    }
    // Another lane of a stream seen before (here or at another receiver that shares the table);
    // its own record has had no message yet. A lane joins only a stream of the peer it was
    // admitted as: no admitted sender can slip buckets into another's stream.
    auto in = joined->second;
    if (in->peer != it->second->peer) {
      FERRY_LOG_WARN("ucx: closed a lane of peer {} that named a stream of peer {}", it->second->peer, in->peer);
      inbound_.erase(it);
      refuse(ep);
      return nullptr;
    }
    in->eps.push_back(ep);
    in->owners[ep] = weak_from_this();
    it->second = in;
    return in;
  }

  static ucs_status_t on_bye(void* arg, const void* header, size_t header_length, void*, size_t,
                             const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->from_unadmitted(param)) return UCS_OK;
    TableLock lock(*self->table_);
    auto in = self->find(param, header, header_length);
    if (!in || in->closed) return UCS_OK;
    in->byes.insert(param->reply_ep);
    in->bye = in->byes.size() >= in->lanes;
    // Every bucket of a lane came before its goodbye; rendezvous ones still arriving close it in
    // arrived().
    if (in->bye && in->queue.empty()) self->close(*in, ok_status(), EpClose::kNow, nullptr);
    return UCS_OK;
  }

  static ucs_status_t on_data(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->from_unadmitted(param)) return UCS_OK;
    std::shared_ptr<Inbound> in;
    auto pending = std::make_shared<Inbound::Pending>();
    {
      TableLock lock(*self->table_);
      in = self->find(param, header, header_length);
      if (!in || !self->take(in, header, header_length, data, length, param, pending)) return UCS_OK;
    }
    // A rendezvous bucket, its place in the stream taken: its buffer and its receive, with no table
    // lock held (TableLock says why).
    self->receive(in, pending, data, length);
    return UCS_OK;
  }

  // Under the table's lock: takes an arriving bucket into its stream. Delivers one that is next and
  // complete (eager) at once; queues one behind others; returns true for a rendezvous bucket whose
  // place in the stream is taken and whose data the caller receives into `pending` (receive()).
  bool take(const std::shared_ptr<Inbound>& in, const void* header, size_t header_length, void* data, size_t length,
            const ucp_am_recv_param_t* param, const std::shared_ptr<Inbound::Pending>& pending) {
    Receiver* self = this;
    if (in->closed) return false;
    if (length > self->max_bucket_) {
      self->close(*in, Status::resource_exhausted(fmt::format("ucx: a {}-byte bucket; the limit is {}", length,
                                                              self->max_bucket_)),
                  EpClose::kRefuse, nullptr);
      return false;
    }
    uint64_t seq = 0;
    if (in->stream != 0 && header_length == sizeof(LaneHeader)) {
      LaneHeader h;
      std::memcpy(&h, header, sizeof h);
      seq = h.seq;
    } else {
      seq = in->next_seq++;
    }
    if (seq < in->next_deliver || in->queue.count(seq) != 0) {
      self->close(*in, Status::data_loss(fmt::format("ucx: bucket {} arrived twice", seq)), EpClose::kRefuse, nullptr);
      return false;
    }
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!rndv && in->queue.empty() && seq == in->next_deliver) {
      // In place, from UCX's own receive buffer, with no owner (bucket_owner() stays null): that
      // buffer is UCX's and valid only during this handler (keeping it would mean returning
      // UCS_INPROGRESS and a ucp_am_data_release() on the progress thread later, which a holder
      // dropping it on any thread cannot do). Eager buckets are those under UCX's rendezvous
      // threshold, the small ones; a receiver that wants them past the callback copies them.
      ++in->next_deliver;
      self->deliver(*in, static_cast<const uint8_t*>(data), length, nullptr);
      return false;
    }
    pending->size = length;
    if (!rndv) {
      pending->copy.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
      in->queue[seq] = pending;
      self->arrived(in, pending, UCS_OK);
      return false;
    }
    in->queue[seq] = pending;  // not ready: nothing reads it but its receive until it is
    return true;
  }

  // No table lock held: a buffer (mapping one is a UCX call), then the receive.
  void receive(const std::shared_ptr<Inbound>& in, const std::shared_ptr<Inbound::Pending>& pending, void* data,
               size_t length) {
    Receiver* self = this;
    pending->pool = self->pool_;
    pending->block = self->pool_->take(std::max<size_t>(length, 1));
    if (!pending->block) {
      TableLock lock(*self->table_);
      self->close(*in, Status::resource_exhausted(fmt::format("ucx: no memory for a {}-byte bucket", length)),
                  EpClose::kRefuse, nullptr);
      return;
    }
    struct Ctx {
      Receiver* self;
      std::shared_ptr<Inbound> in;
      std::shared_ptr<Inbound::Pending> pending;
    };
    auto* ctx = new Ctx{self, in, pending};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (pending->block->memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = pending->block->memh;
    }
    p.cb.recv_am = [](void* req, ucs_status_t st, size_t, void* ud) {
      auto* c = static_cast<Ctx*>(ud);
      {
        TableLock lock(*c->self->table_);
        c->self->arrived(c->in, c->pending, st);
      }
      delete c;
      ucp_request_free(req);
    };
    p.user_data = ctx;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->engine_->worker(), data, pending->block->buffer.data(), length, &p);
    if (!UCS_PTR_IS_PTR(r)) {
      {
        TableLock lock(*self->table_);
        self->arrived(in, pending, UCS_PTR_STATUS(r));
      }
      delete ctx;
    }
  }

  // Delivers the buckets that are next in sequence and have all arrived.
  void arrived(const std::shared_ptr<Inbound>& in, const std::shared_ptr<Inbound::Pending>& p, ucs_status_t st) {
    if (in->closed) return;
    if (st != UCS_OK) return close(*in, ucs_error("receive", st), EpClose::kRefuse, nullptr);
    p->ready = true;
    while (!in->closed && !in->queue.empty() && in->queue.begin()->first == in->next_deliver &&
           in->queue.begin()->second->ready) {
      auto front = in->queue.begin()->second;
      in->queue.erase(in->queue.begin());
      ++in->next_deliver;
      deliver(*in, front->data(), front->size, front);  // handed over: `front` owns the bytes
      TableLock::later([front] {});  // its buffer, unless the callback kept it, goes back after the lock
    }
    if (!in->closed && in->bye && in->queue.empty()) close(*in, ok_status(), EpClose::kNow, nullptr);
  }

  // `owner` (null for bytes that are not ours to give) is the callback's bucket_owner().
  void deliver(Inbound& in, const uint8_t* data, size_t size, std::shared_ptr<const void> owner) {
    Status st;
    {
      BucketOwnerScope handed_over(std::move(owner));
      st = on_bucket_(ReceivedBucket{data, size, in.peer});
    }
    if (!st.ok()) close(in, st, EpClose::kRefuse, nullptr);
  }

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<BufferPool> pool_;
  uint64_t max_bucket_;
  BucketCallback on_bucket_;
  PeerClosedCallback on_closed_;
  AdmitCallback admit_;
  ucp_listener_h listener_ = nullptr;
  // Accepted endpoints that have not presented an admitted credential yet. A ticket tells a later
  // endpoint at the same address from the one an admission deadline was set for.
  struct Unadmitted {
    uint64_t ticket = 0;
    std::string who;       // the sender's address, for the log
    bool refused = false;  // its credential was refused: closed when the sender closes, or at the deadline
  };
  std::map<ucp_ep_h, Unadmitted> unadmitted_;
  uint64_t admission_tickets_ = 0;
  std::map<ucp_ep_h, std::shared_ptr<Inbound>> inbound_;  // every admitted endpoint's stream
  const std::shared_ptr<StreamTable> table_;  // lanes' streams, by their id; maybe shared
  std::shared_ptr<Receiver> self_;  // alive while UCX may call us
};

Result<std::shared_ptr<Receiver>> start_receiver(std::shared_ptr<Engine> engine, const std::string& host,
                                                 uint64_t max_bucket, BucketCallback on_bucket,
                                                 PeerClosedCallback on_closed, AdmitCallback admit, Listening* where,
                                                 std::shared_ptr<StreamTable> table) {
  auto r = std::make_shared<Receiver>(engine, max_bucket, std::move(on_bucket), std::move(on_closed), std::move(admit),
                                      std::move(table));
  auto out = std::make_shared<Listening>();
  FERRY_RETURN_IF_ERROR(engine->call([r, host, out](std::shared_ptr<CompletionState> done) { r->start(host, done, out.get()); },
                                     Clock::now() + std::chrono::seconds(30)));
  *where = *out;
  return r;
}

void stop_receiver(const std::shared_ptr<Receiver>& r) {
  auto engine = r->engine();
  engine->call([r](std::shared_ptr<CompletionState> done) {
    r->stop();
    done->complete(ok_status());
  }, Clock::now() + std::chrono::seconds(30)).ignore_error();
}

}  // namespace ferry::transport::ucx
