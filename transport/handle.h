// A TransferHandle whose completion is set by the transport's I/O thread.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "transport/transport.h"

namespace ferry::transport {

class CompletionState {
 public:
  void complete(Status st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      done_ = true;
      status_ = std::move(st);
    }
    cv_.notify_all();
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  Status wait(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return done_; })) {
      return Status::deadline_exceeded("transfer did not complete before its deadline");
    }
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

// Handle over a CompletionState; abort() runs a transport-supplied cancel action.
class StateHandle final : public TransferHandle {
 public:
  StateHandle(std::shared_ptr<CompletionState> state, std::function<void()> cancel)
      : state_(std::move(state)), cancel_(std::move(cancel)) {}
  bool is_completed() override { return state_->done(); }
  Status wait(Deadline deadline) override { return state_->wait(deadline); }
  void abort() override {
    state_->complete(Status::aborted("transfer aborted"));
    if (cancel_) cancel_();
  }

 private:
  std::shared_ptr<CompletionState> state_;
  std::function<void()> cancel_;
};

class HostRegion final : public MemoryRegion {
 public:
  HostRegion(void* data, size_t size) : data_(data), size_(size) {}
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

 private:
  void* data_;
  size_t size_;
};

}  // namespace ferry::transport
