// The Transport both device transports (cuda_ipc, nccl) share: one receiver per transport, started
// by listen() and stopped by shutdown(), and connect() on the device current at creation. The
// backend says how its receiver starts and how a sender connects.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "transport/common/device_receiver.h"
#include "transport/transport.h"

namespace ferry::transport::net {

class DeviceTransport : public Transport {
 public:
  ~DeviceTransport() override { shutdown(); }

  Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) final {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) {
      return Status::failed_precondition(std::string(name()) + ": listen() was already called on this transport");
    }
    FERRY_ASSIGN_OR_RETURN(Started started, start_receiver(std::move(on_bucket), std::move(on_closed), std::move(admit)));
    receiver_ = std::move(started.receiver);
    return started.blob;
  }

  Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline,
                                              const ConnectOptions& options) final {
    auto c = connect_sender(blob, deadline, options.credential);
    if (!c.ok()) return c.status().with_context(std::string(name()) + " connect to " + blob);
    return c;
  }

  void shutdown() final {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) receiver_->stop();
  }

 protected:
  DeviceTransport(int device, const TransportOptions& options) : device_(device), options_(options) {}

  struct Started {
    std::unique_ptr<DeviceReceiver> receiver;
    std::string blob;  // what senders connect with
  };
  // Binds a control listener and starts the receiver's thread.
  virtual Result<Started> start_receiver(BucketCallback on_bucket, PeerClosedCallback on_closed,
                                         AdmitCallback admit) = 0;
  // Connects device_'s memory to a listener's blob, presenting `credential` first.
  virtual Result<std::unique_ptr<Connection>> connect_sender(const std::string& blob, Deadline deadline,
                                                             std::string_view credential) = 0;

  const int device_;  // current when the transport was created
  const TransportOptions options_;

 private:
  std::mutex mu_;
  std::unique_ptr<DeviceReceiver> receiver_;
};

}  // namespace ferry::transport::net
