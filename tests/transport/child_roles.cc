// The child processes of the conformance suite (harness.h's Child): spawning a copy of this test
// binary in one role, reading what it reports, and the roles themselves (run_child_role()).
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <spdlog/sinks/sink.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>

#include "core/asio.h"
#include "core/log.h"
#include "tests/transport/harness.h"
#include "tests/transport/stranger.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry::transport::testing {

Child::~Child() {
  kill_now();
  if (fd_ >= 0) close(fd_);
}

Result<std::unique_ptr<Child>> Child::spawn(const std::string& role, const std::string& transport,
                                            const std::string& blob, int device) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Status::internal(std::string("pipe: ") + std::strerror(errno));
  // Everything the child needs is built before fork: after it, the child only dups and execs.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "FERRY_CONFORMANCE_", 18) != 0) env_strings.emplace_back(*e);
  }
  constexpr int kChildFd = 100;
  env_strings.push_back("FERRY_CONFORMANCE_ROLE=" + role);
  env_strings.push_back("FERRY_CONFORMANCE_TRANSPORT=" + transport);
  env_strings.push_back("FERRY_CONFORMANCE_BLOB=" + blob);
  env_strings.push_back("FERRY_CONFORMANCE_FD=" + std::to_string(kChildFd));
  env_strings.push_back("FERRY_CONFORMANCE_DEVICE=" + std::to_string(device));
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=ConformanceChild.Run";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  const pid_t pid = fork();
  if (pid < 0) return Status::internal(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    if (dup2(fds[1], kChildFd) < 0) _exit(127);
    execve(exe.c_str(), argv, envp.data());
    _exit(127);
  }
  close(fds[1]);
  auto c = std::make_unique<Child>();
  c->pid_ = pid;
  c->fd_ = fds[0];
  return c;
}

std::optional<std::string> Child::read_line(Deadline deadline) {
  for (;;) {
    const size_t nl = pending_.find('\n');
    if (nl != std::string::npos) {
      std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{fd_, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char buf[4096];
    const ssize_t n = read(fd_, buf, sizeof buf);
    if (n <= 0) return std::nullopt;
    pending_.append(buf, static_cast<size_t>(n));
  }
}

void Child::kill_now() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

namespace {

void report(int fd, const std::string& line) {
  const std::string s = line + "\n";
  if (write(fd, s.data(), s.size()) < 0) {
    // The parent has gone; nothing to report to.
  }
}

Status run_receiver(Transport& t, int fd) {
  std::mutex mu;
  std::condition_variable cv;
  bool first = true;
  FERRY_ASSIGN_OR_RETURN(std::string blob, t.listen(
                                               [&](const ReceivedBucket&) {
                                                 std::unique_lock<std::mutex> lock(mu);
                                                 if (first) report(fd, "bucket");
                                                 first = false;
                                                 // Stall mid-transfer: the parent kills us here.
                                                 cv.wait_for(lock, 60s);
                                                 return Status::deadline_exceeded("child receiver stalled");
                                               },
                                               [](const Status&) {}, suite_admit()));
  report(fd, "blob " + blob);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, 60s);
  return ok_status();
}

// Hands every log line's text to `fn` (it formats nothing).
class LogWatch final : public spdlog::sinks::sink {
 public:
  explicit LogWatch(std::function<void(std::string_view)> fn) : fn_(std::move(fn)) {}
  void log(const spdlog::details::log_msg& msg) override { fn_(std::string_view(msg.payload.data(), msg.payload.size())); }
  void flush() override {}
  void set_pattern(const std::string&) override {}
  void set_formatter(std::unique_ptr<spdlog::formatter>) override {}

 private:
  std::function<void(std::string_view)> fn_;
};

// A tcp receiver with few descriptors to spare: it lowers RLIMIT_NOFILE to kSpare above the
// descriptors it holds once listening, reports its blob, says when an accept failed
// ("accept_failed"), and reports "bucket" for every bucket it gets.
Status run_fd_limited_receiver(Transport& t, int fd) {
  constexpr rlim_t kSpare = 8;
  std::mutex mu;
  std::condition_variable cv;
  bool warming = true;
  int warm_buckets = 0, warm_closes = 0, unadmitted = 0;
  std::atomic<bool> told{false};
  ::ferry::logger().sinks().push_back(std::make_shared<LogWatch>([&](std::string_view text) {
    if (text.find("accept failed") != std::string_view::npos && !told.exchange(true)) report(fd, "accept_failed");
    if (text.find("before admission") != std::string_view::npos) {
      std::lock_guard<std::mutex> lock(mu);
      ++unadmitted;
      cv.notify_all();
    }
  }));
  if (::ferry::logger().level() > spdlog::level::warn) ::ferry::logger().set_level(spdlog::level::warn);
  FERRY_ASSIGN_OR_RETURN(std::string blob, t.listen(
                                               [&](const ReceivedBucket&) {
                                                 std::lock_guard<std::mutex> lock(mu);
                                                 if (!warming) report(fd, "bucket");
                                                 ++warm_buckets;
                                                 cv.notify_all();
                                                 return ok_status();
                                               },
                                               [&](const Status&) {
                                                 std::lock_guard<std::mutex> lock(mu);
                                                 ++warm_closes;
                                                 cv.notify_all();
                                               },
                                               suite_admit()));
  // UBSan's first check of an object's dynamic type opens a pipe, which fails once descriptors run
  // out (a false "invalid vptr" report). So the receiver's paths are walked once while there are
  // descriptors: a sender that delivers a bucket and closes, a peer that closes unadmitted, an
  // accept error's log line.
  {
    FERRY_ASSIGN_OR_RETURN(auto tx, create_transport("tcp"));
    FERRY_ASSIGN_OR_RETURN(auto conn, tx->connect(blob, in(10s), kCredential));
    uint8_t byte = 1;
    FERRY_ASSIGN_OR_RETURN(auto region, tx->register_memory(&byte, 1, Device::cpu()));
    FERRY_ASSIGN_OR_RETURN(auto h, conn->post(*region, 0, 1));
    FERRY_RETURN_IF_ERROR(h->wait(in(10s)));
    conn.reset();
    tx->shutdown();
    const int raw = raw_tcp_socket(blob);
    if (raw >= 0) close(raw);
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, 10s, [&] { return warm_buckets == 1 && warm_closes == 1 && unadmitted == 1; })) {
      return Status::deadline_exceeded("fd_limited_receiver: the warm-up did not finish");
    }
    warming = false;
  }
  FERRY_LOG_WARN("fd_limited_receiver: ready ({}, {})", boost::system::error_code(EMFILE, boost::system::system_category()).message(),
                 boost::system::error_code(boost::asio::error::eof).message());
  rlim_t open_fds = 0;  // below the report descriptor (100), which stays open above the limit
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.' && std::atoi(e->d_name) < 100) ++open_fds;
    }
    closedir(d);
  }
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = open_fds + kSpare;
  if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return Status::internal(std::string("setrlimit: ") + std::strerror(errno));
  report(fd, "blob " + blob);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, 60s, [] { return false; });  // the parent kills us
  return ok_status();
}

// Posts stream_schedule() with up to four buckets in flight, then closes cleanly.
Status run_stream_sender(Transport& t, const std::string& blob, int device, int fd) {
  FERRY_ASSIGN_OR_RETURN(auto conn, t.connect(blob, in(30s), kCredential));
  const auto schedule = stream_schedule();
  size_t end = 0;
  for (const auto& [off, size] : schedule) end = std::max(end, off + size);
  FERRY_ASSIGN_OR_RETURN(Source src, Source::create(t, end, device));
  std::deque<std::unique_ptr<TransferHandle>> pending;
  for (size_t i = 0; i < schedule.size(); ++i) {
    if (pending.size() == 4) {
      FERRY_RETURN_IF_ERROR(pending.front()->wait(in(60s)).with_context("bucket " + std::to_string(i - 4)));
      pending.pop_front();
    }
    src.write(schedule[i].first, schedule[i].second, kStreamSender, i);
    FERRY_ASSIGN_OR_RETURN(auto h, conn->post(src.region(), schedule[i].first, schedule[i].second));
    pending.push_back(std::move(h));
  }
  for (auto& h : pending) FERRY_RETURN_IF_ERROR(h->wait(in(60s)));
  conn.reset();
  report(fd, "done");
  return ok_status();
}

Status run_sender(Transport& t, const std::string& blob, int device, int fd) {
  FERRY_ASSIGN_OR_RETURN(auto conn, t.connect(blob, in(10s), kCredential));
  constexpr size_t kBucket = 8 << 20;
  constexpr size_t kSlots = 4;
  FERRY_ASSIGN_OR_RETURN(Source src, Source::create(t, kBucket * kSlots, device));
  std::deque<std::unique_ptr<TransferHandle>> pending;
  const Deadline end = in(60s);
  for (uint64_t seq = 0; Clock::now() < end; ++seq) {
    if (pending.size() == kSlots) {
      FERRY_RETURN_IF_ERROR(pending.front()->wait(end));
      pending.pop_front();
      if (seq == kSlots) report(fd, "sent");
    }
    const size_t off = (seq % kSlots) * kBucket;
    src.write(off, kBucket, 7, seq);
    FERRY_ASSIGN_OR_RETURN(auto h, conn->post(src.region(), off, kBucket));
    pending.push_back(std::move(h));
  }
  return ok_status();
}

}  // namespace

Status run_child_role() {
  const char* role = std::getenv("FERRY_CONFORMANCE_ROLE");
  const char* name = std::getenv("FERRY_CONFORMANCE_TRANSPORT");
  const char* blob = std::getenv("FERRY_CONFORMANCE_BLOB");
  const char* fd_text = std::getenv("FERRY_CONFORMANCE_FD");
  if (!role || !name || !blob || !fd_text) return Status::invalid_argument("child role environment is incomplete");
  const int fd = std::atoi(fd_text);
  const char* device_text = std::getenv("FERRY_CONFORMANCE_DEVICE");
  const int device = device_text ? std::atoi(device_text) : 0;
#if defined(FERRY_HAVE_CUDA)
  if (cuda_device_available() && cudaSetDevice(device) != cudaSuccess) {
    return Status::unavailable("child: cannot use CUDA device " + std::to_string(device));
  }
#endif
  FERRY_ASSIGN_OR_RETURN(auto t, create_transport(name));
  if (std::string(role) == "receiver") return run_receiver(*t, fd);
  if (std::string(role) == "sender") return run_sender(*t, blob, device, fd);
  if (std::string(role) == "stream_sender") return run_stream_sender(*t, blob, device, fd);
  if (std::string(role) == "fd_limited_receiver") return run_fd_limited_receiver(*t, fd);
  return Status::invalid_argument(std::string("unknown child role ") + role);
}

}  // namespace ferry::transport::testing
