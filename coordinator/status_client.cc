#include "coordinator/status_client.h"

#include <thread>

#include "core/asio.h"
#include "coordinator/channel.h"
#include "coordinator/mailbox.h"
#include "coordinator/member.h"

namespace ferry::coordinator {

Result<wire::StatusReply> query_status(const std::string& address, int64_t timeout_ms, const Settings& settings) {
  boost::asio::io_context io;
  auto work = boost::asio::make_work_guard(io);
  std::thread t([&] { io.run(); });
  auto finish = [&] {
    work.reset();
    io.stop();
    t.join();
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto socket = connect_control(io, address, timeout_ms);
  if (!socket.ok()) {
    finish();
    return socket.status();
  }
  Mailbox mailbox;
  auto channel = std::make_shared<Channel>(std::move(*socket), settings.max_frame_bytes);
  channel->start([&](const std::shared_ptr<Channel>&, wire::Envelope& e) { mailbox.push(std::move(e)); },
                 [&](const std::shared_ptr<Channel>&, const Status& why) { mailbox.close(why); });
  wire::Envelope hello;
  hello.mutable_hello()->set_role("observer");
  Result<wire::StatusReply> out = Status::internal("no reply");
  auto joined = join(*channel, mailbox, std::move(hello), deadline, settings.token);
  if (!joined.ok()) {
    out = joined.status();
  } else {
    wire::Envelope req;
    req.mutable_status_request();
    channel->send(req);
    auto reply = mailbox.wait(wire::Envelope::kStatusReply, deadline, "status reply");
    out = reply.ok() ? Result<wire::StatusReply>(reply->status_reply()) : Result<wire::StatusReply>(reply.status());
  }
  channel->close(ok_status());
  finish();
  return out;
}

}  // namespace ferry::coordinator
