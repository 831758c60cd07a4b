// Pieces the transport conformance suite shares: tagged payloads, a receiving inbox that records
// what arrived, source buffers on the transport's memory kind, and child processes for peer death.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/buffer.h"
#include "transport/transport.h"

namespace ferry::transport::testing {

using namespace std::chrono_literals;

inline Deadline in(std::chrono::milliseconds d) { return Clock::now() + d; }

// A payload of `size` bytes: the first 16 (when they fit) carry sender and sequence numbers, the
// rest a pattern derived from both, so any misplaced or torn byte changes its hash.
void fill_payload(uint8_t* dst, size_t size, uint64_t sender, uint64_t seq);
uint64_t hash_bytes(const uint8_t* data, size_t size);

struct Received {
  size_t size = 0;
  uint64_t hash = 0;
  int64_t peer = -1;  // the identity admission returned for its connection
  uint64_t sender = ~0ull;  // from the payload header; ~0 when the bucket is shorter than 16 bytes
  uint64_t seq = ~0ull;
};

// The credentials the suite's senders present, and the identities the suite's admit() returns for
// them; anything else is refused.
inline constexpr std::string_view kCredential = "conformance-sender";
inline constexpr int64_t kIdentity = 42;
inline constexpr std::string_view kSecondCredential = "conformance-second-sender";
inline constexpr int64_t kSecondIdentity = 43;
AdmitCallback suite_admit();

// Records every bucket a receiver gets. The callback can be held at a gate to build backpressure.
class Inbox {
 public:
  explicit Inbox(bool device_memory) : device_memory_(device_memory) {}
  BucketCallback callback();
  PeerClosedCallback closed_callback();

  // Holds every callback until open_gate() (each held callback gives up after 60 s).
  void close_gate();
  void open_gate();

  bool wait_for_count(size_t n, Deadline deadline);
  bool wait_for_closed(size_t n, Deadline deadline);
  std::vector<Received> received();
  std::vector<Status> closed();

 private:
  Status on_bucket(const ReceivedBucket& b);

  bool device_memory_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool gate_open_ = true;
  std::vector<Received> received_;
  std::vector<Status> closed_;
};

// Bytes a sender posts from: host memory, or device memory for device transports.
class Source {
 public:
  // On `device` for device transports (the sending transport's device); host memory otherwise.
  static Result<Source> create(Transport& t, size_t bytes, int device = 0);
  // Writes a payload at `offset` and returns its hash.
  uint64_t write(size_t offset, size_t size, uint64_t sender, uint64_t seq);
  const MemoryRegion& region() const { return *region_; }
  size_t size() const { return buffer_.size(); }

 private:
  Buffer buffer_;
  bool device_ = false;
  std::unique_ptr<MemoryRegion> region_;
};

// This process's listening TCP sockets: their inode and local address ("127.0.0.1", "::1", ...).
std::map<uint64_t, std::string> listening_tcp_sockets();

// Bytes of memory this machine can still give, from /proc/meminfo.
uint64_t available_memory_bytes();

// A copy of this test binary running one role (see conformance_test.cc's ConformanceChild), with a
// pipe from its reports to us.
class Child {
 public:
  ~Child();
  // `device`: the CUDA device the child makes current before it creates its transport.
  static Result<std::unique_ptr<Child>> spawn(const std::string& role, const std::string& transport,
                                              const std::string& blob, int device = 0);
  // Reads one '\n'-terminated line the child reports, or nothing at the deadline or end of file.
  std::optional<std::string> read_line(Deadline deadline);
  void kill_now();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string pending_;
};

// The schedule the "stream_sender" child posts, as (offset, size) into its source; the parent
// regenerates payload (sender kStreamSender, seq i) to check each bucket.
constexpr uint64_t kStreamSender = 11;
std::vector<std::pair<size_t, size_t>> stream_schedule();

// CUDA devices visible here (0 without CUDA).
int cuda_device_count();
// Makes `device` current on this thread; false (with a test failure saying why) when it cannot.
bool use_device(int device);

// Entry for the child side: the role named by FERRY_CONFORMANCE_ROLE; reports on the fd named by
// FERRY_CONFORMANCE_FD. Returns when there is nothing left to do (normally it is killed first).
Status run_child_role();

}  // namespace ferry::transport::testing
