// A control connection: length-prefixed protobuf Envelopes over TCP, size-capped. A malformed,
// oversized or truncated frame closes this connection only.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/asio.h"

#include "core/status.h"
#include "coordinator/frame.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

class Channel : public std::enable_shared_from_this<Channel> {
 public:
  using MessageFn = std::function<void(const std::shared_ptr<Channel>&, wire::Envelope&)>;
  using ClosedFn = std::function<void(const std::shared_ptr<Channel>&, const Status&)>;

  Channel(boost::asio::ip::tcp::socket socket, uint64_t max_frame_bytes);

  // Starts reading; callbacks run on the socket's I/O thread.
  void start(MessageFn on_message, ClosedFn on_closed);
  // Thread-safe; frames go out in call order.
  void send(const wire::Envelope& env);
  // Thread-safe; the closed callback runs once with `why`.
  void close(const Status& why);
  std::string peer() const { return peer_; }
  // The largest frame read from here on; call on the channel's I/O thread (from a message callback).
  void set_max_frame(uint64_t bytes) { max_frame_ = bytes; }
  uint64_t max_frame() const { return max_frame_; }
  // Whether the channel closed; on its I/O thread.
  bool is_closed() const { return closed_; }
  boost::asio::any_io_executor executor() { return socket_.get_executor(); }

 private:
  void read_header();
  void read_body(uint32_t n);
  void write_next();
  void fail(const Status& why);

  boost::asio::ip::tcp::socket socket_;
  uint64_t max_frame_;
  std::string peer_;
  MessageFn on_message_;
  ClosedFn on_closed_;
  uint8_t header_[4] = {};
  std::string body_;
  std::deque<std::string> out_;
  bool closed_ = false;
  // A frame goes out from the sending thread itself when nothing is queued before it, so that a
  // request wakes no I/O thread on its way out; `mu_` orders that with the I/O thread's writes and
  // with close.
  std::mutex mu_;
  int fd_ = -1;
  size_t pending_ = 0;      // frames handed to the I/O thread and not yet written; guarded by mu_
  bool fd_closed_ = false;  // guarded by mu_
};

// Connects to "host:port" within `timeout_ms`, on `io`.
Result<boost::asio::ip::tcp::socket> connect_control(boost::asio::io_context& io, const std::string& address,
                                                     int64_t timeout_ms);

}  // namespace ferry::coordinator
