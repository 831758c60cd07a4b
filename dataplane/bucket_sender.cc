#include "dataplane/bucket_sender.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "core/log.h"
#include "dataplane/bucket.h"
#include "dataplane/bucket_sender_destination.h"
#include "dataplane/credential.h"
#include "dataplane/piece_pack.h"
#include "sharding/buckets.h"
#include "sharding/planner.h"
#include "transport/ipc_share.h"
#include "transport/transport.h"

namespace ferry::dataplane {
namespace {

using Clock = std::chrono::steady_clock;


Clock::time_point deadline(std::chrono::milliseconds timeout) { return Clock::now() + timeout; }

// What a connection reserves per bucket for a rank that takes direct reads: a bucket of 2,048
// references and the allocations they announce is a few hundred KiB.
constexpr uint64_t kReferenceReserve = uint64_t{4} << 20;

std::mutex sealed_hook_mu;
std::atomic<bool> sealed_hook_set{false};
SealedBucketHook& sealed_hook() {
  static SealedBucketHook hook;
  return hook;
}

}  // namespace

size_t bucket_capacity(const sharding::Plan& plan, size_t dst) {
  return std::max<uint64_t>(std::min<uint64_t>(plan.bucket_bytes, plan.bytes_per_dst[dst]), plan.max_row_bytes) +
         kBucketHeaderRoom;
}

void set_sealed_bucket_hook_for_testing(SealedBucketHook hook) {
  std::lock_guard<std::mutex> lock(sealed_hook_mu);
  sealed_hook_set = static_cast<bool>(hook);
  sealed_hook() = std::move(hook);
}

BucketSender::BucketSender(BucketSenderSettings settings, std::function<void()> on_posted)
    : settings_(settings), on_posted_(std::move(on_posted)), exporter_(std::make_unique<transport::IpcExporter>()) {
  if (settings_.delta != DeltaMode::kOff) {
    bases_ = std::make_unique<DeltaBases>(settings_.delta_max_bytes, settings_.delta_copy_on_device);
  }
}

uint64_t BucketSender::delta_copy_bytes() const { return bases_ ? bases_->bytes() : 0; }

BucketSender::~BucketSender() {
  // Connections go before their transport, bucket memory only after the transport's thread ended.
  for (auto& d : dests_) d.conn.reset();
  transports_.clear();
  dests_.clear();
}

std::vector<uint64_t> BucketSender::buckets() const {
  std::vector<uint64_t> out;
  for (const auto& d : dests_) out.push_back(d.buckets);
  return out;
}

Status BucketSender::prepare(uint64_t version, std::shared_ptr<const sharding::Plan> plan,
                             const std::vector<sharding::RankSpec>& ranks,
                             const std::vector<std::vector<wire::Endpoint>>& endpoints,
                             const std::vector<std::string>& storage_devices, Identity identity) {
  if (identity.index < 0 || static_cast<size_t>(identity.index) >= plan->bytes_per_sender.size()) {
    return Status::failed_precondition(fmt::format("sender {} of a plan of {} senders", identity.index,
                                                   plan->bytes_per_sender.size()));
  }
  plan_ = std::move(plan);
  ranks_ = &ranks;
  identity_ = std::move(identity);
  pieces_given_.assign(plan_->by_source.size(), 0);
  pieces_sent_.assign(plan_->by_source.size(), 0);
  for (const auto& p : plan_->pieces) {
    if (p.sender == identity_.index) ++pieces_given_[static_cast<size_t>(p.source)];
  }
  FERRY_RETURN_IF_ERROR(connect_all(endpoints, storage_devices));
  version_ = version;
  bytes_ = 0;
  direct_bytes_ = 0;
  synced_devices_.clear();
  delta_tallies_.assign(dests_.size(), DeltaTally{});
  scratch_.begin_update();
  keep_bases_ = false;
  for (size_t i = 0; i < dests_.size(); ++i) {
    Destination& d = dests_[i];
    d.delta_base = i < identity_.delta_bases.size() ? identity_.delta_bases[i] : 0;
    d.deltas = takes_deltas(settings_.delta, d.conn->same_host(), d.bucket_device.is_cuda(),
                            bases_ && bases_->device_copies());
    keep_bases_ = keep_bases_ || d.deltas;
  }
  // No rank takes deltas (under auto, every rank is on this host): the copies go, and none is kept.
  if (bases_ && !keep_bases_) bases_->clear();
  return ok_status();
}

Status BucketSender::finish(Status failure) {
  const auto record = [&failure](const Status& st) {
    if (!st.ok() && failure.ok()) failure = st;
  };
  for (auto& d : dests_) {
    if (failure.ok()) record(flush(d));
  }
  for (auto& d : dests_) {
    while (!d.in_flight.empty()) {
      Status st = d.in_flight.front().first->wait(deadline(settings_.transport_options.timeout));
      if (!st.ok()) {
        record(st);
        d.conn->abort();
        d.conn.reset();  // reconnect next update
        d.buckets -= d.in_flight.size();
        d.in_flight.clear();
        break;
      }
      d.free.push_back(d.in_flight.front().second);
      d.in_flight.pop_front();
    }
  }
  return failure;
}

// The transport instance of `name`, created on first use.
Result<transport::Transport*> BucketSender::transport_named(const std::string& name) {
  for (auto& t : transports_) {
    if (t->name() == name) return t.get();
  }
  FERRY_ASSIGN_OR_RETURN(auto t, transport::create_transport(name, settings_.transport_options));
  transports_.push_back(std::move(t));
  return transports_.back().get();
}

// Connects to the first of the rank's endpoints, in its preference order, that can be reached;
// FERRY_TRANSPORT, when set, allows only that one.
Status BucketSender::connect_dest(Destination& d, size_t i, const std::vector<std::vector<wire::Endpoint>>& endpoints,
                                  uint64_t max_bucket, size_t max_in_flight, uint64_t reserve) {
  const sharding::RankSpec& rank = (*ranks_)[i];
  const std::string& forced = settings_.transport;
  Status last = Status::unavailable(fmt::format("replica {} rank {} advertises no data transport this trainer can use",
                                                rank.replica, rank.tp_rank));
  for (const auto& e : endpoints[i]) {
    if (forced != "auto" && forced != e.transport()) continue;
    auto t = transport_named(e.transport());
    if (!t.ok()) {
      last = t.status();
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(const std::string credential,
                           data_credential(identity_.key, identity_.sender, identity_.receivers.at(i), max_bucket));
    transport::ConnectOptions options(credential, max_bucket);
    options.max_in_flight = static_cast<uint32_t>(max_in_flight);
    options.reserve_bytes = reserve;
    auto c = (*t)->connect(e.blob(), deadline(settings_.transport_options.timeout), options);
    if (!c.ok()) {
      FERRY_LOG_INFO("{} cannot reach replica {} rank {}: {}", e.transport(), rank.replica, rank.tp_rank,
                     c.status().message());
      last = c.status().with_context(fmt::format("replica {} rank {}", rank.replica, rank.tp_rank));
      continue;
    }
    d.conn = std::move(*c);
    d.transport = *t;
    d.endpoint = e.blob();
    return ok_status();
  }
  return last;
}

Status BucketSender::connect_all(const std::vector<std::vector<wire::Endpoint>>& endpoints,
                                 const std::vector<std::string>& storage_devices) {
  std::vector<Destination> next(ranks_->size());
  for (size_t i = 0; i < ranks_->size(); ++i) {
    Destination& d = next[i];
    // The largest bucket this destination gets. Connections that reserve memory (shm's ring) are
    // sized from it.
    const size_t want = bucket_capacity(*plan_, i);
    // Buffers (and a ring's slots) for the buckets an update sends this rank, up to the setting: a
    // small model's one or two buckets need no four 64 MiB buffers. One more than the payload needs,
    // for pieces that leave a bucket short of full.
    const uint64_t payload = want - kBucketHeaderRoom;
    const size_t in_flight = static_cast<size_t>(
        std::min<uint64_t>(static_cast<uint64_t>(settings_.transport_options.buckets_in_flight), (plan_->bytes_per_dst[i] + payload - 1) / std::max<uint64_t>(payload, 1) + 1));
    bool carried_bytes = false;
    for (auto& old : dests_) {
      bool same = false;
      for (const auto& e : endpoints[i]) same = same || e.blob() == old.endpoint;
      carried_bytes = carried_bytes || (same && old.carried_bytes);
      // A connection opened for smaller buckets is opened again (its ring would split them), as is
      // one that reserved less and carried bytes.
      if (same && old.conn && old.in_flight.empty() && old.connected_for >= want &&
          old.connected_in_flight >= in_flight && !old.carried_bytes) {
        d = std::move(old);
        break;
      }
    }
    if (!d.conn) {
      // A rank that reads this trainer's device tensors in place gets buckets of references: a
      // ring reserved for the plan's buckets (64 MiB each by default, written and mapped at once
      // by both ends) would be the largest cost of a colocated first update. Bytes that do travel
      // to it (host tensors, memory without an IPC handle) go through the smaller slots in pieces,
      // and from the next update on over a connection reserved for whole buckets.
      const bool references = settings_.direct && storage_devices[i].starts_with("cuda") && !carried_bytes;
      d.reserved = references ? kReferenceReserve : 0;
      FERRY_RETURN_IF_ERROR(connect_dest(d, i, endpoints, want, in_flight, d.reserved));
      d.announced.clear();
      d.connected_for = want;
      d.connected_in_flight = in_flight;
    }
    // Direct reads need the rank on this node (a transport over shared memory reached it) with
    // device storage.
    d.direct = settings_.direct && d.transport->capabilities().same_host_shared_memory &&
               storage_devices[i].starts_with("cuda");
    d.buckets = 0;
    // A bucket a failed update left open (finish() sends nothing then) goes back to the pool.
    if (d.open >= 0) d.free.push_back(static_cast<size_t>(d.open));
    d.open = -1;
    d.open_compared = false;
    d.cutter = sharding::BucketCutter(plan_->bucket_bytes);
    // Transports that move device memory only (nccl, cuda_ipc) send buckets built on their device.
    const Device where = transport::bucket_device(d.transport->capabilities());
    if (d.pool.size() < in_flight || d.pool.front()->capacity() < want || d.bucket_device != where) {
      d.bucket_device = where;
      d.pool.clear();
      d.regions.clear();
      d.free.clear();
      for (size_t k = 0; k < in_flight; ++k) {
        auto b = std::make_unique<BucketBuilder>(want, where);
        if (b->capacity() < want) {
          return Status::resource_exhausted(fmt::format("bucket buffer of {} bytes on {}", want, where.to_string()));
        }
        FERRY_ASSIGN_OR_RETURN(auto region, d.transport->register_memory(b->data(), b->capacity(), where));
        d.regions.push_back(std::move(region));
        d.pool.push_back(std::move(b));
        d.free.push_back(k);
      }
    }
  }
  dests_ = std::move(next);
  return ok_status();
}

// A builder ready to take pieces for `d`, waiting for the oldest bucket in flight if all are busy.
Result<BucketBuilder*> BucketSender::open_bucket(Destination& d) {
  if (d.open >= 0) return d.pool[static_cast<size_t>(d.open)].get();
  if (d.free.empty()) {
    auto& [handle, k] = d.in_flight.front();
    FERRY_RETURN_IF_ERROR(handle->wait(deadline(settings_.transport_options.timeout)));
    d.free.push_back(k);
    d.in_flight.pop_front();
  }
  d.open = static_cast<int>(d.free.back());
  d.free.pop_back();
  BucketBuilder* b = d.pool[static_cast<size_t>(d.open)].get();
  b->reset(version_, identity_.sender, d.seq++);
  b->set_sender_nonce(transport::ipc_process_nonce());
  b->set_no_deltas(!d.deltas);
  return b;
}

// The bucket the next rows of a piece go into, and how many of them, by the bucket rule
// (sharding/buckets.h): the open bucket, or a new one once the open one is sent. A direct piece
// (no payload) goes whole.
Result<BucketSender::Part> BucketSender::next_part(Destination& d, int64_t rows_left, uint64_t row_bytes, bool payload) {
  for (;;) {
    const int64_t n = d.cutter.fit(rows_left, row_bytes, /*whole=*/!payload);
    if (n == 0) {
      FERRY_RETURN_IF_ERROR(flush(d));
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(BucketBuilder * b, open_bucket(d));
    d.carried_bytes = d.carried_bytes || (payload && d.reserved > 0);
    if (payload && static_cast<uint64_t>(n) * row_bytes > b->payload_room()) {
      return Status::internal(fmt::format("a bucket of {} bytes has no room for {} rows of {} bytes", b->capacity(), n,
                                          row_bytes));
    }
    return Part{b, n};
  }
}

// Records rows placed in `d`'s open bucket, and sends it when the rule says it is full.
Status BucketSender::placed(Destination& d, int64_t rows, uint64_t row_bytes) {
  if (d.cutter.place(rows, row_bytes)) return flush(d);
  return ok_status();
}

Status BucketSender::flush(Destination& d) {
  d.cutter.sent();
  d.open_compared = false;
  if (d.open < 0) return ok_status();
  const size_t k = static_cast<size_t>(d.open);
  d.open = -1;
  BucketBuilder& b = *d.pool[k];
  if (b.piece_count() == 0) {
    d.free.push_back(k);
    return ok_status();
  }
  // A bucket that cannot be sealed or posted goes back to the pool (the update fails).
  auto size = b.seal(settings_.verify);
  if (!size.ok()) {
    d.free.push_back(k);
    return size.status();
  }
  if (sealed_hook_set && b.device().is_cpu()) {
    const sharding::RankSpec& rank = (*ranks_)[static_cast<size_t>(&d - dests_.data())];
    std::lock_guard<std::mutex> lock(sealed_hook_mu);
    if (sealed_hook()) {
      if (Status st = sealed_hook()(rank.replica, rank.tp_rank, b.data(), *size); !st.ok()) {
        d.free.push_back(k);
        return st;
      }
    }
  }
  auto handle = d.conn->post(*d.regions[k], 0, *size);
  if (!handle.ok()) {
    d.free.push_back(k);
    return handle.status();
  }
  d.in_flight.emplace_back(std::move(*handle), k);
  ++d.buckets;
  on_posted_();
  return ok_status();
}

std::vector<size_t> BucketSender::unsent() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < pieces_given_.size(); ++i) {
    if (pieces_sent_[i] < pieces_given_[i]) out.push_back(i);
  }
  return out;
}

}  // namespace ferry::dataplane
