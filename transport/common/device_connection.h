// The sending end both device transports (cuda_ipc, nccl) share: a queue of posted buckets and one
// worker thread per connection that reads the control socket, reaps the copies that landed and
// issues queued buckets (the backend's part, on its own stream), never waiting on the GPU except by
// polling. A connection that is destroyed finishes what was posted (within kCloseGrace) and says
// goodbye; one that fails completes every transfer with the failure and tells the receiver why,
// unless the receiver ended it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "transport/common/socket.h"
#include "transport/handle.h"
#include "transport/transport.h"

namespace ferry::transport::net {

// The control message types of a device transport's wire that the shared loops handle.
struct ControlTypes {
  uint32_t close;   // a clean goodbye (sender: every announced copy has landed)
  uint32_t abort;   // the sender gave up; `text` says why
  uint32_t refuse;  // the receiver refused a bucket or shut down the link; `text` says why
};

// One posted bucket.
struct Job {
  std::shared_ptr<CompletionState> state;
  uint8_t* src = nullptr;
  uint64_t size = 0;
  uint64_t sent = 0;     // bytes issued, for a backend that sends a bucket in fragments
  bool started = false;  // a part was issued: cancelling no longer drops it from the queue
  std::atomic<bool> cancelled{false};
};

class DeviceConnection : public Connection {
 public:
  ~DeviceConnection() override;

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) final;
  void abort() final;
  // The receiver is on this host (cuda_ipc always; nccl when its control socket is local).
  bool same_host() const final { return same_host_; }

 protected:
  // `transport` names the transport in messages and logs.
  DeviceConnection(std::string_view transport, ControlTypes types, Socket sock, int device, int receiver_pid);

  // Starts the worker thread: the derived constructor's last step.
  void start();
  // Lets the worker send what was posted (at most kCloseGrace), say goodbye and exit, then joins
  // it: the derived destructor's first step, before anything the worker uses goes.
  void close_and_join();

  // The backend's part, all on the worker thread.
  // A control message other than close and refuse; a non-OK Status ends the connection.
  virtual Status on_message(const Msg& m);
  // Runs after the control socket was read, each turn (nccl: the communicator's error).
  virtual Status check() { return ok_status(); }
  // Completes transfers whose last copy has landed; true on progress.
  virtual Result<bool> reap() = 0;
  // Issues queued buckets (front_job(), pop_job()); true on progress. Sets *gpu_wait when it waits
  // for the GPU (a slot not yet freed), so the worker polls instead of sleeping.
  virtual Result<bool> issue(bool* gpu_wait) = 0;
  // Whether any issued transfer has not completed.
  virtual bool in_flight() const = 0;
  // The connection failed with `why`: completes every issued transfer with it.
  virtual void fail_in_flight(const Status& why) = 0;

  // For issue(): the first queued job (dropping those cancelled before they started), or null when
  // there is none or the connection failed.
  std::shared_ptr<Job> front_job();
  // Removes `job`, the front of the queue, once all of it is issued.
  void pop_job(const std::shared_ptr<Job>& job);

  Socket sock_;
  const int device_;
  const int receiver_pid_;
  const std::string transport_;
  const bool same_host_;
  bool peer_ended_ = false;  // the worker's: the receiver ended the link (no abort is sent back)

 private:
  Status handle_messages();
  // Fails every queued transfer; the worker then tells the receiver (when `tell_peer`) and exits.
  void fail(const Status& why, bool tell_peer);
  bool failed();
  void run();

  const ControlTypes types_;
  Waker waker_;

  std::mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool done_ = false;
  bool closing_ = false;
  bool tell_peer_ = false;
  Deadline close_by_{};
  Status failure_;

  std::string inbuf_;  // the worker's
  std::thread thread_;
};

}  // namespace ferry::transport::net
