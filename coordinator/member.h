// What every member (trainer, rollout rank, observer) does on its control connection: answer the
// coordinator's challenge, say hello, and send heartbeats.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "core/asio.h"
#include "core/status.h"
#include "coordinator/channel.h"
#include "coordinator/mailbox.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

// Waits for the Challenge in `mailbox`, fills hello's protocol version and auth (from `token`,
// FERRY_TOKEN), sends it (and right behind it a rank's `registration`, which the coordinator reads
// once the hello passed), and waits for the Welcome. Errors: a protocol mismatch, a refused token,
// the deadline.
Result<wire::Welcome> join(Channel& channel, Mailbox& mailbox, wire::Envelope hello,
                           std::chrono::steady_clock::time_point deadline, const std::string& token,
                           const std::optional<wire::Envelope>& registration = std::nullopt);

// Sends a Heartbeat every `period` on the channel's executor until the channel closes.
class Heartbeat {
 public:
  Heartbeat(std::shared_ptr<Channel> channel, std::chrono::milliseconds period);
  ~Heartbeat();

 private:
  void arm();
  std::shared_ptr<Channel> channel_;
  std::chrono::milliseconds period_;
  std::shared_ptr<boost::asio::steady_timer> timer_;
};

}  // namespace ferry::coordinator
