// ferry's log records to Python's `logging`, under the logger "ferry". ferry logs from its own
// threads, sometimes holding its locks, and a Python thread may hold the GIL while it waits for one
// of those locks (reading worker.paused, say): so a record never takes the GIL where it is logged.
// It is queued, and a thread of this module (the pump) takes the GIL and calls
// logging.getLogger("ferry").log(level, message), in the order the records came. The pump is
// stopped at exit, before the interpreter finalizes; from then on records go to stderr again.
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "core/log.h"
#include "python/bindings.h"

namespace ferry::python {
namespace {

// Python's logging levels; trace is below DEBUG (logging has no name for it; shown as "Level 5").
int python_level(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::trace: return 5;
    case spdlog::level::debug: return 10;
    case spdlog::level::info: return 20;
    case spdlog::level::warn: return 30;
    case spdlog::level::err: return 40;
    default: return 50;  // critical
  }
}

struct Record {
  int level;
  std::string message;
};

class Forwarder {
 public:
  bool enabled() {
    std::lock_guard<std::mutex> lock(mu_);
    return enabled_;
  }

  // With the GIL held.
  void enable() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (enabled_) return;
    }
    // Wait out a pump that is still stopping (forward_logs(False) then True).
    wait_exited();
    logger_ = py::module_::import("logging").attr("getLogger")("ferry");
    {
      std::lock_guard<std::mutex> lock(mu_);
      enabled_ = true;
      stop_ = false;
      start_pump_locked();
    }
    set_log_sink([this](spdlog::level::level_enum level, std::string_view message) { push(level, message); });
  }

  // With the GIL held: records from now on go to stderr; the queued ones are delivered first.
  void disable() {
    set_log_sink({});
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!enabled_) return;
      enabled_ = false;
      stop_ = true;
    }
    wake_.notify_all();
    wait_exited();
    logger_ = py::object();
  }

  // With the GIL held: waits until every record logged before the call has reached `logging`.
  bool flush(double timeout_s) {
    py::gil_scoped_release release;  // first, so that mu_ is let go before the GIL is taken back
    std::unique_lock<std::mutex> lock(mu_);
    if (!enabled_ || std::this_thread::get_id() == pump_id_) return delivered_ == pushed_;
    const uint64_t target = pushed_;
    return done_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                          [&] { return delivered_ >= target || pump_exited_; }) &&
           delivered_ >= target;
  }

 private:
  // Any thread, any locks held, GIL or not: only queues.
  void push(spdlog::level::level_enum level, std::string_view message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!enabled_) return;
      if (pid_ != getpid()) {  // a forked child: the parent's pump and queue are not this process's
        queue_.clear();
        pushed_ = delivered_ = 0;
        start_pump_locked();
      }
      queue_.push_back(Record{python_level(level), std::string(message)});
      ++pushed_;
    }
    wake_.notify_one();
  }

  void start_pump_locked() {
    pid_ = getpid();
    pump_exited_ = false;
    std::thread([this] { pump(); }).detach();  // it signals pump_exited_; nothing joins it
  }

  // With the GIL held; lets go of it (the pump may be waiting for it to deliver), and of mu_
  // before taking it back: nobody waits for the GIL holding mu_.
  void wait_exited() {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(mu_);
    if (pump_exited_ || std::this_thread::get_id() == pump_id_) return;
    done_.wait(lock, [&] { return pump_exited_; });
  }

  void pump() {
    std::unique_lock<std::mutex> lock(mu_);
    pump_id_ = std::this_thread::get_id();
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stopped, everything delivered
      std::deque<Record> batch;
      batch.swap(queue_);
      lock.unlock();
      deliver(batch);
      lock.lock();
      delivered_ += batch.size();
      done_.notify_all();
    }
    pump_id_ = {};
    pump_exited_ = true;
    done_.notify_all();
  }

  void deliver(const std::deque<Record>& batch) {
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing()) return;  // too late for Python; disable() at exit normally comes first
#else
    if (_Py_IsFinalizing()) return;
#endif
    py::gil_scoped_acquire gil;
    for (const Record& r : batch) {
      try {
        logger_.attr("log")(r.level, r.message);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("ferry log record");
      }
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;  // the pump: a record or stop
  std::condition_variable done_;  // flush() and wait_exited(): records delivered, the pump gone
  std::deque<Record> queue_;
  uint64_t pushed_ = 0;
  uint64_t delivered_ = 0;
  bool enabled_ = false;
  bool stop_ = false;
  bool pump_exited_ = true;
  pid_t pid_ = 0;
  std::thread::id pump_id_;
  py::object logger_;  // logging.getLogger("ferry"), used by the pump under the GIL
};

// Never destroyed: the core's sink and a detached pump may refer to it until the process ends.
Forwarder& forwarder() {
  static auto* f = new Forwarder();
  return *f;
}

}  // namespace

void init_log(py::module_& m) {
  m.def(
      "forward_logs",
      [](bool enabled) {
        if (enabled) {
          forwarder().enable();
        } else {
          forwarder().disable();
        }
      },
      py::arg("enabled") = true,
      "Whether ferry's log records go to Python's logging, logger 'ferry' (the default from import on), or "
      "to stderr as the C++ library writes them ('[ferry] [warning] ...'). Levels map to DEBUG, INFO, "
      "WARNING, ERROR and CRITICAL, trace to 5. FERRY_LOG_LEVEL (warn unless set) still decides which "
      "records ferry makes; the 'ferry' logger's level and handlers decide where they go. Records reach "
      "logging from a thread of ferry's, soon after they are made; flush_logs() waits for them.");
  m.def("log_forwarding", [] { return forwarder().enabled(); },
        "True while ferry's log records go to Python's logging (forward_logs()).");
  m.def("flush_logs", [](double timeout_s) { return forwarder().flush(timeout_s); }, py::arg("timeout_s") = 5.0,
        "Waits until every ferry log record made before the call has been handed to logging (True), or "
        "timeout_s passed (False).");

  forwarder().enable();
  // Registered before the atexit hook that closes rollout workers (init_update), so it runs after it:
  // their last records still reach logging. Then stderr, before the interpreter finalizes.
  py::module_::import("atexit").attr("register")(py::cpp_function([] { forwarder().disable(); }));
}

}  // namespace ferry::python
