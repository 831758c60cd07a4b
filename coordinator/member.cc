#include "coordinator/member.h"

#include <future>

#include <fmt/format.h>

#include "core/version.h"
#include "coordinator/auth.h"
#include "coordinator/wire.h"

namespace ferry::coordinator {

Result<wire::Welcome> join(Channel& channel, Mailbox& mailbox, wire::Envelope hello,
                           std::chrono::steady_clock::time_point deadline, const std::string& token,
                           const std::optional<wire::Envelope>& registration) {
  FERRY_ASSIGN_OR_RETURN(auto env, mailbox.wait(wire::Envelope::kChallenge, deadline, "challenge"));
  const wire::Challenge& c = env.challenge();
  if (c.protocol_version() != kProtocolVersion) {
    return Status::failed_precondition(fmt::format("coordinator speaks protocol {}; this member speaks {}",
                                                   c.protocol_version(), kProtocolVersion));
  }
  wire::Hello* h = hello.mutable_hello();
  h->set_protocol_version(kProtocolVersion);
  if (c.token_required()) {
    if (token.empty()) return Status::unauthenticated("the coordinator requires a token; set FERRY_TOKEN");
    FERRY_ASSIGN_OR_RETURN(std::string mac, answer_challenge(token, c.nonce()));
    h->set_auth(mac);
  }
  channel.send(hello);
  if (registration) channel.send(*registration);
  FERRY_ASSIGN_OR_RETURN(auto w, mailbox.wait(wire::Envelope::kWelcome, deadline, "welcome"));
  FERRY_RETURN_IF_ERROR(from_wire(w.welcome().status()));
  return w.welcome();
}

Heartbeat::Heartbeat(std::shared_ptr<Channel> channel, std::chrono::milliseconds period)
    : channel_(std::move(channel)), period_(period),
      timer_(std::make_shared<boost::asio::steady_timer>(channel_->executor())) {
  boost::asio::post(channel_->executor(), [this] { arm(); });
}

Heartbeat::~Heartbeat() {
  // The timer lives on the channel's thread: cancel it there and wait, so no tick outlives us.
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  boost::asio::post(channel_->executor(), [t = timer_, done] {
    t->cancel();
    done->set_value();
  });
  fut.wait_for(std::chrono::seconds(5));
}

void Heartbeat::arm() {
  timer_->expires_after(period_);
  std::weak_ptr<boost::asio::steady_timer> weak = timer_;
  timer_->async_wait([this, weak](boost::system::error_code ec) {
    if (ec || weak.expired()) return;
    wire::Envelope env;
    env.mutable_heartbeat();
    channel_->send(env);
    arm();
  });
}

}  // namespace ferry::coordinator
