#include "transport/tcp/tcp_transport.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <future>
#include <list>
#include <memory>
#include <thread>
#include <vector>

#include "core/accept_loop.h"
#include "core/asio.h"
#include <fmt/format.h>

#include "core/log.h"
#include "core/shared_buffers.h"
#include "transport/admission.h"
#include "transport/handle.h"
#include "transport/listen_host.h"

namespace ferry::transport {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;

// Socket buffer sizes are left to the kernel: setting SO_SNDBUF/SO_RCVBUF turns TCP's autotuning
// off and caps them at net.core.{w,r}mem_max (4 MiB here), while autotuning grows them up to
// net.ipv4.tcp_{w,r}mem (32 MiB for receiving here). On the 2-core VM's loopback, 256 MiB buckets:
// 2.09 to 2.85 GB/s (median 2.64) left to the kernel, 1.80 to 2.53 (median 2.02) with 8 MiB asked for.
void tune(tcp::socket& s) {
  boost::system::error_code ec;
  s.set_option(tcp::no_delay(true), ec);
}

// Caps what a sending connection puts on the wire (bytes per second): the kernel paces its
// segments (TCP's own pacing from Linux 4.13, or the fq qdisc's), without privilege. A rate that
// fits 32 bits goes as 32 bits, which every kernel reads whole; a larger one as 64 (Linux 5.0 on),
// read back, since an older kernel would keep its low 32 bits only. A kernel that refuses it, or
// keeps less, fails the connect, naming the setting: a cap asked for is never silently changed.
Status pace(tcp::socket& s, uint64_t bytes_per_second) {
  if (bytes_per_second == 0) return ok_status();
  int rc;
  if (bytes_per_second < UINT32_MAX) {
    const uint32_t rate = static_cast<uint32_t>(bytes_per_second);
    rc = setsockopt(s.native_handle(), SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof rate);
  } else {
    const uint64_t rate = bytes_per_second;
    rc = setsockopt(s.native_handle(), SOL_SOCKET, SO_MAX_PACING_RATE, &rate, sizeof rate);
    uint64_t kept = 0;
    socklen_t len = sizeof kept;
    if (rc == 0 && (getsockopt(s.native_handle(), SOL_SOCKET, SO_MAX_PACING_RATE, &kept, &len) != 0 ||
                    len != sizeof kept || kept != rate)) {
      return Status::unavailable(fmt::format(
          "FERRY_TCP_MAX_MBIT: this kernel does not pace a connection at {} bytes per second (at most 34,359 Mbit/s)",
          bytes_per_second));
    }
  }
  if (rc == 0) return ok_status();
  return Status::unavailable(
      fmt::format("FERRY_TCP_MAX_MBIT: the kernel refused to pace a connection: {}", std::strerror(errno)));
}

Status net_error(std::string_view what, const boost::system::error_code& ec) {
  return Status::unavailable(fmt::format("tcp {}: {}", what, ec.message()));
}

// Receives buckets from one sender, once it is admitted: the connection's first frame is the
// sender's credential (admission.h), read within kAdmissionDeadline and judged before any bucket
// header is read. Its admission sets the largest bucket it takes.
class Receiver : public std::enable_shared_from_this<Receiver> {
 public:
  Receiver(tcp::socket socket, uint64_t default_max_bucket, BucketCallback on_bucket, PeerClosedCallback on_closed,
           AdmitCallback admit)
      : socket_(std::move(socket)), admission_timer_(socket_.get_executor()), max_bucket_(default_max_bucket),
        on_bucket_(std::move(on_bucket)), on_closed_(std::move(on_closed)), admit_(std::move(admit)) {}

  void start() {
    boost::system::error_code ec;
    const auto ep = socket_.remote_endpoint(ec);
    peer_name_ = ec ? std::string("an unknown address") : fmt::format("{}:{}", ep.address().to_string(), ep.port());
    auto self = shared_from_this();
    admission_timer_.expires_after(kAdmissionDeadline);
    admission_timer_.async_wait([self](boost::system::error_code e) {
      if (e || self->admitted_ || self->closed_) return;
      self->unadmitted(fmt::format("no credential within {} ms", kAdmissionDeadline.count()));
    });
    read_credential();
  }
  void close() {
    closed_ = true;
    admission_timer_.cancel();
    boost::system::error_code ec;
    socket_.close(ec);
  }

 private:
  // At most kCredentialHeaderBytes + kMaxCredentialBytes are read before admission.
  void read_credential() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(credential_header_), [self](boost::system::error_code ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->unadmitted("closed before presenting a credential: " + ec.message());
      auto n = credential_length(self->credential_header_);
      if (!n.ok()) return self->unadmitted(n.status().message());
      self->credential_.resize(*n);
      asio::async_read(self->socket_, asio::buffer(self->credential_), [self](boost::system::error_code e, size_t) {
        if (self->closed_) return;
        if (e) return self->unadmitted("closed while presenting its credential: " + e.message());
        self->admission_timer_.cancel();
        auto granted = admit_peer(self->admit_, self->credential_, "tcp", self->peer_name_, self->max_bucket_);
        if (!granted.ok()) return self->close();
        self->admitted_ = true;
        self->peer_ = granted->peer;
        self->max_bucket_ = granted->max_bucket_bytes;
        self->credential_.clear();
        self->read_header();
      });
    });
  }

  void unadmitted(const std::string& why) {
    log_unadmitted("tcp", peer_name_, why);
    close();
  }

  void read_header() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_), [self](boost::system::error_code ec, size_t) {
      if (ec) return self->finish(ec == asio::error::eof ? ok_status() : net_error("receive", ec));
      uint64_t n = 0;
      for (int i = 7; i >= 0; --i) n = (n << 8) | self->header_[static_cast<size_t>(i)];
      if (n > self->max_bucket_) return self->finish(bucket_over_limit("tcp", n, self->max_bucket_));
      // The last bucket's buffer again, unless the callback kept it (or it is too small).
      if (self->body_ == nullptr || self->body_.use_count() > 1 || self->body_->size() < n) {
        auto b = self->buffers_.take(n);
        if (!b.ok()) return self->finish(b.status().with_context("tcp: a receive buffer"));
        self->body_ = std::move(*b);
      }
      self->body_bytes_ = n;
      self->read_body();
    });
  }

  void read_body() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(body_->data(), body_bytes_), transfer_all_large,
                     [self](boost::system::error_code ec, size_t) {
      if (ec) return self->finish(net_error("receive", ec));
      Status st =
          self->on_bucket_(ReceivedBucket{self->body_->data_as<uint8_t>(), self->body_bytes_, self->peer_, Device::cpu(),
                                          self->body_});
      if (!st.ok()) return self->finish(st);
      self->read_header();
    });
  }

  void finish(Status st) {
    if (closed_) return;  // closed here (shutdown, a refusal): the read it cut short ends without a word
    close();
    if (on_closed_) on_closed_(st);
  }

  tcp::socket socket_;
  asio::steady_timer admission_timer_;
  uint64_t max_bucket_;  // the transport's default until admission sets this connection's
  BucketCallback on_bucket_;
  PeerClosedCallback on_closed_;
  AdmitCallback admit_;
  std::string peer_name_;
  std::array<uint8_t, kCredentialHeaderBytes> credential_header_{};
  std::string credential_;
  bool admitted_ = false;
  bool closed_ = false;  // closed here: a read still under way then ends without a word
  int64_t peer_ = 0;
  std::array<uint8_t, 8> header_{};
  // A bucket's buffer is handed to the callback (ReceivedBucket::owner); one it kept returns here when its
  // last holder lets go, and the next bucket takes an idle one (pages already touched) or a new one.
  SharedBufferPool buffers_{4};
  std::shared_ptr<Buffer> body_;
  size_t body_bytes_ = 0;
};

class TcpConnection final : public Connection, public std::enable_shared_from_this<TcpConnection> {
 public:
  TcpConnection(asio::io_context& io, tcp::socket socket) : io_(io), socket_(std::move(socket)) {
    same_host_ = peer_on_this_host(socket_.native_handle());
  }
  ~TcpConnection() override = default;
  bool same_host() const override { return same_host_; }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override {
    if (offset > region.size() || size > region.size() - offset) {
      return Status::out_of_range(fmt::format("post of {} bytes at {} exceeds a {}-byte region", size, offset, region.size()));
    }
    auto state = std::make_shared<CompletionState>();
    Op op{static_cast<const uint8_t*>(region.data()) + offset, size, state, {}};
    for (int i = 0; i < 8; ++i) op.header[static_cast<size_t>(i)] = static_cast<uint8_t>(size >> (8 * i));
    auto self = shared_from_this();
    asio::post(io_, [self, op = std::move(op)]() mutable {
      if (self->failed_) {
        op.state->complete(self->failure_);
        return;
      }
      self->queue_.push_back(std::move(op));
      if (self->queue_.size() == 1) self->write_next();
    });
    std::weak_ptr<TcpConnection> weak = self;
    return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(state, [weak] {
      if (auto c = weak.lock()) c->abort();
    }));
  }

  void abort() override {
    auto self = shared_from_this();
    asio::post(io_, [self] { self->fail(Status::aborted("tcp connection aborted")); });
  }

 private:
  struct Op {
    const uint8_t* data;
    size_t size;
    std::shared_ptr<CompletionState> state;
    std::array<uint8_t, 8> header;
  };

  void write_next() {
    Op& op = queue_.front();
    std::array<asio::const_buffer, 2> bufs{asio::buffer(op.header), asio::buffer(op.data, op.size)};
    auto self = shared_from_this();
    asio::async_write(socket_, bufs, transfer_all_large, [self](boost::system::error_code ec, size_t) {
      if (self->failed_) return;
      if (ec) return self->fail(net_error("send", ec));
      self->queue_.front().state->complete(ok_status());
      self->queue_.pop_front();
      if (!self->queue_.empty()) self->write_next();
    });
  }

  void fail(Status st) {
    if (!failed_) {
      failed_ = true;
      failure_ = st;
    }
    boost::system::error_code ec;
    socket_.close(ec);
    for (Op& op : queue_) op.state->complete(failure_);
    queue_.clear();
  }

  asio::io_context& io_;
  tcp::socket socket_;
  std::deque<Op> queue_;  // touched only on the I/O thread
  bool failed_ = false;
  Status failure_;
  bool same_host_ = false;
};

// Connections are owned by the transport's I/O thread; the caller holds a thin owner that aborts on
// destruction so no socket outlives its user.
class OwnedConnection final : public Connection {
 public:
  explicit OwnedConnection(std::shared_ptr<TcpConnection> c) : c_(std::move(c)) {}
  ~OwnedConnection() override { c_->abort(); }
  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& r, size_t o, size_t s) override {
    return c_->post(r, o, s);
  }
  void abort() override { c_->abort(); }
  bool same_host() const override { return c_->same_host(); }

 private:
  std::shared_ptr<TcpConnection> c_;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportOptions& options)
      : options_(options), work_(asio::make_work_guard(io_)), acceptor_(io_) {
    thread_ = std::thread([this] { io_.run(); });
  }
  ~TcpTransport() override {
    shutdown();
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  std::string_view name() const override { return "tcp"; }
  Capabilities capabilities() const override { return {true, true, true, false, -1}; }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    if (!device.is_cpu()) return Status::invalid_argument("tcp moves host memory only; got " + device.to_string());
    return std::unique_ptr<MemoryRegion>(std::make_unique<HostRegion>(data, size));
  }

  Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) override {
    const std::string& host = options_.listen_host;
    max_bucket_ = options_.max_received_bucket();
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(host, ec);
    if (ec) return Status::invalid_argument(fmt::format("FERRY_LISTEN_HOST='{}' is not an address", host));
    std::promise<Result<std::string>> done;
    asio::post(io_, [&] {
      boost::system::error_code e;
      acceptor_.open(addr.is_v4() ? tcp::v4() : tcp::v6(), e);
      if (!e) acceptor_.set_option(tcp::acceptor::reuse_address(true), e);
      if (!e) acceptor_.bind(tcp::endpoint(addr, 0), e);
      if (!e) acceptor_.listen(asio::socket_base::max_listen_connections, e);
      if (e) return done.set_value(net_error("listen on " + host, e));
      on_bucket_ = std::move(on_bucket);
      on_closed_ = std::move(on_closed);
      admit_ = std::move(admit);
      // Backs off and keeps accepting on any error: a burst that exhausts descriptors (EMFILE) must
      // not end the listener.
      accept_loop_ = accept_forever(acceptor_, [this](tcp::socket socket) { adopt(std::move(socket)); }, "tcp data listener");
      const auto ep = acceptor_.local_endpoint();
      done.set_value(fmt::format("tcp://{}:{}", ep.address().to_string(), ep.port()));
    });
    return done.get_future().get();
  }

  Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline,
                                              const ConnectOptions& options) override {
    const std::string_view credential = options.credential;
    FERRY_RETURN_IF_ERROR(check_credential(credential).with_context("tcp connect"));
    constexpr std::string_view kScheme = "tcp://";
    const size_t colon = blob.rfind(':');
    if (!blob.starts_with(kScheme) || colon == std::string::npos || colon < kScheme.size()) {
      return Status::invalid_argument("tcp: malformed endpoint '" + blob + "'");
    }
    const std::string host = blob.substr(kScheme.size(), colon - kScheme.size());
    const std::string port = blob.substr(colon + 1);
    auto socket = std::make_shared<tcp::socket>(io_);
    auto state = std::make_shared<CompletionState>();
    auto frame = std::make_shared<std::string>(credential_frame(credential));
    asio::post(io_, [this, socket, state, host, port, frame, rate = options_.tcp_max_rate] {
      boost::system::error_code ec;
      tcp::resolver resolver(io_);
      auto eps = resolver.resolve(host, port, ec);
      if (ec) return state->complete(net_error("resolve " + host, ec));
      asio::async_connect(
          *socket, eps, [socket, state, host, port, frame, rate](boost::system::error_code e, const tcp::endpoint&) {
            if (e) return state->complete(net_error(fmt::format("connect to {}:{}", host, port), e));
            tune(*socket);
            if (Status paced = pace(*socket, rate); !paced.ok()) return state->complete(paced);
            // The credential goes first; buckets follow it on the same stream.
            asio::async_write(*socket, asio::buffer(*frame), [state, frame](boost::system::error_code w, size_t) {
              state->complete(w ? net_error("send the credential", w) : ok_status());
            });
          });
    });
    Status st = state->wait(deadline);
    if (!st.ok()) {
      asio::post(io_, [socket] {
        boost::system::error_code ec;
        socket->close(ec);
      });
      return st.with_context("tcp connect to " + blob);
    }
    auto conn = std::make_shared<TcpConnection>(io_, std::move(*socket));
    return std::unique_ptr<Connection>(std::make_unique<OwnedConnection>(std::move(conn)));
  }

  void shutdown() override {
    std::promise<void> done;
    asio::post(io_, [&] {
      boost::system::error_code ec;
      if (accept_loop_) accept_loop_->stop();
      acceptor_.close(ec);
      for (auto& w : receivers_) {
        if (auto r = w.lock()) r->close();
      }
      receivers_.clear();
      done.set_value();
    });
    done.get_future().wait();
  }

 private:
  void adopt(tcp::socket socket) {
    tune(socket);
    auto r = std::make_shared<Receiver>(std::move(socket), max_bucket_, on_bucket_, on_closed_, admit_);
    receivers_.remove_if([](const std::weak_ptr<Receiver>& w) { return w.expired(); });
    receivers_.push_back(r);
    r->start();
  }

  const TransportOptions options_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  tcp::acceptor acceptor_;
  std::shared_ptr<AcceptLoop> accept_loop_;  // the I/O thread's
  std::thread thread_;
  BucketCallback on_bucket_;
  PeerClosedCallback on_closed_;
  AdmitCallback admit_;
  uint64_t max_bucket_ = 0;
  std::list<std::weak_ptr<Receiver>> receivers_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_tcp_transport(const TransportOptions& options) {
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(options));
}

}  // namespace ferry::transport
