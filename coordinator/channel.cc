#include "coordinator/channel.h"

#include <sys/socket.h>

#include <future>

#include <fmt/format.h>

#include "core/log.h"

namespace ferry::coordinator {

namespace asio = boost::asio;
using asio::ip::tcp;

Channel::Channel(tcp::socket socket, uint64_t max_frame_bytes) : socket_(std::move(socket)), max_frame_(max_frame_bytes) {
  boost::system::error_code ec;
  auto ep = socket_.remote_endpoint(ec);
  peer_ = ec ? std::string("?") : fmt::format("{}:{}", ep.address().to_string(), ep.port());
  socket_.set_option(tcp::no_delay(true), ec);
  fd_ = socket_.native_handle();
}

void Channel::start(MessageFn on_message, ClosedFn on_closed) {
  on_message_ = std::move(on_message);
  on_closed_ = std::move(on_closed);
  asio::post(socket_.get_executor(), [self = shared_from_this()] { self->read_header(); });
}

void Channel::read_header() {
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(header_), [self](boost::system::error_code ec, size_t) {
    if (ec) {
      return self->fail(ec == asio::error::eof ? Status::unavailable("peer closed the connection")
                                               : Status::unavailable("control read: " + ec.message()));
    }
    auto n = frame_body_size(self->header_, self->max_frame_, self->peer_);
    if (!n.ok()) return self->fail(n.status());
    self->read_body(*n);
  });
}

void Channel::read_body(uint32_t n) {
  body_.resize(n);
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(body_), transfer_all_large, [self](boost::system::error_code ec, size_t) {
    if (ec) return self->fail(Status::unavailable("control read: " + ec.message()));
    wire::Envelope env;
    if (Status st = parse_frame_body(self->body_, self->peer_, &env); !st.ok()) return self->fail(st);
    if (self->closed_) return;
    self->on_message_(self, env);
    if (!self->closed_) self->read_header();
  });
}

void Channel::send(const wire::Envelope& env) {
  std::string frame = encode_frame(env);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ == 0 && !fd_closed_) {
      // What the socket does not take now (a full send buffer, an error) goes through the I/O
      // thread, which reports errors.
      const ssize_t n = ::send(fd_, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n == static_cast<ssize_t>(frame.size())) {
        // The I/O thread wakes now, while the frame travels, and polls (run_io()) when its reply
        // comes, instead of waking for it then.
        asio::post(socket_.get_executor(), [] {});
        return;
      }
      if (n > 0) frame.erase(0, static_cast<size_t>(n));
    }
    ++pending_;
    // Posted under the lock: frames reach the I/O thread in the order they were counted, so a
    // partly written one is finished before the next (posting does not block).
    asio::post(socket_.get_executor(), [self = shared_from_this(), frame = std::move(frame)]() mutable {
      if (self->closed_) return;
      self->out_.push_back(std::move(frame));
      if (self->out_.size() == 1) self->write_next();
    });
  }
}

void Channel::write_next() {
  auto self = shared_from_this();
  asio::async_write(socket_, asio::buffer(out_.front()), transfer_all_large, [self](boost::system::error_code ec, size_t) {
    // A write can complete after the channel failed; its frame is still queued (fail() keeps the
    // queue so in-flight buffers stay alive), and nothing more is sent.
    if (self->closed_) return;
    if (ec) return self->fail(Status::unavailable("control write: " + ec.message()));
    self->out_.pop_front();
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      --self->pending_;
    }
    if (!self->out_.empty()) self->write_next();
  });
}

void Channel::close(const Status& why) {
  asio::post(socket_.get_executor(), [self = shared_from_this(), why] { self->fail(why); });
}

void Channel::fail(const Status& why) {
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fd_closed_ = true;
    boost::system::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }
  if (on_closed_) on_closed_(shared_from_this(), why);
  on_message_ = nullptr;
  on_closed_ = nullptr;
}

Result<tcp::socket> connect_control(asio::io_context& io, const std::string& address, int64_t timeout_ms) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return Status::invalid_argument("coordinator address '" + address + "' is not host:port");
  }
  const std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  auto socket = std::make_shared<tcp::socket>(io);
  auto done = std::make_shared<std::promise<Status>>();
  auto fut = done->get_future();
  asio::post(io, [&io, socket, done, host, port] {
    boost::system::error_code ec;
    tcp::resolver resolver(io);
    auto eps = resolver.resolve(host, port, ec);
    if (ec) return done->set_value(Status::unavailable(fmt::format("resolve {}: {}", host, ec.message())));
    asio::async_connect(*socket, eps, [done, host, port](boost::system::error_code e, const tcp::endpoint&) {
      done->set_value(e ? Status::unavailable(fmt::format("connect to coordinator {}:{}: {}", host, port, e.message()))
                        : ok_status());
    });
  });
  if (fut.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    asio::post(io, [socket] {
      boost::system::error_code ec;
      socket->close(ec);
    });
    fut.wait();
    return Status::deadline_exceeded(fmt::format("connecting to coordinator {} took over {} ms", address, timeout_ms));
  }
  FERRY_RETURN_IF_ERROR(fut.get());
  return std::move(*socket);
}

}  // namespace ferry::coordinator
