// ucx internals shared by the sending and receiving ends: the worker with its progress thread.
#pragma once

#include <dirent.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "transport/handle.h"
#include "transport/listen_host.h"
#include "transport/ucx/ucx_log.h"

namespace ferry::transport::ucx {

constexpr unsigned kDataId = 1;
// A sender's last message before a clean close. It carries the reply endpoint (as data does), which
// is how the receiver tells which sender is done; the receiver then reports OK and closes its end.
constexpr unsigned kByeId = 2;
// A sender's last message before it closes an aborted connection: the receiver reports Aborted
// (and drops what it still had queued from it) without waiting for UCX to see the close.
constexpr unsigned kAbortId = 3;
// A receiver's answer to a sender whose connection it closes (a bucket it refused, its callback's
// error): the sender fails its pending buckets with the reason carried as the message's data.
constexpr unsigned kRefuseId = 4;
// A receiver's answer to a same-host sender's goodbye: every bucket before it has been handled, so
// the sender may now drop its endpoint (ucx_transport.cc says why it waits for this).
constexpr unsigned kByeAckId = 5;
// A sender's first message on every endpoint (every lane): its credential, as the message's data.
// The receiver takes nothing else from an endpoint before it has admitted the credential.
constexpr unsigned kHelloId = 6;

// A same-host connection moves its buckets over several lanes, each an endpoint on a worker and
// progress thread of its own (ucx_transport.cc), each to a listener and progress thread of its own
// at the receiver, so that the copies of two buckets run on two cores. Every message on a lane
// carries this header: the receivers join the lanes of one connection by `stream` and deliver its
// buckets in `seq` order. Messages without it (senders on other hosts)
// form a stream of their own endpoint, in arrival order.
constexpr uint32_t kMaxSameHostLanes = 2;
struct LaneHeader {
  uint64_t stream = 0;  // unique per connection on this host: the sender's pid and a counter
  uint64_t seq = 0;     // the bucket's place in the connection (data messages)
  uint32_t lanes = 1;   // how many lanes the connection has: each says goodbye
  uint32_t reserved = 0;
};

// This host's identity in a listener's blob: the kernel's boot id, the same in every process and
// container of one boot of one machine, different on any other. A sender whose blob names its own
// boot id is on the receiver's host (see ucx_transport.cc for what that changes); empty if unknown.
inline const std::string& host_identity() {
  static const std::string id = [] {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string s;
    std::getline(f, s);
    return s;
  }();
  return id;
}

inline Status ucs_error(std::string_view what, ucs_status_t st) {
  return Status::unavailable(fmt::format("ucx {}: {}", what, ucs_status_string(st)));
}

// The network devices UCX may use (UCX_NET_DEVICES) so that nothing it listens on is bound beyond
// `listen_host`: UCX's tcp transport listens on the address of every interface it uses, so only
// the interface holding `listen_host` is given, beside every RDMA port (which listen on no
// socket). Empty: no restriction (`listen_host` is a wildcard).
inline Result<std::string> listen_net_devices(const std::string& listen_host) {
  FERRY_ASSIGN_OR_RETURN(std::string devices, interface_of(listen_host));
  if (devices.empty()) return devices;
  if (DIR* hcas = opendir("/sys/class/infiniband")) {
    while (dirent* hca = readdir(hcas)) {
      if (hca->d_name[0] == '.') continue;
      const std::string ports_dir = fmt::format("/sys/class/infiniband/{}/ports", hca->d_name);
      if (DIR* ports = opendir(ports_dir.c_str())) {
        while (dirent* port = readdir(ports)) {
          if (port->d_name[0] != '.') devices += fmt::format(",{}:{}", hca->d_name, port->d_name);
        }
        closedir(ports);
      }
    }
    closedir(hcas);
  }
  return devices;
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
    // Closes the worker never finished (a peer that stopped progressing; see loop()): their
    // requests went with the worker, so their contexts go here.
    for (CloseCtx* c : closes_) delete c;
    if (context_) ucp_cleanup(context_);
    if (efd_ >= 0) close(efd_);
  }

  // `indirect_ids`: wire ids of endpoints and requests go through UCX's id map instead of being
  // raw pointers (UCX does this by itself only for endpoints with peer error handling, which
  // same-host endpoints do not use: ucx_transport.cc). A message that arrives for an endpoint or
  // request already closed is then dropped instead of read through a stale pointer: a receiver may
  // close while a sender's buckets are on their way. The transport's own engine (its receiver, and
  // its endpoints to other hosts) asks for them. A same-host connection's private engine does not:
  // UCX tracks every request with an indirect id on its endpoint and asserts that none is left
  // when the endpoint is destroyed, which teardown() does with requests outstanding; and nothing
  // can arrive for a request of a worker that is gone. A user's own UCX_PROTO_INDIRECT_ID is left
  // as it is.
  // `listen_host`: the address its listeners bind (TransportOptions::listen_host).
  Status init(const std::string& listen_host, bool indirect_ids = true) {
    listen_host_ = listen_host;
    route_ucx_log();  // before UCX reads its configuration, which may already log
    std::string devices;
    if (std::getenv("UCX_NET_DEVICES") == nullptr) {
      FERRY_ASSIGN_OR_RETURN(devices, listen_net_devices(listen_host));
    }
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return ucs_error("read config", st);
    if (indirect_ids && std::getenv("UCX_PROTO_INDIRECT_ID") == nullptr) {
      st = ucp_config_modify(config, "PROTO_INDIRECT_ID", "on");
      if (st != UCS_OK) {
        ucp_config_release(config);
        return ucs_error("config PROTO_INDIRECT_ID", st);
      }
    }
    if (!devices.empty()) {  // a user's UCX_NET_DEVICES is left as it is
      st = ucp_config_modify(config, "NET_DEVICES", devices.c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return ucs_error("config NET_DEVICES=" + devices, st);
      }
    }
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
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.id = kRefuseId;
    h.cb = &Engine::on_refuse;
    h.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &h);
    h.id = kByeAckId;
    h.cb = &Engine::on_bye_ack;
    if (st == UCS_OK) st = ucp_worker_set_am_recv_handler(worker_, &h);
    if (st != UCS_OK) return ucs_error("set handler", st);
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

  // False, and `fn` is dropped, once the progress thread has stopped: a connection's handle may
  // outlive the connection's private engine (ucx_transport.cc), and a command queued then would
  // never run and would keep what it holds alive.
  bool run(std::function<void()> fn) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopped_) {
        lock.unlock();
        fn = nullptr;
        return false;
      }
      commands_.push_back(std::move(fn));
    }
    const uint64_t one = 1;
    if (write(efd_, &one, sizeof one) < 0) {
      // The counter is saturated, so the thread is awake anyway.
    }
    return true;
  }

  // Runs `fn` on the progress thread and waits for the Status it reports through `done`.
  Status call(const std::function<void(std::shared_ptr<CompletionState>)>& fn, Deadline deadline) {
    auto done = std::make_shared<CompletionState>();
    if (!run([fn, done] { fn(done); })) return Status::unavailable("ucx: the connection's engine has stopped");
    return done->wait(deadline);
  }

  ucp_worker_h worker() const { return worker_; }

  // Destroys the worker now, with every endpoint and request still on it: once this returns UCX
  // reads and writes no memory a request named. Requests UCX cancels call their callbacks from in
  // here; others never do. Progress thread only, never from inside a UCX callback; the engine then
  // only runs commands.
  void teardown() {
    if (worker_ == nullptr) return;
    ucp_worker_destroy(std::exchange(worker_, nullptr));
    for (CloseCtx* c : closes_) delete c;  // their requests went with the worker
    closes_.clear();
    refusals_.clear();
  }

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
  const std::string& listen_host() const { return listen_host_; }

  // Closes `ep` on the progress thread without waiting: a flushing close (what was sent before
  // reaches the peer first) unless `force`. `then` runs on the progress thread with the close's
  // status once it is done, at once if it finishes here. Never progresses the worker itself, so it
  // may be called from inside a UCX callback.
  //
  // UCX allows a forced close only on an endpoint with peer error handling (ucp.h; ucp_ep_close_nbx
  // answers UCS_ERR_INVALID_PARAM otherwise and closes nothing). An endpoint without it (a
  // receiver's, accepted from a sender on the same host: ucx_transport.cc) is therefore closed
  // flushing: it completes once its outstanding operations have, or the endpoint failed (a dead
  // peer's connection drops), and the peer's side closed too.
  void close_ep(ucp_ep_h ep, bool force, std::function<void(ucs_status_t)> then = {}) {
    auto* ctx = new CloseCtx{this, std::move(then)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = [](void* req, ucs_status_t st, void* ud) {
      auto* c = static_cast<CloseCtx*>(ud);
      c->engine->closes_.erase(c);
      if (c->then) c->then(st);
      delete c;
      ucp_request_free(req);
    };
    p.user_data = ctx;
    closes_.insert(ctx);
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // 0: UCP_EP_CLOSE_MODE_FLUSH
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
    if (force && UCS_PTR_IS_ERR(req) && UCS_PTR_STATUS(req) == UCS_ERR_INVALID_PARAM) {
      p.flags = 0;  // no peer error handling on this endpoint: flush instead
      req = ucp_ep_close_nbx(ep, &p);
    }
    if (!UCS_PTR_IS_PTR(req)) {
      closes_.erase(ctx);
      if (ctx->then) ctx->then(UCS_PTR_STATUS(req));
      delete ctx;
    }
  }

  // What to do when the receiver at the other end of sender endpoint `ep` refuses it (kRefuseId),
  // until forget_refusal(ep). Progress thread only.
  // A goodbye's acknowledgement (kByeAckId) is reported the same way, with `why` empty and `acked`.
  void on_refusal(ucp_ep_h ep, std::function<void(const std::string&, bool acked)> fn) { refusals_[ep] = std::move(fn); }
  void forget_refusal(ucp_ep_h ep) { refusals_.erase(ep); }

  // Runs `fn` on the progress thread once the worker has nothing left to progress: after every
  // message that had already arrived was handled. Progress thread only.
  void after_drain(std::function<void()> fn) { drained_.push_back(std::move(fn)); }

  // Runs `fn` on the progress thread at `when` (or as soon after as the thread gets to it); never if
  // the engine stops first. Progress thread only.
  void at(std::chrono::steady_clock::time_point when, std::function<void()> fn) { timers_.emplace(when, std::move(fn)); }

 private:
  // Runs the timers that are due; returns how long the thread may sleep until the next (ms, at most 100).
  int run_timers() {
    const auto now = std::chrono::steady_clock::now();
    while (!timers_.empty() && timers_.begin()->first <= now) {
      auto fn = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      fn();
    }
    if (timers_.empty()) return 100;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(timers_.begin()->first - now).count() + 1;
    return static_cast<int>(std::min<int64_t>(left, 100));
  }

  void loop() {
    while (!stop_) {
      std::deque<std::function<void()>> cmds;
      {
        std::lock_guard<std::mutex> lock(mu_);
        cmds.swap(commands_);
      }
      for (auto& c : cmds) c();
      if (stop_) break;
      const int sleep_ms = run_timers();
      if (worker_ == nullptr) {  // torn down: commands only
        std::unique_lock<std::mutex> lock(mu_);
        if (!commands_.empty()) continue;
        lock.unlock();
        pollfd fd{efd_, POLLIN, 0};
        poll(&fd, 1, sleep_ms);
        uint64_t v;
        while (read(efd_, &v, sizeof v) > 0) {
        }
        continue;
      }
      while (ucp_worker_progress(worker_) != 0) {
      }
      if (!drained_.empty()) {
        std::deque<std::function<void()>> fns;
        fns.swap(drained_);
        for (auto& f : fns) f();
        continue;  // they may have queued more work for the worker
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!commands_.empty()) continue;
      }
      if (ucp_worker_arm(worker_) != UCS_OK) continue;  // events pending: progress again
      pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {efd_, POLLIN, 0}};
      poll(fds, 2, sleep_ms);
      uint64_t v;
      while (read(efd_, &v, sizeof v) > 0) {
      }
    }
    // Finish the endpoint closes still under way (each holds what its callback needs), then flush
    // what is left so no request outlives the worker.
    // A flushing close waits for its peer, which may have stopped progressing: such closes are
    // given up at the deadline. What their callbacks hold (a connection, which holds this engine)
    // is dropped now; the contexts themselves go with the worker (~Engine).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (worker_ != nullptr && !closes_.empty() && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    for (int i = 0; worker_ != nullptr && i < 1000 && ucp_worker_progress(worker_) != 0; ++i) {
    }
    drained_.clear();
    timers_.clear();
    refusals_.clear();
    std::deque<std::function<void(ucs_status_t)>> dropped;
    for (CloseCtx* c : closes_) dropped.push_back(std::move(c->then));
    std::deque<std::function<void()>> unrun;  // queued after the stop; they hold connections
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      unrun.swap(commands_);
    }
    unrun.clear();
    dropped.clear();  // may drop the last reference to this engine: nothing may follow
  }

  static ucs_status_t on_refuse(void* arg, const void*, size_t, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Engine*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    auto it = self->refusals_.find(param->reply_ep);
    if (it == self->refusals_.end()) return UCS_OK;
    std::string why = "(no reason given)";
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) && data != nullptr) why.assign(static_cast<const char*>(data), length);
    auto fn = it->second;  // it may forget itself
    fn(why, false);
    return UCS_OK;
  }

  static ucs_status_t on_bye_ack(void* arg, const void*, size_t, void*, size_t, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Engine*>(arg);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
    auto it = self->refusals_.find(param->reply_ep);
    if (it == self->refusals_.end()) return UCS_OK;
    auto fn = it->second;
    fn(std::string(), true);
    return UCS_OK;
  }

  struct CloseCtx {
    Engine* engine;
    std::function<void(ucs_status_t)> then;
  };

  std::string listen_host_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int efd_ = -1;
  bool cuda_capable_ = false;
  bool stop_ = false;  // progress thread only
  std::set<CloseCtx*> closes_;  // endpoint closes under way; progress thread only
  std::deque<std::function<void()>> drained_;  // after_drain(); progress thread only
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> timers_;  // at(); progress thread only
  std::map<ucp_ep_h, std::function<void(const std::string&, bool)>> refusals_;  // progress thread only
  std::mutex mu_;
  bool stopped_ = false;  // under mu_: the progress thread has left its loop
  std::deque<std::function<void()>> commands_;
  std::thread thread_;
};

}  // namespace ferry::transport::ucx
