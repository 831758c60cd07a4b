#include "tests/transport/harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <spdlog/sinks/sink.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <set>
#include <thread>

#include "core/asio.h"
#include "core/device_copy.h"
#include "core/log.h"
#include "tests/transport/stranger.h"

#if defined(FERRY_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace ferry::transport::testing {

void fill_payload(uint8_t* dst, size_t size, uint64_t sender, uint64_t seq) {
  size_t i = 0;
  if (size >= 16) {
    std::memcpy(dst, &sender, 8);
    std::memcpy(dst + 8, &seq, 8);
    i = 16;
  }
  uint64_t x = (sender * 0x9E3779B97F4A7C15ull) ^ (seq + 1) * 0xD1B54A32D192ED03ull;
  for (; i + 8 <= size; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(dst + i, &x, 8);
  }
  for (; i < size; ++i) dst[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

uint64_t hash_bytes(const uint8_t* data, size_t size) { return XXH3_64bits(data, size); }

AdmitCallback suite_admit() {
  return [](std::string_view credential) -> Result<int64_t> {
    if (credential == kCredential) return kIdentity;
    if (credential == kSecondCredential) return kSecondIdentity;
    return Status::unauthenticated("not a credential of the suite");
  };
}

BucketCallback Inbox::callback() {
  return [this](const ReceivedBucket& b) { return on_bucket(b); };
}

PeerClosedCallback Inbox::closed_callback() {
  return [this](const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.push_back(why);
    cv_.notify_all();
  };
}

Status Inbox::on_bucket(const ReceivedBucket& b) {
  const uint8_t* data = b.data;
  const size_t size = b.size;
  std::vector<uint8_t> host;
  const uint8_t* bytes = data;
#if defined(FERRY_HAVE_CUDA)
  if (device_memory_ && size > 0) {
    host.resize(size);
    const cudaError_t e = cudaMemcpy(host.data(), data, size, cudaMemcpyDefault);
    if (e != cudaSuccess) {
      return Status::internal(std::string("inbox: copy of a device bucket failed: ") + cudaGetErrorString(e));
    }
    bytes = host.data();
  }
#endif
  Received r;
  r.size = size;
  r.hash = hash_bytes(bytes, size);
  r.peer = b.peer;
  if (size >= 16) {
    std::memcpy(&r.sender, bytes, 8);
    std::memcpy(&r.seq, bytes + 8, 8);
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, 60s, [&] { return gate_open_; })) return Status::deadline_exceeded("inbox gate stayed shut");
  received_.push_back(r);
  cv_.notify_all();
  return ok_status();
}

void Inbox::close_gate() {
  std::lock_guard<std::mutex> lock(mu_);
  gate_open_ = false;
}

void Inbox::open_gate() {
  std::lock_guard<std::mutex> lock(mu_);
  gate_open_ = true;
  cv_.notify_all();
}

bool Inbox::wait_for_count(size_t n, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [&] { return received_.size() >= n; });
}

bool Inbox::wait_for_closed(size_t n, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [&] { return closed_.size() >= n; });
}

std::vector<Received> Inbox::received() {
  std::lock_guard<std::mutex> lock(mu_);
  return received_;
}

std::vector<Status> Inbox::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

Result<Source> Source::create(Transport& t, size_t bytes, int device) {
  Source s;
  s.device_ = t.capabilities().device_memory && !t.capabilities().host_memory;
  const Device dev = s.device_ ? Device::cuda(device) : Device::cpu();
  FERRY_ASSIGN_OR_RETURN(s.buffer_, Buffer::allocate(std::max<size_t>(bytes, 64), dev));
  FERRY_ASSIGN_OR_RETURN(s.region_, t.register_memory(s.buffer_.data(), s.buffer_.size(), dev));
  return s;
}

uint64_t Source::write(size_t offset, size_t size, uint64_t sender, uint64_t seq) {
  uint8_t* dst = buffer_.data_as<uint8_t>() + offset;
  std::vector<uint8_t> host;
  if (device_) {
    host.resize(size);
    dst = host.data();
  }
  fill_payload(dst, size, sender, seq);
  const uint64_t h = hash_bytes(dst, size);
#if defined(FERRY_HAVE_CUDA)
  if (device_ && size > 0) {
    // The payload must be on the device before post() (as for any caller); the copy waits for itself
    // only, not for the device (whose transfers may be stalled on purpose, by a shut inbox gate).
    Status st = copy_now(buffer_.device().index, buffer_.data_as<uint8_t>() + offset, host.data(), size);
    if (!st.ok()) ADD_FAILURE() << "source: copy to the device failed: " << st.to_string();
  }
#endif
  return h;
}

std::vector<std::pair<size_t, size_t>> stream_schedule() {
  // Empty, tiny and unaligned buckets, one larger than the 64 MiB default bucket (a cuda_ipc slot:
  // it travels as fragments), then many small ones back to back.
  std::vector<std::pair<size_t, size_t>> s;
  const size_t sizes[] = {0, 1, 3, 4097, (1 << 20) + 13, (size_t{64} << 20) + 5, 7};
  size_t off = 1;
  for (size_t n : sizes) {
    s.emplace_back(off, n);
    off += n + 3;
  }
  for (size_t i = 0; i < 64; ++i) {
    s.emplace_back(off, (256 << 10) + i);
    off += (256 << 10) + 64;
  }
  return s;
}

int cuda_device_count() {
#if defined(FERRY_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

bool use_device(int device) {
#if defined(FERRY_HAVE_CUDA)
  const cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    ADD_FAILURE() << "cudaSetDevice(" << device << "): " << cudaGetErrorString(e);
    return false;
  }
#else
  (void)device;
#endif
  return true;
}

std::map<uint64_t, std::string> listening_tcp_sockets() {
  std::set<uint64_t> mine;  // this process's socket inodes
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      char target[64] = {};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
      unsigned long long inode = 0;
      if (n > 0 && std::sscanf(target, "socket:[%llu]", &inode) == 1) mine.insert(inode);
    }
    closedir(d);
  }
  std::map<uint64_t, std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      char local[64] = {}, remote[64] = {};
      unsigned state = 0;
      unsigned long long inode = 0;
      // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
      if (std::sscanf(line.c_str(), " %*s %63s %63s %x %*s %*s %*s %*s %*s %llu", local, remote, &state, &inode) != 4) continue;
      if (state != 0x0A || mine.count(inode) == 0) continue;  // TCP_LISTEN
      std::string hex(local, std::strchr(local, ':') ? std::strchr(local, ':') - local : std::strlen(local));
      uint8_t bytes[16] = {};
      const size_t len = hex.size() / 2;
      for (size_t i = 0; i < len && i < 16; ++i) bytes[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
      // The kernel prints each 32-bit word in host order (little endian here).
      for (size_t w = 0; w + 4 <= len; w += 4) {
        std::swap(bytes[w], bytes[w + 3]);
        std::swap(bytes[w + 1], bytes[w + 2]);
      }
      char text[INET6_ADDRSTRLEN] = {};
      inet_ntop(len == 4 ? AF_INET : AF_INET6, bytes, text, sizeof text);
      out[inode] = text;
    }
  }
  return out;
}

uint64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

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
