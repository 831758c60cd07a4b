#include "transport/shm/shm_ring.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

namespace ferry::transport::shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futex words must be plain 32-bit integers");

Segment::~Segment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (owns_name_) shm_unlink(name_.c_str());
}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) munmap(data_, size_);
    if (owns_name_) shm_unlink(name_.c_str());
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    name_ = std::move(o.name_);
    owns_name_ = std::exchange(o.owns_name_, false);
  }
  return *this;
}

static Status sys_error(const std::string& what) {
  const int e = errno;
  const StatusCode code = (e == ENOSPC || e == ENOMEM) ? StatusCode::kResourceExhausted
                          : (e == ENOENT)              ? StatusCode::kUnavailable
                                                       : StatusCode::kInternal;
  return Status(code, fmt::format("shm {}: {}", what, std::strerror(e)));
}

Result<Segment> Segment::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return sys_error("create " + name);
  Segment s;
  s.name_ = name;
  s.owns_name_ = true;
  // posix_fallocate gives real pages now, so a full /dev/shm is an error here, not a SIGBUS later.
  int err = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? posix_fallocate(fd, 0, static_cast<off_t>(bytes)) : errno;
  if (err != 0) {
    close(fd);
    errno = err;
    return sys_error(fmt::format("reserve {} bytes for {}", bytes, name));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return sys_error("map " + name);
  s.data_ = p;
  s.size_ = bytes;
  return s;
}

Result<Segment> Segment::open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return sys_error("open " + name);
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return Status::unavailable("shm: segment " + name + " is empty");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return sys_error("map " + name);
  Segment s;
  s.name_ = name;
  s.data_ = p;
  s.size_ = bytes;
  return s;
}

void Segment::unlink() {
  if (owns_name_) shm_unlink(name_.c_str());
  owns_name_ = false;
}

std::string segment_name(char kind) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("/ferry-shm-{}-{}-{}", getpid(), counter.fetch_add(1), kind);
}

void sweep_stale_segments() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    int pid = 0;
    if (std::sscanf(e->d_name, "ferry-shm-%d-", &pid) == 1 && pid > 0 && !process_alive(pid)) {
      shm_unlink(("/" + std::string(e->d_name)).c_str());
    }
  }
  closedir(dir);
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id.empty() ? "unknown" : id;
}

bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed process that its parent has not reaped yet still answers kill(); it is a zombie.
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(in, line)) return true;  // another pid namespace: assume alive
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || (line[paren + 2] != 'Z' && line[paren + 2] != 'X');
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::microseconds max_wait) {
  timespec ts{static_cast<time_t>(max_wait.count() / 1000000), static_cast<long>(max_wait.count() % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace ferry::transport::shm
