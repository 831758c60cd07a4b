// The receiving end both device transports (cuda_ipc, nccl) share: one thread accepts senders on a
// control listener, holds each until admission (socket_admission.h) judges its credential, hands
// the admitted ones to the backend, and serves every connected sender in turn (the backend's part:
// reading its control messages and delivering its buckets), never running two callbacks at once. A
// sender whose link ends is told why unless it ended it, and reaches the closed callback.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "transport/common/device_connection.h"
#include "transport/common/socket.h"
#include "transport/common/socket_admission.h"
#include "transport/transport.h"

namespace ferry::transport::net {

// One connected sender: its control socket and what both receivers track of it.
struct DevicePeer {
  virtual ~DevicePeer() = default;
  Socket sock;
  std::string inbuf;
  int pid = 0;
  int64_t identity = 0;     // what admission returned
  uint64_t max_bucket = 0;  // the largest bucket admission lets it deliver
  bool clean_close = false;
  bool eof = false;
};

class DeviceReceiver {
 public:
  virtual ~DeviceReceiver();
  // Stops the thread, says goodbye to every sender and releases them; idempotent.
  virtual void stop() = 0;

 protected:
  // `transport` names the transport in messages and logs; `default_max_bucket` is the bucket limit
  // of a sender admitted without one of its own.
  DeviceReceiver(std::string_view transport, ControlTypes types, Listener listener, PeerClosedCallback on_closed,
                 AdmitCallback admit, uint64_t default_max_bucket);

  // Starts the thread: the derived constructor's last step.
  void start();
  // Stops and joins the thread and closes the senders not yet admitted; false when it was stopped
  // already. The derived stop() then says goodbye (say_goodbye()) and releases its peers.
  bool halt();
  // Tells every connected sender the receiver shut down.
  void say_goodbye();
  // Appends what `p`'s control socket holds now to its inbuf (sets eof at end of stream).
  Status read_control(DevicePeer& p);
  // Wakes the thread (a set-up finished elsewhere).
  void wake() { waker_.notify(); }

  // The backend's part, on the thread.
  virtual void thread_started() {}
  // An admitted sender: set it up (a handshake) and add it to peers_, now or later (adopt()), its
  // DevicePeer keeping what it was `granted` (identity and bucket limit).
  virtual void on_admitted(Socket s, const Admission& granted) = 0;
  // Refuses, closing the link (the Status serve() returns), a bucket of `size` bytes over `p`'s
  // limit.
  Status check_bucket(const DevicePeer& p, uint64_t size) const;
  // Takes in senders set up elsewhere; sets *progress when any.
  virtual void adopt(bool* progress) {}
  // Reads `p`'s control messages and delivers what has arrived; returns the Status that ends the
  // link, if it ends. Sets *progress on any, and *gpu_wait while it polls the GPU for `p`.
  virtual std::optional<Status> serve(DevicePeer& p, bool* progress, bool* gpu_wait) = 0;

  const std::string transport_;
  std::vector<std::unique_ptr<DevicePeer>> peers_;  // the thread's, then stop()'s after the join

 private:
  void run();

  const ControlTypes types_;
  Listener listener_;
  PeerClosedCallback on_closed_;
  Admissions admissions_;  // the thread's, then halt()'s after the join
  Waker waker_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ferry::transport::net
