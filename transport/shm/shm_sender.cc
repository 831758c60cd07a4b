// shm, sending end: a thread per connection copies each posted bucket into free ring slots once;
// the receiver's callback then reads it in place (shm_transport.cc).

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "transport/admission.h"
#include "transport/handle.h"
#include "transport/shm/shm_ring.h"

namespace ferry::transport {
namespace {

using namespace shm;
using std::chrono::milliseconds;

constexpr size_t kSlack = 1 << 20;              // room for a bucket's header beside its payload
constexpr size_t kMaxRingBytes = size_t{1} << 30;  // per connection; larger buckets go as fragments
constexpr size_t kMinSlotBytes = 1 << 20;
constexpr auto kPollBound = std::chrono::microseconds(2000);  // futex sleeps recheck liveness this often
constexpr int kSpins = 64;

std::string receiver_reason(const RingHeader& h) {
  return std::string(h.reason, strnlen(h.reason, sizeof h.reason));
}

// The sending end: a ring segment and a thread that copies queued buckets into it.
class ShmConnection final : public Connection, public std::enable_shared_from_this<ShmConnection> {
 public:
  // `stall`: no progress for this long is DeadlineExceeded.
  ShmConnection(Segment listener, Segment ring, milliseconds stall)
      : listener_(std::move(listener)), ring_(std::move(ring)), stall_(stall) {
    lh_ = static_cast<ListenerHeader*>(listener_.data());
    rh_ = static_cast<RingHeader*>(ring_.data());
  }
  ~ShmConnection() override { stop(); }

  void start() {
    thread_ = std::thread([this] { run(); });  // stop() joins it before the object goes
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      if (!queue_.empty() || busy_) fail_locked(Status::aborted("shm connection closed with transfers pending"));
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    uint32_t expected = kOpen;
    rh_->sender_state.compare_exchange_strong(expected, kClosed);
    ring_bell();
  }

  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& region, size_t offset, size_t size) override {
    if (offset > region.size() || size > region.size() - offset) {
      return Status::out_of_range(fmt::format("post of {} bytes at {} exceeds a {}-byte region", size, offset, region.size()));
    }
    auto state = std::make_shared<CompletionState>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) {
        state->complete(failure_);
      } else {
        queue_.push_back({static_cast<const uint8_t*>(region.data()) + offset, size, state});
      }
    }
    cv_.notify_all();
    std::weak_ptr<ShmConnection> weak = weak_from_this();
    return std::unique_ptr<TransferHandle>(std::make_unique<StateHandle>(state, [weak] {
      if (auto c = weak.lock()) c->cancelled();
    }));
  }

  void abort() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fail_locked(Status::aborted("shm connection aborted"));
    }
    cv_.notify_all();
  }


 private:
  struct Op {
    const uint8_t* data;
    size_t size;
    std::shared_ptr<CompletionState> state;
  };

  // A handle was aborted: a queued op is skipped by run(); a half-published one aborts the ring.
  void cancelled() { cv_.notify_all(); }

  void fail_locked(Status st) {
    if (failure_.ok()) failure_ = st;
    for (Op& op : queue_) op.state->complete(failure_);
    queue_.clear();
    if (busy_) current_->complete(failure_);
    rh_->sender_state.store(kAborted, std::memory_order_release);
    ring_bell();
  }

  void ring_bell() {
    lh_->doorbell.fetch_add(1, std::memory_order_release);
    futex_wake(lh_->doorbell);
  }

  void run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty() || stopping_ || !failure_.ok(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
        if (op.state->done()) continue;  // aborted before it started
        busy_ = true;
        current_ = op.state;
      }
      bool skipped = false;
      Status st = send(op, &skipped);
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      current_.reset();
      if (!st.ok()) {
        fail_locked(st);
        op.state->complete(failure_);
      } else if (!skipped) {
        op.state->complete(ok_status());
      }
    }
  }

  // Waits until slot `i` is empty for the current lap; fails on abort, a closed or dead receiver,
  // or no progress for the stall bound.
  Status wait_free(SlotHeader& slot, uint32_t want, const Op& op, bool started, bool* skipped) {
    const auto stall_end = Clock::now() + stall_;
    auto next_check = Clock::now();
    for (int spin = 0;; ++spin) {
      const uint32_t t = slot.turn.load(std::memory_order_acquire);
      if (t == want) return ok_status();
      if (op.state->done()) {
        if (started) return Status::aborted("shm transfer aborted mid-bucket");
        *skipped = true;
        return ok_status();
      }
      if (rh_->receiver_state.load(std::memory_order_acquire) != kOpen) {
        return Status::unavailable("shm receiver closed the connection: " + receiver_reason(*rh_));
      }
      if (Clock::now() >= next_check) {
        if (!process_alive(lh_->receiver_pid)) {
          return Status::unavailable(fmt::format("shm receiver process {} died", lh_->receiver_pid));
        }
        if (lh_->closed.load(std::memory_order_acquire) != 0) return Status::unavailable("shm receiver shut down");
        if (Clock::now() > stall_end) {
          return Status::deadline_exceeded(fmt::format("shm receiver freed no slot in {} ms", stall_.count()));
        }
        next_check = Clock::now() + milliseconds(10);
      }
      if (spin < kSpins) {
        std::this_thread::yield();
      } else {
        futex_wait(slot.turn, t, kPollBound);
      }
    }
  }

  Status send(const Op& op, bool* skipped) {
    const uint64_t payload = rh_->slot_bytes;
    uint64_t off = 0;
    do {
      const uint32_t i = static_cast<uint32_t>(record_ % rh_->slots);
      const uint32_t lap = static_cast<uint32_t>(record_ / rh_->slots);
      SlotHeader& slot = *slot_header(ring_.data(), i);
      FERRY_RETURN_IF_ERROR(wait_free(slot, 2 * lap, op, off > 0, skipped));
      if (*skipped) return ok_status();
      const uint64_t n = std::min<uint64_t>(payload, op.size - off);
      if (n > 0) std::memcpy(slot_payload(ring_.data(), *rh_, i), op.data + off, n);
      slot.total = op.size;
      slot.offset = off;
      slot.length = n;
      slot.turn.store(2 * lap + 1, std::memory_order_release);
      ring_bell();
      ++record_;
      off += n;
    } while (off < op.size);
    return ok_status();
  }

  Segment listener_;
  Segment ring_;
  const milliseconds stall_;
  ListenerHeader* lh_;
  RingHeader* rh_;
  uint64_t record_ = 0;  // touched only by the copying thread
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool busy_ = false;
  std::shared_ptr<CompletionState> current_;
  bool stopping_ = false;
  Status failure_;
  std::thread thread_;
};

// The caller's handle: closing it stops the copying thread.
class OwnedShmConnection final : public Connection {
 public:
  explicit OwnedShmConnection(std::shared_ptr<ShmConnection> c) : c_(std::move(c)) {}
  ~OwnedShmConnection() override { c_->stop(); }
  Result<std::unique_ptr<TransferHandle>> post(const MemoryRegion& r, size_t o, size_t s) override {
    return c_->post(r, o, s);
  }
  void abort() override { c_->abort(); }
  bool same_host() const override { return true; }

 private:
  std::shared_ptr<ShmConnection> c_;
};

}  // namespace

namespace shm {

Result<std::unique_ptr<Connection>> connect(const std::string& blob, Deadline deadline, const ConnectOptions& options,
                                            const TransportOptions& transport) {
  const std::string_view credential = options.credential;
  FERRY_RETURN_IF_ERROR(check_credential(credential));
  constexpr std::string_view kScheme = "shm://";
  const size_t slash = blob.find('/', kScheme.size());
  if (!blob.starts_with(kScheme) || slash == std::string::npos) {
    return Status::invalid_argument("shm: malformed endpoint '" + blob + "'");
  }
  if (blob.substr(kScheme.size(), slash - kScheme.size()) != boot_id()) {
    return Status::unavailable("shm: the receiver runs on another machine");
  }
  FERRY_ASSIGN_OR_RETURN(Segment listener, Segment::open(blob.substr(slash)));
  auto* lh = static_cast<ListenerHeader*>(listener.data());
  if (listener.size() < sizeof(ListenerHeader) || lh->magic != kListenerMagic) {
    return Status::invalid_argument("shm: " + blob + " is not a ferry listener");
  }
  if (lh->closed.load(std::memory_order_acquire) != 0) return Status::unavailable("shm: receiver has shut down");

  const int64_t in_flight = options.max_in_flight > 0 ? options.max_in_flight : transport.buckets_in_flight;
  const uint32_t slots = static_cast<uint32_t>(std::clamp<int64_t>(in_flight, 2, 16));
  auto page_round = [](uint64_t n) { return (n + kPage - 1) / kPage * kPage; };
  // A slot holds the largest bucket the connection will carry: the plan's when the sender knows it
  // (a small model's update does not reserve rings for 64 MiB buckets), else the transport's.
  uint64_t slot_bytes = page_round(options.max_bucket_bytes > 0 ? options.max_bucket_bytes : transport.bucket_bytes + kSlack);
  if (options.reserve_bytes > 0) {
    slot_bytes = std::min<uint64_t>(slot_bytes, std::max<uint64_t>(page_round(options.reserve_bytes), kMinSlotBytes));
  }
  slot_bytes = std::min<uint64_t>(slot_bytes, std::max<uint64_t>(kMaxRingBytes / slots / kPage * kPage, kMinSlotBytes));
  Segment ring;
  for (;;) {
    auto r = Segment::create(segment_name('r'), payload_offset(slots) + slots * slot_bytes);
    if (r.ok()) {
      ring = std::move(*r);
      break;
    }
    if (r.status().code() != StatusCode::kResourceExhausted || slot_bytes <= kMinSlotBytes) return r.status();
    slot_bytes = std::max<uint64_t>(kMinSlotBytes, page_round(slot_bytes / 2));
  }
  auto* rh = static_cast<RingHeader*>(ring.data());  // fresh pages are zero: every turn and state starts at 0
  rh->slots = slots;
  rh->slot_bytes = slot_bytes;
  rh->segment_bytes = ring.size();
  rh->sender_pid = getpid();
  rh->magic = kRingMagic;

  ListenerEntry* entry = nullptr;
  for (auto& e : lh->entries) {
    uint32_t expected = kFree;
    if (e.state.compare_exchange_strong(expected, kClaiming, std::memory_order_acq_rel)) {
      entry = &e;
      break;
    }
  }
  if (entry == nullptr) return Status::resource_exhausted(fmt::format("shm: the receiver serves {} senders already", kMaxSenders));
  entry->sender_pid = getpid();
  std::snprintf(entry->ring_name, sizeof entry->ring_name, "%s", ring.name().c_str());
  entry->credential_bytes = static_cast<uint32_t>(credential.size());
  if (!credential.empty()) std::memcpy(entry->credential, credential.data(), credential.size());
  // The receiver takes back an entry claimed for too long; then it is no longer ours to offer.
  uint32_t claiming = kClaiming;
  if (!entry->state.compare_exchange_strong(claiming, kOffered, std::memory_order_acq_rel)) {
    return Status::deadline_exceeded("shm: the receiver took back the sender entry before it was offered");
  }
  lh->doorbell.fetch_add(1, std::memory_order_release);
  futex_wake(lh->doorbell);
  for (;;) {
    const uint32_t st = entry->state.load(std::memory_order_acquire);
    if (st == kAccepted) break;
    if (st == kRefused) {
      entry->state.store(kFree, std::memory_order_release);
      return Status::unavailable("shm: the receiver could not map the ring " + ring.name());
    }
    if (st == kDenied) {
      entry->state.store(kFree, std::memory_order_release);
      return Status::unauthenticated("shm: the receiver refused the connection's credential");
    }
    if (!process_alive(lh->receiver_pid) || lh->closed.load(std::memory_order_acquire) != 0) {
      return Status::unavailable("shm: the receiver went away while connecting");
    }
    if (Clock::now() >= deadline) {
      uint32_t offered = kOffered;
      if (entry->state.compare_exchange_strong(offered, kFree, std::memory_order_acq_rel)) {
        return Status::deadline_exceeded("shm: the receiver did not accept the connection before the deadline");
      }
      continue;  // accepted just now
    }
    futex_wait(entry->state, st, kPollBound);
  }
  ring.unlink();  // mapped on both ends now; nothing is left behind if either dies
  auto c = std::make_shared<ShmConnection>(std::move(listener), std::move(ring), transport.timeout);
  c->start();
  return std::unique_ptr<Connection>(std::make_unique<OwnedShmConnection>(std::move(c)));
}

}  // namespace shm
}  // namespace ferry::transport
