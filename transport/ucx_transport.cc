// ucx: one UCP context and worker per transport instance, driven by one progress thread that makes
// every UCP call. Buckets travel as active messages (eager or rendezvous, UCX decides); listen()
// opens a UCP sockaddr listener and returns "ucx://host:port". Endpoints use peer error handling: a
// peer's death must reach the other end, and a forced close (abort) needs it on both sides. UCX
// then uses only transports that report peer failures (on UCX 1.13: tcp and the RDMA ones, not its
// shared-memory transports or cma), so on one node the bytes go over UCX's tcp. Memory a sender
// registers is mapped with the context once (ucp_mem_map) and each post passes that mapping; the
// receiver lands rendezvous buckets in pooled buffers mapped once and hands them over
// (bucket_owner()). The user's UCX_* variables are read as they are (ucp_config_read) and never
// written. Device memory goes through a pinned host mirror when this UCX build cannot move CUDA
// memory itself (checked at run time).
#include "transport/ucx_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "core/buffer.h"
#include "core/settings.h"
#include "transport/handle.h"
#include "transport/ucx_engine.h"
#include "transport/ucx_receiver.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry::transport {
namespace {

using namespace ucx;

// A sender's endpoint. Every member is touched on the progress thread only.
class UcxConnection final : public Connection, public std::enable_shared_from_this<UcxConnection> {
 public:
  explicit UcxConnection(std::shared_ptr<Engine> engine) : engine_(std::move(engine)) {}

  Status open(const std::string& host, uint16_t port, Deadline deadline) {
    auto self = shared_from_this();
    Status st = engine_->call(
        [self, host, port](std::shared_ptr<CompletionState> done) {
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
          ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
          ep.err_handler.cb = &UcxConnection::on_error;
          ep.err_handler.arg = self.get();
          ucs_status_t s = ucp_ep_create(self->engine_->worker(), &ep, &self->ep_);
          if (s != UCS_OK) return done->complete(ucs_error("create endpoint", s));
          self->keepalive_ = self;  // the error handler's argument lives until the endpoint is closed
          // A flush completes once the endpoint is wired up with the listener.
          ucp_request_param_t p{};
          p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
          p.cb.send = [](void* req, ucs_status_t s2, void* ud) {
            static_cast<CompletionState*>(ud)->complete(s2 == UCS_OK ? ok_status() : ucs_error("connect", s2));
            ucp_request_free(req);
          };
          p.user_data = done.get();
          self->flush_state_ = done;
          ucs_status_ptr_t r = ucp_ep_flush_nbx(self->ep_, &p);
          if (r == nullptr) done->complete(ok_status());
          else if (UCS_PTR_IS_ERR(r)) done->complete(ucs_error("connect", UCS_PTR_STATUS(r)));
        },
        deadline);
    if (!st.ok()) abort();
    return st;
  }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override;

  void abort() override {
    auto self = shared_from_this();
    engine_->run([self] { self->fail(Status::aborted("ucx connection aborted"), true); });
  }

  // A clean close: a goodbye, then a flushing close of the endpoint, waited for until `deadline`.
  // The receiver reports OK when the goodbye arrives and closes its end, which completes ours.
  // With buckets still in flight, or after a failure, the endpoint is closed at once instead.
  void close_cleanly(Deadline deadline) {
    auto self = shared_from_this();
    Status st = engine_->call([self](std::shared_ptr<CompletionState> done) { self->say_goodbye(std::move(done)); },
                              deadline);
    st.ignore_error();  // past the deadline the close goes on: the engine finishes it before it stops
  }

 private:
  friend struct SendContext;

  void say_goodbye(std::shared_ptr<CompletionState> done) {
    if (ep_ == nullptr || !failure_.ok() || !pending_.empty()) {
      fail(Status::aborted("ucx connection closed"), true);
      return done->complete(ok_status());
    }
    failure_ = Status::aborted("ucx connection closed");  // nothing is sent after the goodbye
    struct Ctx {
      std::shared_ptr<UcxConnection> conn;
      std::shared_ptr<CompletionState> done;
    };
    auto* ctx = new Ctx{shared_from_this(), done};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // names this endpoint to the receiver, as every bucket does
    p.cb.send = [](void* req, ucs_status_t st, void* ud) {
      auto* c = static_cast<Ctx*>(ud);
      c->conn->close_after_goodbye(st, std::move(c->done));
      delete c;
      ucp_request_free(req);
    };
    p.user_data = ctx;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep_, kByeId, nullptr, 0, nullptr, 0, &p);
    if (!UCS_PTR_IS_PTR(r)) {
      close_after_goodbye(UCS_PTR_STATUS(r), std::move(ctx->done));
      delete ctx;
    }
  }

  void close_after_goodbye(ucs_status_t sent, std::shared_ptr<CompletionState> done) {
    if (ep_ == nullptr) return done->complete(ok_status());  // the receiver's close came first
    auto self = shared_from_this();  // the endpoint's error handler points here until it is closed
    engine_->close_ep(std::exchange(ep_, nullptr), sent != UCS_OK,
                      [self, done](ucs_status_t) { done->complete(ok_status()); });
    keepalive_.reset();
  }

  static void on_error(void* arg, ucp_ep_h, ucs_status_t st) {
    static_cast<UcxConnection*>(arg)->fail(ucs_error("peer failed", st), true);
  }

  void fail(Status st, bool force) {
    if (failure_.ok()) failure_ = st;
    for (auto& s : pending_) s->complete(failure_);
    pending_.clear();
    if (flush_state_) flush_state_->complete(failure_);
    if (ep_ != nullptr) {
      // The close holds this connection: the endpoint's error handler points here until it is done.
      engine_->close_ep(std::exchange(ep_, nullptr), force, [self = shared_from_this()](ucs_status_t) {});
    }
    keepalive_.reset();  // may drop the last reference: nothing may follow
  }

  std::shared_ptr<Engine> engine_;
  ucp_ep_h ep_ = nullptr;
  Status failure_;
  std::set<std::shared_ptr<CompletionState>> pending_;
  std::shared_ptr<CompletionState> flush_state_;
  std::shared_ptr<UcxConnection> keepalive_;

 public:
  void send(const uint8_t* data, size_t size, ucp_mem_h memh, std::shared_ptr<CompletionState> state);
};

struct SendContext {
  std::shared_ptr<UcxConnection> conn;
  std::shared_ptr<CompletionState> state;
};

void UcxConnection::send(const uint8_t* data, size_t size, ucp_mem_h memh, std::shared_ptr<CompletionState> state) {
  if (!failure_.ok() || ep_ == nullptr) return state->complete(failure_.ok() ? Status::unavailable("ucx: not connected") : failure_);
  if (state->done()) return;  // aborted before it left
  auto* ctx = new SendContext{shared_from_this(), state};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  if (memh != nullptr && size > 0) {  // the region's registration, made once when it was registered
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  p.cb.send = [](void* req, ucs_status_t st, void* ud) {
    auto* c = static_cast<SendContext*>(ud);
    c->state->complete(st == UCS_OK ? ok_status() : st == UCS_ERR_CANCELED ? Status::aborted("ucx send cancelled")
                                                                            : ucs_error("send", st));
    c->conn->pending_.erase(c->state);
    delete c;
    ucp_request_free(req);
  };
  p.user_data = ctx;
  pending_.insert(state);
  ucs_status_ptr_t r = ucp_am_send_nbx(ep_, kDataId, nullptr, 0, data, size, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    state->complete(r == nullptr ? ok_status() : ucs_error("send", UCS_PTR_STATUS(r)));
    pending_.erase(state);
    delete ctx;
  }
}

// Memory mapped with the transport's UCP context once, at registration; every post from it passes
// that mapping, so nothing is registered per bucket.
class MappedRegion : public MemoryRegion {
 public:
  MappedRegion(std::shared_ptr<Engine> engine, void* mapped, size_t size)
      : engine_(std::move(engine)), memh_(engine_->map(mapped, size)) {}
  ~MappedRegion() override { engine_->unmap(memh_); }
  ucp_mem_h memh() const { return memh_; }

 private:
  std::shared_ptr<Engine> engine_;
  ucp_mem_h memh_;
};

class UcxHostRegion final : public MappedRegion {
 public:
  UcxHostRegion(std::shared_ptr<Engine> engine, void* data, size_t size)
      : MappedRegion(std::move(engine), data, size), data_(data), size_(size) {}
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

 private:
  void* data_;
  size_t size_;
};

// Device memory through a pinned host mirror, for UCX builds without CUDA support. The mirror is
// what UCX reads, so it is what is mapped.
class StagedRegion final : public MappedRegion {
 public:
  StagedRegion(std::shared_ptr<Engine> engine, void* data, size_t size, Device device, Buffer mirror)
      : MappedRegion(std::move(engine), mirror.data(), size), data_(data), size_(size), device_(device),
        mirror_(std::move(mirror)) {}
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return device_; }
  uint8_t* stage(size_t offset, size_t size, Status* st) const {
#if defined(FERRY_HAVE_CUDA)
    const cudaError_t e = cudaMemcpy(mirror_.data_as<uint8_t>() + offset, static_cast<uint8_t*>(data_) + offset, size,
                                     cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) *st = Status::internal(std::string("ucx staging copy: ") + cudaGetErrorString(e));
#else
    *st = Status::internal("ucx: staging without CUDA");
#endif
    return mirror_.data_as<uint8_t>() + offset;
  }

 private:
  void* data_;
  size_t size_;
  Device device_;
  Buffer mirror_;
};

Result<std::unique_ptr<TransferHandle>> UcxConnection::post(const MemoryRegion& region, size_t offset, size_t size) {
  if (offset > region.size() || size > region.size() - offset) {
    return Status::out_of_range(fmt::format("post of {} bytes at {} exceeds a {}-byte region", size, offset, region.size()));
  }
  const uint8_t* data = static_cast<const uint8_t*>(region.data()) + offset;
  const auto* mapped = dynamic_cast<const MappedRegion*>(&region);
  ucp_mem_h memh = mapped != nullptr ? mapped->memh() : nullptr;
  if (const auto* staged = dynamic_cast<const StagedRegion*>(&region)) {
    Status st;
    data = staged->stage(offset, size, &st);
    FERRY_RETURN_IF_ERROR(st);
  }
  auto state = std::make_shared<CompletionState>();
  auto self = shared_from_this();
  engine_->run([self, data, size, memh, state] { self->send(data, size, memh, state); });
  std::weak_ptr<UcxConnection> weak = self;
  return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(state, [weak] {
    if (auto c = weak.lock()) c->abort();
  }));
}

}  // namespace

namespace {

// The caller's handle: closing it says goodbye and closes the endpoint.
class OwnedUcxConnection final : public Connection {
 public:
  explicit OwnedUcxConnection(std::shared_ptr<UcxConnection> c) : c_(std::move(c)) {}
  ~OwnedUcxConnection() override { c_->close_cleanly(Clock::now() + std::chrono::seconds(10)); }
  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& r, size_t o, size_t s) override {
    return c_->post(r, o, s);
  }
  void abort() override { c_->abort(); }

 private:
  std::shared_ptr<UcxConnection> c_;
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<Engine> e) : engine_(std::move(e)) {}
  ~UcxTransport() override {
    shutdown();
    engine_->stop();
  }
  std::string_view name() const override { return "ucx"; }
  Capabilities capabilities() const override { return {true, true, true, false, -1}; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    if (device.is_cpu()) return std::unique_ptr<MemoryRegion>(std::make_unique<UcxHostRegion>(engine_, data, size));
    if (engine_->cuda_capable()) return std::unique_ptr<MemoryRegion>(std::make_unique<HostRegion>(data, size));
    FERRY_ASSIGN_OR_RETURN(Allocator * pinned, pinned_allocator());
    FERRY_ASSIGN_OR_RETURN(Buffer mirror, Buffer::allocate(size, *pinned));
    return std::unique_ptr<MemoryRegion>(
        std::make_unique<StagedRegion>(engine_, data, size, device, std::move(mirror)));
  }

  Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) return Status::failed_precondition("ucx: listen() was already called on this transport");
    FERRY_ASSIGN_OR_RETURN(std::string host, setting_string("FERRY_LISTEN_HOST"));
    FERRY_ASSIGN_OR_RETURN(uint64_t bucket, setting_bytes("FERRY_BUCKET_BYTES"));
    std::string blob;
    FERRY_ASSIGN_OR_RETURN(receiver_, ucx::start_receiver(engine_, host, bucket * 4 + (64ull << 20), std::move(on_bucket),
                                                          std::move(on_closed), &blob));
    return blob;
  }

  Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline) override {
    constexpr std::string_view kScheme = "ucx://";
    const size_t colon = blob.rfind(':');
    if (!blob.starts_with(kScheme) || colon == std::string::npos || colon < kScheme.size()) {
      return Status::invalid_argument("ucx: malformed endpoint '" + blob + "'");
    }
    const int port = std::atoi(blob.c_str() + colon + 1);
    if (port <= 0 || port > 65535) return Status::invalid_argument("ucx: malformed port in '" + blob + "'");
    auto c = std::make_shared<UcxConnection>(engine_);
    Status st = c->open(blob.substr(kScheme.size(), colon - kScheme.size()), static_cast<uint16_t>(port), deadline);
    if (!st.ok()) return st.with_context("ucx connect to " + blob);
    return std::unique_ptr<Connection>(std::make_unique<OwnedUcxConnection>(std::move(c)));
  }

  void shutdown() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) ucx::stop_receiver(receiver_);
    receiver_.reset();
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::mutex mu_;
  std::shared_ptr<ucx::Receiver> receiver_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_ucx_transport() {
  auto engine = std::make_shared<Engine>();
  FERRY_RETURN_IF_ERROR(engine->init());
  return std::unique_ptr<Transport>(std::make_unique<UcxTransport>(std::move(engine)));
}

}  // namespace ferry::transport
