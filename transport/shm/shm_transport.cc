// shm, receiving end and the transport: one thread serves every sender's ring, so callbacks never
// run concurrently; a whole bucket in one slot goes to the callback in place, and one larger than a
// slot is assembled from its fragments into a pooled buffer that is handed over
// (ReceivedBucket::owner). Each sender's admission sets the largest bucket it may deliver.
#include "transport/shm/shm_transport.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/log.h"
#include "core/shared_buffers.h"
#include "transport/admission.h"
#include "transport/handle.h"
#include "transport/shm/shm_ring.h"

namespace ferry::transport {
namespace {

using namespace shm;

constexpr auto kPollBound = std::chrono::microseconds(2000);
constexpr auto kLivenessEvery = std::chrono::milliseconds(10);
constexpr int kSpins = 64;

class ShmReceiver {
 public:
  ShmReceiver(Segment listener, uint64_t default_max_bucket, BucketCallback on_bucket, PeerClosedCallback on_closed,
              AdmitCallback admit)
      : listener_(std::move(listener)), lh_(static_cast<ListenerHeader*>(listener_.data())),
        default_max_bucket_(default_max_bucket),
        on_bucket_(std::move(on_bucket)), on_closed_(std::move(on_closed)), admit_(std::move(admit)) {
    thread_ = std::thread([this] { run(); });
  }
  ~ShmReceiver() { stop(); }

  void stop() {
    if (stop_.exchange(true)) return;
    lh_->closed.store(1, std::memory_order_release);
    lh_->doorbell.fetch_add(1, std::memory_order_release);
    futex_wake(lh_->doorbell);
    if (thread_.joinable()) thread_.join();
    for (auto& p : peers_) tell_sender(*p, kClosed, "receiver shut down");
    peers_.clear();
  }

 private:
  struct Peer {
    Segment ring;
    RingHeader* rh;
    ListenerEntry* entry;
    int64_t identity = 0;     // what admission returned
    uint64_t max_bucket = 0;  // the largest bucket admission lets it deliver
    uint64_t record = 0;
    // The bucket being assembled from fragments (assembly_total bytes, assembled so far), in a
    // buffer from assembly_buffers_.
    std::shared_ptr<Buffer> assembly;
    uint64_t assembly_total = 0;
    uint64_t assembled = 0;
  };

  void tell_sender(Peer& p, PeerState state, const std::string& why) {
    std::snprintf(p.rh->reason, sizeof p.rh->reason, "%s", why.c_str());
    p.rh->receiver_state.store(state, std::memory_order_release);
    for (uint32_t i = 0; i < p.rh->slots; ++i) futex_wake(slot_header(p.ring.data(), i)->turn);
    p.entry->state.store(kFree, std::memory_order_release);
  }

  // An entry claimed and not offered within kAdmissionDeadline goes back to the free list (its
  // claimant died or never meant to offer): the table cannot be filled with silent claims. So does
  // a refusal its sender never took back.
  void reclaim(ListenerEntry& e, Clock::time_point& since, Clock::time_point now) {
    uint32_t state = e.state.load(std::memory_order_acquire);
    if (state != kClaiming && state != kRefused && state != kDenied) {
      since = {};
      return;
    }
    if (since == Clock::time_point{}) since = now;
    if (now - since < kAdmissionDeadline) return;
    since = {};
    if (!e.state.compare_exchange_strong(state, kFree, std::memory_order_acq_rel) || state != kClaiming) return;
    log_unadmitted("shm", fmt::format("pid {}", e.sender_pid),
                   fmt::format("claimed a sender entry and offered nothing within {} ms", kAdmissionDeadline.count()));
  }

  // Judges an offer by its credential before the sender's ring is even opened.
  bool admitted(ListenerEntry& e, Admission* granted) {
    const uint32_t n = e.credential_bytes;
    const std::string who = fmt::format("pid {}", e.sender_pid);
    Result<Admission> a = Status::invalid_argument(fmt::format("a {}-byte credential announced", n));
    if (n <= kMaxCredentialBytes) a = admit_peer(admit_, std::string(e.credential, n), "shm", who, default_max_bucket_);
    else log_unadmitted("shm", who, a.status().message());
    if (!a.ok()) {
      e.state.store(kDenied, std::memory_order_release);
      futex_wake(e.state);
      return false;
    }
    *granted = *a;
    return true;
  }

  bool accept_offers() {
    bool progress = false;
    const auto now = Clock::now();
    for (int k = 0; k < kMaxSenders; ++k) {
      ListenerEntry& e = lh_->entries[k];
      reclaim(e, claimed_since_[k], now);
      if (e.state.load(std::memory_order_acquire) != kOffered) continue;
      progress = true;
      Admission granted;
      if (!admitted(e, &granted)) continue;
      const std::string name(e.ring_name, strnlen(e.ring_name, sizeof e.ring_name));
      auto ring = Segment::open(name);
      auto* rh = ring.ok() ? static_cast<RingHeader*>(ring->data()) : nullptr;
      if (rh == nullptr || ring->size() < sizeof(RingHeader) || rh->magic != kRingMagic || rh->slots == 0 ||
          payload_offset(rh->slots) + rh->slots * rh->slot_bytes > ring->size()) {
        FERRY_LOG_WARN("shm: refused sender {}: {}", e.sender_pid,
                       ring.ok() ? "malformed ring" : ring.status().message());
        e.state.store(kRefused, std::memory_order_release);
        futex_wake(e.state);
        continue;
      }
      auto p = std::make_unique<Peer>();
      p->ring = std::move(*ring);
      p->rh = rh;
      p->entry = &e;
      p->identity = granted.peer;
      p->max_bucket = granted.max_bucket_bytes;
      peers_.push_back(std::move(p));
      e.state.store(kAccepted, std::memory_order_release);
      futex_wake(e.state);
    }
    return progress;
  }

  // Hands every full slot of `p` to the callback, in order. Sets `*closing` when the link must end.
  bool drain(Peer& p, std::optional<Status>* closing) {
    bool progress = false;
    const RingHeader& h = *p.rh;
    for (;;) {
      const uint32_t i = static_cast<uint32_t>(p.record % h.slots);
      const uint32_t lap = static_cast<uint32_t>(p.record / h.slots);
      SlotHeader& slot = *slot_header(p.ring.data(), i);
      if (slot.turn.load(std::memory_order_acquire) != 2 * lap + 1) return progress;
      progress = true;
      const uint8_t* data = slot_payload(p.ring.data(), h, i);
      const uint64_t total = slot.total, off = slot.offset, len = slot.length;
      Status st;
      if (len > h.slot_bytes || off > total || len > total - off) {
        st = Status::data_loss(fmt::format("shm: malformed slot ({} bytes at {} of {})", len, off, total));
      } else if (off == 0 && total > p.max_bucket) {
        // A slot may be larger than the connection's limit (the sender sized its ring).
        st = bucket_over_limit("shm", total, p.max_bucket);
      } else if (off == 0 && len == total) {
        // In place, with no owner: the slot is the sender's again once the callback returns, and the
        // ring's slots go round in order, so a slot kept past the callback would stall the sender at
        // it (and every bucket behind it) until let go.
        st = on_bucket_(ReceivedBucket{data, len, p.identity, Device::cpu(), nullptr});
      } else {
        if (off == 0) {
          p.assembly.reset();
          p.assembled = 0;
          auto b = assembly_buffers_.take(total);
          if (b.ok()) {
            p.assembly = std::move(*b);
            p.assembly_total = total;
          } else {
            st = b.status().with_context(fmt::format("shm: a buffer for a {}-byte bucket", total));
          }
        }
        if (st.ok() && (p.assembly == nullptr || off != p.assembled || p.assembly_total != total)) {
          st = Status::data_loss("shm: bucket fragments out of order");
        }
        if (st.ok()) {
          std::memcpy(p.assembly->data_as<uint8_t>() + off, data, len);
          p.assembled = off + len;
          if (p.assembled == total) {
            st = on_bucket_(ReceivedBucket{p.assembly->data_as<uint8_t>(), total, p.identity, Device::cpu(), p.assembly});
            // Ours no longer: a buffer the callback did not keep goes back to the pool now, one it
            // kept when its last holder lets go (on any thread, even after this receiver is gone).
            p.assembly.reset();
            p.assembled = 0;
          }
        }
      }
      slot.turn.store(2 * lap + 2, std::memory_order_release);
      futex_wake(slot.turn);
      ++p.record;
      if (!st.ok()) {
        *closing = st;
        return true;
      }
    }
  }

  void run() {
    auto next_check = Clock::now();
    int idle = 0;
    while (!stop_.load(std::memory_order_acquire)) {
      const uint32_t bell = lh_->doorbell.load(std::memory_order_acquire);
      bool progress = accept_offers();
      const bool check = Clock::now() >= next_check;
      if (check) next_check = Clock::now() + kLivenessEvery;
      for (size_t k = 0; k < peers_.size();) {
        Peer& p = *peers_[k];
        // Read the sender's state before draining: whatever it published before closing is drained.
        const uint32_t sender = p.rh->sender_state.load(std::memory_order_acquire);
        std::optional<Status> closing;
        progress |= drain(p, &closing);
        if (!closing && sender == kClosed) closing = ok_status();
        if (!closing && sender == kAborted) closing = Status::aborted("shm sender aborted the connection");
        if (!closing && check && !process_alive(p.rh->sender_pid)) {
          closing = Status::unavailable(fmt::format("shm sender process {} died", p.rh->sender_pid));
        }
        if (!closing) {
          ++k;
          continue;
        }
        tell_sender(p, closing->ok() ? kClosed : kAborted, closing->message());
        peers_.erase(peers_.begin() + static_cast<std::ptrdiff_t>(k));
        if (on_closed_) on_closed_(*closing);
        progress = true;
      }
      if (progress) {
        idle = 0;
      } else if (++idle < kSpins) {
        std::this_thread::yield();
      } else {
        futex_wait(lh_->doorbell, bell, kPollBound);
      }
    }
  }

  Segment listener_;
  ListenerHeader* lh_;
  const uint64_t default_max_bucket_;  // for a sender admitted without a limit of its own
  BucketCallback on_bucket_;
  PeerClosedCallback on_closed_;
  AdmitCallback admit_;
  Clock::time_point claimed_since_[kMaxSenders] = {};  // when each entry was first seen claimed; thread only
  // Buffers buckets larger than a slot are assembled in. Memory stays bounded: a few idle ones are
  // kept (pages already touched), the rest are freed when let go.
  SharedBufferPool assembly_buffers_{2};
  std::atomic<bool> stop_{false};
  std::vector<std::unique_ptr<Peer>> peers_;  // touched by the thread, then by stop() after the join
  std::thread thread_;
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const TransportOptions& options) : options_(options) {}
  ~ShmTransport() override { shutdown(); }
  std::string_view name() const override { return "shm"; }
  Capabilities capabilities() const override {
    Capabilities c{true, false, true, false, -1};
    c.same_host_shared_memory = true;
    return c;
  }

  Result<std::unique_ptr<MemoryRegion>> register_memory(void* data, size_t size, Device device) override {
    if (!device.is_cpu()) return Status::invalid_argument("shm moves host memory only; got " + device.to_string());
    return std::unique_ptr<MemoryRegion>(std::make_unique<HostRegion>(data, size));
  }

  Result<std::string> listen(BucketCallback on_bucket, PeerClosedCallback on_closed, AdmitCallback admit) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) return Status::failed_precondition("shm: listen() was already called on this transport");
    sweep_stale_segments();
    const size_t bytes = (sizeof(ListenerHeader) + kPage - 1) / kPage * kPage;
    FERRY_ASSIGN_OR_RETURN(Segment listener, Segment::create(segment_name('l'), bytes));
    auto* lh = static_cast<ListenerHeader*>(listener.data());
    lh->receiver_pid = getpid();
    lh->magic = kListenerMagic;
    std::string blob = "shm://" + boot_id() + listener.name();
    receiver_ = std::make_unique<ShmReceiver>(std::move(listener), options_.max_received_bucket(), std::move(on_bucket),
                                              std::move(on_closed), std::move(admit));
    return blob;
  }

  Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline,
                                              const ConnectOptions& options) override {
    auto c = shm::connect(blob, deadline, options, options_);
    if (!c.ok()) return c.status().with_context("shm connect to " + blob);
    return c;
  }

  void shutdown() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (receiver_) receiver_->stop();
  }

 private:
  const TransportOptions options_;
  std::mutex mu_;
  std::unique_ptr<ShmReceiver> receiver_;
};

}  // namespace

Result<std::unique_ptr<Transport>> create_shm_transport(const TransportOptions& options) {
  if (access("/dev/shm", W_OK) != 0) return Status::unavailable("shm: /dev/shm is not writable here");
  return std::unique_ptr<Transport>(std::make_unique<ShmTransport>(options));
}

}  // namespace ferry::transport
