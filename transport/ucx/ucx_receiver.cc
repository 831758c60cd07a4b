#include "transport/ucx/ucx_receiver.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "core/log.h"
#include "transport/admission.h"
#include "transport/ucx/ucx_admission.h"
#include "transport/ucx/ucx_buffer_pool.h"
#include "transport/ucx/ucx_stream.h"

namespace ferry::transport::ucx {

// Every member but `table_`'s contents is touched on the progress thread only.
class Receiver : public std::enable_shared_from_this<Receiver> {
 public:
  Receiver(std::shared_ptr<Engine> e, uint64_t default_max_bucket, BucketCallback b, PeerClosedCallback c,
           AdmitCallback a, std::shared_ptr<StreamTable> table)
      : engine_(std::move(e)), pool_(table ? table->pool : std::make_shared<BufferPool>(engine_)),
        gate_(std::make_shared<Gate>(engine_, std::move(a), default_max_bucket)), on_bucket_(std::move(b)),
        on_closed_(std::move(c)), table_(table ? std::move(table) : std::make_shared<StreamTable>()) {}

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
        table_->forget(*in, ep);
        eps.push_back(ep);
      }
      inbound_.clear();
    }
    if (listener_) ucp_listener_destroy(std::exchange(listener_, nullptr));
    for (ucp_ep_h ep : eps) engine_->close_ep(ep, true);
    gate_->close_all();
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
  // connection to the sender drops. The endpoint waits at the gate (ucx_admission.h) until its
  // hello's credential is admitted (on_hello).
  static void on_connect(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Receiver*>(arg);
    std::string who = client_address(req);
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
    self->gate_->add(ep, std::move(who));
  }

  // An endpoint's credential: admitted, it becomes a stream with the bucket limit its admission
  // set, or a lane of the stream its LaneHeader names (every message on a lane carries it, and the
  // hello comes first): a stream knows all of its lanes before any bucket, so a refusal reaches every
  // lane and the stream ends once.
  static ucs_status_t on_hello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    const ucp_ep_h ep = param->reply_ep;
    auto granted = self->gate_->hello(ep, data, length, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0);
    if (!granted) return UCS_OK;
    auto in = std::make_shared<Inbound>();
    in->eps.push_back(ep);
    in->owners[ep] = self->weak_from_this();
    in->peer = granted->peer;
    in->max_bucket = granted->max_bucket_bytes;
    TableLock lock(*self->table_);
    if (header_length == sizeof(LaneHeader)) {
      LaneHeader h;
      std::memcpy(&h, header, sizeof h);
      if (!self->table_->join(in, h, ep, self->weak_from_this())) {
        self->close_endpoint(ep);
        return UCS_OK;
      }
    }
    self->inbound_[ep] = in;
    return UCS_OK;
  }

  // Closes an endpoint of ours (forced where UCX allows it), once no table lock is held.
  void close_endpoint(ucp_ep_h ep) {
    TableLock::later([self = shared_from_this(), ep] { self->engine_->close_ep(ep, true); });
  }

  // True when a message other than a hello comes from an endpoint not admitted: nothing of it is
  // read.
  bool from_unadmitted(const ucp_am_recv_param_t* param) {
    return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && gate_->holds(param->reply_ep);
  }

  // Handled once the worker is drained: on one host the buckets and the goodbye come through shared
  // memory and the connection's close through UCX's connection manager, which can overtake them.
  // Whatever the sender sent before it closed has arrived by then, so a clean close stays clean.
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->gate_->failed(ep)) return;  // never admitted: nothing to report
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
  static ucs_status_t on_abort(void* arg, const void*, size_t, void*, size_t,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->from_unadmitted(param)) return UCS_OK;
    TableLock lock(*self->table_);
    auto in = self->find(param);
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
            if (r.inbound_.count(x) != 0) notify(x, kRefuseId, text);
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
    table_->forget(*in, e);
    close_endpoint(e);
  }

  // The stream a message's endpoint belongs to.
  std::shared_ptr<Inbound> find(const ucp_am_recv_param_t* param) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
    auto it = inbound_.find(param->reply_ep);
    return it == inbound_.end() ? nullptr : it->second;
  }

  static ucs_status_t on_bye(void* arg, const void*, size_t, void*, size_t,
                             const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Receiver*>(arg);
    if (self->from_unadmitted(param)) return UCS_OK;
    TableLock lock(*self->table_);
    auto in = self->find(param);
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
      in = self->find(param);
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
    if (in->closed) return false;
    if (length > in->max_bucket) {
      close(*in, bucket_over_limit("ucx", length, in->max_bucket), EpClose::kRefuse, nullptr);
      return false;
    }
    const uint64_t seq = in->sequence(header, header_length);
    if (in->seen(seq)) {
      close(*in, Status::data_loss(fmt::format("ucx: bucket {} arrived twice", seq)), EpClose::kRefuse, nullptr);
      return false;
    }
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (!rndv && in->next(seq)) {
      // In place, from UCX's own receive buffer, with no owner: that buffer is UCX's and valid only
      // during this handler (keeping it would mean returning UCS_INPROGRESS and a
      // ucp_am_data_release() on the progress thread later, which a holder dropping it on any
      // thread cannot do). Eager buckets are those under UCX's rendezvous threshold, the small
      // ones; a receiver that wants them past the callback copies them.
      ++in->next_deliver;
      deliver(*in, static_cast<const uint8_t*>(data), length, nullptr);
      return false;
    }
    pending->size = length;
    in->queue[seq] = pending;
    if (rndv) return true;  // not ready: nothing reads it but its receive until it is
    pending->copy.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
    arrived(in, pending, UCS_OK);
    return false;
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
    while (!in->closed) {
      std::shared_ptr<Inbound::Pending> front = in->pop_ready();
      if (!front) break;
      deliver(*in, front->data(), front->size, front);  // handed over: `front` owns the bytes
      TableLock::later([front] {});  // its buffer, unless the callback kept it, goes back after the lock
    }
    if (!in->closed && in->bye && in->queue.empty()) close(*in, ok_status(), EpClose::kNow, nullptr);
  }

  // `owner` (null for bytes that are not ours to give) goes with the bucket.
  void deliver(Inbound& in, const uint8_t* data, size_t size, std::shared_ptr<const void> owner) {
    Status st = on_bucket_(ReceivedBucket{data, size, in.peer, Device::cpu(), std::move(owner)});
    if (!st.ok()) close(in, st, EpClose::kRefuse, nullptr);
  }

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<BufferPool> pool_;
  std::shared_ptr<Gate> gate_;  // endpoints not admitted yet
  BucketCallback on_bucket_;
  PeerClosedCallback on_closed_;
  ucp_listener_h listener_ = nullptr;
  std::map<ucp_ep_h, std::shared_ptr<Inbound>> inbound_;  // every admitted endpoint's stream
  const std::shared_ptr<StreamTable> table_;  // lanes' streams, by their id; maybe shared
  std::shared_ptr<Receiver> self_;  // alive while UCX may call us
};

Result<std::shared_ptr<Receiver>> start_receiver(std::shared_ptr<Engine> engine, const std::string& host,
                                                 uint64_t default_max_bucket, BucketCallback on_bucket,
                                                 PeerClosedCallback on_closed, AdmitCallback admit, Listening* where,
                                                 std::shared_ptr<StreamTable> table) {
  auto r = std::make_shared<Receiver>(engine, default_max_bucket, std::move(on_bucket), std::move(on_closed),
                                      std::move(admit), std::move(table));
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
