// Replies from the coordinator, waited on by body type with a deadline.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/settings.h"
#include "core/status.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

class Mailbox {
 public:
  void push(wire::Envelope env) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      box_.push_back(std::move(env));
    }
    cv_.notify_all();
  }
  void close(const Status& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_.ok()) closed_ = why.ok() ? Status::unavailable("connection closed") : why;
    }
    cv_.notify_all();
  }
  // The first envelope of type `body`. Polls for io_spin() before it sleeps: a reply mostly comes
  // within that time, and a sleeping thread takes a wake-up for it.
  Result<wire::Envelope> wait(wire::Envelope::BodyCase body, std::chrono::steady_clock::time_point deadline,
                              const char* what) {
    const auto spin_until = std::min(deadline, std::chrono::steady_clock::now() + io_spin());
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      for (auto it = box_.begin(); it != box_.end(); ++it) {
        if (it->body_case() == body) {
          wire::Envelope e = std::move(*it);
          box_.erase(it);
          return e;
        }
      }
      if (!closed_.ok()) return closed_.with_context(fmt::format("waiting for {}", what));
      if (std::chrono::steady_clock::now() < spin_until) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
        continue;
      }
      // What arrived with the last wake-up is looked at before the deadline is.
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::deadline_exceeded(fmt::format("no {} from the coordinator before the deadline", what));
      }
      cv_.wait_until(lock, deadline);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<wire::Envelope> box_;
  Status closed_;
};

}  // namespace ferry::coordinator
