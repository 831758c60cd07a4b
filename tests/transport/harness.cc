#include "tests/transport/harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <unistd.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "core/device_copy.h"

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
  return [](std::string_view credential) -> Result<Admission> {
    if (credential == kCredential) return Admission{kIdentity, 0};
    if (credential == kSecondCredential) return Admission{kSecondIdentity, 0};
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
  if (b.device.is_cuda() != device_memory_) {
    ADD_FAILURE() << "a bucket said to be on " << b.device.to_string() << " from a transport that moves "
                  << (device_memory_ ? "device" : "host") << " memory";
  }
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

}  // namespace ferry::transport::testing
