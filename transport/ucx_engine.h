// ucx internals shared by the sending and receiving ends: the worker with its progress thread.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "transport/handle.h"

namespace ferry::transport::ucx {

constexpr unsigned kDataId = 1;
// A sender's last message before a clean close. It carries the reply endpoint (as data does), which
// is how the receiver tells which sender is done; the receiver then reports OK and closes its end.
constexpr unsigned kByeId = 2;

inline Status ucs_error(std::string_view what, ucs_status_t st) {
  return Status::unavailable(fmt::format("ucx {}: {}", what, ucs_status_string(st)));
}

// The worker and its progress thread. Work for the worker is queued with run() from any thread.
class Engine {
 public:
  // The owning transport stops the engine on its own thread; the last reference may be dropped on
  // the progress thread (by a finished command), which then only frees memory.
  void stop() {
    if (!thread_.joinable() || std::this_thread::get_id() == thread_.get_id()) return;
    run([this] { stop_ = true; });
    thread_.join();
  }

  ~Engine() {
    stop();
    if (thread_.joinable()) thread_.detach();  // only when destroyed on the progress thread itself
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
    if (efd_ >= 0) close(efd_);
  }

  Status init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return ucs_error("read config", st);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // memory is mapped and unmapped from the caller's threads
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return ucs_error("init", st);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return ucs_error("create worker", st);
    st = ucp_worker_get_efd(worker_, &worker_fd_);
    if (st != UCS_OK) return ucs_error("worker event fd", st);
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context_, &attr) == UCS_OK) {
      cuda_capable_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    }
    efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) return Status::internal("ucx: eventfd failed");
    thread_ = std::thread([this] { loop(); });
    return ok_status();
  }

  void run(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(fn));
    }
    const uint64_t one = 1;
    if (write(efd_, &one, sizeof one) < 0) {
      // The counter is saturated, so the thread is awake anyway.
    }
  }

  // Runs `fn` on the progress thread and waits for the Status it reports through `done`.
  Status call(const std::function<void(std::shared_ptr<CompletionState>)>& fn, Deadline deadline) {
    auto done = std::make_shared<CompletionState>();
    run([fn, done] { fn(done); });
    return done->wait(deadline);
  }

  ucp_worker_h worker() const { return worker_; }

  // Registers [data, data + size) with the context once; nullptr when it cannot be (empty, or a
  // transport that refuses it), and then UCX registers what it needs per operation. Any thread.
  ucp_mem_h map(void* data, size_t size) {
    if (data == nullptr || size == 0) return nullptr;
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = data;
    mp.length = size;
    ucp_mem_h memh = nullptr;
    return ucp_mem_map(context_, &mp, &memh) == UCS_OK ? memh : nullptr;
  }
  void unmap(ucp_mem_h memh) {
    if (memh != nullptr) (void)ucp_mem_unmap(context_, memh);
  }
  bool cuda_capable() const { return cuda_capable_; }

  // Closes `ep` on the progress thread without waiting: a flushing close (what was sent before
  // reaches the peer first) unless `force`. `then` runs on the progress thread with the close's
  // status once it is done, at once if it finishes here. Never progresses the worker itself, so it
  // may be called from inside a UCX callback.
  void close_ep(ucp_ep_h ep, bool force, std::function<void(ucs_status_t)> then = {}) {
    struct Ctx {
      Engine* engine;
      std::function<void(ucs_status_t)> then;
    };
    auto* ctx = new Ctx{this, std::move(then)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // 0: UCP_EP_CLOSE_MODE_FLUSH
    p.cb.send = [](void* req, ucs_status_t st, void* ud) {
      auto* c = static_cast<Ctx*>(ud);
      --c->engine->closing_;
      if (c->then) c->then(st);
      delete c;
      ucp_request_free(req);
    };
    p.user_data = ctx;
    ++closing_;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
    if (!UCS_PTR_IS_PTR(req)) {
      --closing_;
      if (ctx->then) ctx->then(UCS_PTR_STATUS(req));
      delete ctx;
    }
  }

 private:
  void loop() {
    while (!stop_) {
      std::deque<std::function<void()>> cmds;
      {
        std::lock_guard<std::mutex> lock(mu_);
        cmds.swap(commands_);
      }
      for (auto& c : cmds) c();
      if (stop_) break;
      while (ucp_worker_progress(worker_) != 0) {
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!commands_.empty()) continue;
      }
      if (ucp_worker_arm(worker_) != UCS_OK) continue;  // events pending: progress again
      pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {efd_, POLLIN, 0}};
      poll(fds, 2, 100);
      uint64_t v;
      while (read(efd_, &v, sizeof v) > 0) {
      }
    }
    // Finish the endpoint closes still under way (each holds what its callback needs), then flush
    // what is left so no request outlives the worker.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (closing_ > 0 && std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
    for (int i = 0; i < 1000 && ucp_worker_progress(worker_) != 0; ++i) {
    }
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int efd_ = -1;
  bool cuda_capable_ = false;
  bool stop_ = false;  // progress thread only
  int closing_ = 0;    // endpoint closes under way; progress thread only
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;
  std::thread thread_;
};

}  // namespace ferry::transport::ucx
