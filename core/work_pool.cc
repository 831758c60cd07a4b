#include "core/work_pool.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "core/parallel.h"

namespace ferry {
namespace {

struct Job {
  const std::function<void(size_t)>* fn;
  size_t left;  // pieces not finished yet
  std::condition_variable done;
};

struct Task {
  Job* job;
  size_t piece;
};

class Pool {
 public:
  // Threads are started as jobs ask for them and kept until the process exits (detached: a
  // process-wide pool outlives static destruction order).
  // A thread that cannot be started (a pids limit, say) leaves the pieces to fewer workers and the
  // caller, which takes back what none starts.
  void ensure(size_t workers) {
    std::lock_guard<std::mutex> lock(mu_);
    while (started_ < workers) {
      try {
        std::thread([this] { work(); }).detach();
      } catch (const std::system_error&) {
        return;
      }
      ++started_;
    }
  }

  // noexcept: a piece that throws ends the process (as on a thread of its own), rather than leaving
  // queued tasks pointing at a job that is gone.
  void run(size_t count, const std::function<void(size_t)>& fn) noexcept {
    Job job{&fn, count, {}};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t t = 1; t < count; ++t) queue_.push_back({&job, t});
    }
    for (size_t t = 1; t < count; ++t) wake_.notify_one();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    --job.left;
    while (job.left > 0) {
      // Take back a piece of this job that no worker has started.
      auto it = queue_.begin();
      while (it != queue_.end() && it->job != &job) ++it;
      if (it == queue_.end()) {
        job.done.wait(lock);
        continue;
      }
      const size_t piece = it->piece;
      queue_.erase(it);
      lock.unlock();
      fn(piece);
      lock.lock();
      --job.left;
    }
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [this] { return !queue_.empty(); });
      const Task task = queue_.front();
      queue_.pop_front();
      lock.unlock();
      (*task.job->fn)(task.piece);
      lock.lock();
      if (--task.job->left == 0) task.job->done.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Task> queue_;
  size_t started_ = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: detached workers wait on it until the process exits
  return *p;
}

}  // namespace

void run_pieces(size_t count, const std::function<void(size_t)>& fn) noexcept {
  if (count == 0) return;
  if (count == 1) {
    fn(0);
    return;
  }
  // At most host_threads() at once, the caller's included (FERRY_THREADS: processes sharing a
  // host's cores each keep to their share); more pieces queue for them.
  pool().ensure(std::min(count, host_threads()) - 1);
  pool().run(count, fn);
}

}  // namespace ferry
