// The shared-memory layout of the shm transport, and the few system calls around it.
//
// A receiver owns one listener segment: a table of sender entries and a doorbell word. Each sender
// creates its own ring segment (so memory is spent only per live connection), offers its name in a
// free entry with its credential, and unlinks it once the receiver has admitted it (by the credential,
// before it maps anything of the sender's) and mapped it. An entry claimed but not offered within
// kAdmissionDeadline is taken back. A ring has `slots` fixed-size slots;
// record n goes to slot n % slots, whose turn word is 2*lap while empty and 2*lap+1 while full.
// Buckets larger than a slot travel as fragments and are assembled on the receiving side.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "transport/transport.h"

namespace ferry::transport::shm {

constexpr uint64_t kListenerMagic = 0x324c2d797272'6566ull;  // "ferry-L2"
constexpr uint64_t kRingMagic = 0x31522d797272'6566ull;      // "ferry-R1"
constexpr int kMaxSenders = 32;
constexpr size_t kPage = 4096;

// kRefused: the ring could not be mapped; kDenied: the credential was not admitted.
enum EntryState : uint32_t { kFree = 0, kClaiming = 1, kOffered = 2, kAccepted = 3, kRefused = 4, kDenied = 5 };
enum PeerState : uint32_t { kOpen = 0, kClosed = 1, kAborted = 2 };

struct alignas(64) ListenerEntry {
  std::atomic<uint32_t> state;
  int32_t sender_pid;
  char ring_name[64];
  uint32_t credential_bytes;  // the receiver reads at most kMaxCredentialBytes of `credential`
  char credential[kMaxCredentialBytes];
};

struct ListenerHeader {
  uint64_t magic;
  int32_t receiver_pid;
  std::atomic<uint32_t> closed;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by senders on every offer, publish and close
  ListenerEntry entries[kMaxSenders];
};

struct alignas(64) SlotHeader {
  std::atomic<uint32_t> turn;
  uint32_t reserved;
  uint64_t total;   // bytes of the whole bucket
  uint64_t offset;  // of this fragment within the bucket
  uint64_t length;  // of this fragment
};

struct RingHeader {
  uint64_t magic;
  uint32_t slots;
  int32_t sender_pid;
  uint64_t slot_bytes;
  uint64_t segment_bytes;
  std::atomic<uint32_t> sender_state;    // PeerState
  std::atomic<uint32_t> receiver_state;  // PeerState; kAborted: the receiver refused a bucket
  char reason[256];                      // why the receiver closed, NUL-terminated
};

constexpr size_t kSlotTableOffset = kPage;
inline size_t payload_offset(uint32_t slots) {
  return (kSlotTableOffset + slots * sizeof(SlotHeader) + kPage - 1) / kPage * kPage;
}
inline SlotHeader* slot_header(void* base, uint32_t i) {
  return reinterpret_cast<SlotHeader*>(static_cast<uint8_t*>(base) + kSlotTableOffset) + i;
}
inline uint8_t* slot_payload(void* base, const RingHeader& h, uint32_t i) {
  return static_cast<uint8_t*>(base) + payload_offset(h.slots) + i * h.slot_bytes;
}

// A mapped POSIX shared-memory segment; unmaps (and unlinks, when it owns the name) on destruction.
class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(Segment&& o) noexcept { *this = std::move(o); }
  Segment& operator=(Segment&& o) noexcept;

  // Creates `name` with `bytes` backed by real pages (ResourceExhausted when /dev/shm is full).
  static Result<Segment> create(const std::string& name, size_t bytes);
  static Result<Segment> open(const std::string& name);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name; the mapping stays valid.
  void unlink();

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool owns_name_ = false;
};

// A fresh segment name for this process: "/ferry-shm-<pid>-<n>-<kind>".
std::string segment_name(char kind);
// Unlinks segments left behind by ferry processes that no longer exist.
void sweep_stale_segments();
// This machine's boot id: two ends with the same one share /dev/shm only if also in one container,
// which connect() finds out by opening the segment.
std::string boot_id();
bool process_alive(pid_t pid);

// Sleeps while `word` still holds `seen`, at most `max_wait` (a bound so callers recheck liveness).
void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::microseconds max_wait);
void futex_wake(std::atomic<uint32_t>& word);

// Sender side (shm_sender.cc): connects to a listener blob "shm://<boot id>/<segment>", offering
// `credential` with its ring.
// The ring has `transport.buckets_in_flight` slots, each of `options.max_bucket_bytes` (when set,
// else `transport.bucket_bytes` and room for headers), up to a bound; its pages are reserved and
// mapped now. A connection that makes no progress for `transport.timeout` fails.
Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline, const ConnectOptions& options,
                                            const TransportOptions& transport);

}  // namespace ferry::transport::shm
