#include "dataplane/bucket_sender.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "dataplane/bucket.h"
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

// One destination rank: its connection, a pool of bucket buffers, and the buckets in flight.
struct BucketSender::Destination {
  std::string endpoint;  // the blob connected to
  transport::Transport* transport = nullptr;
  std::unique_ptr<transport::Connection> conn;
  std::vector<std::unique_ptr<BucketBuilder>> pool;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions;
  std::deque<std::pair<std::unique_ptr<transport::TransferHandle>, size_t>> in_flight;
  std::vector<size_t> free;
  int open = -1;  // builder being filled
  sharding::BucketCutter cutter{sharding::kDefaultBucketBytes};  // the open bucket, by the bucket rule
  uint64_t buckets = 0;
  uint64_t seq = 0;
  bool direct = false;               // reads this trainer's device tensors in place
  Device bucket_device = Device::cpu();  // where the buckets are (a device transport's device)
  std::set<uint64_t> announced;      // shared allocations this connection was told of
  uint64_t connected_for = 0;        // the largest bucket the connection was opened for
  size_t connected_in_flight = 0;    // and the most buckets in flight it was opened for
  uint64_t reserved = 0;             // and what it reserves per bucket, when less (0: connected_for)
  bool carried_bytes = false;        // payload went over a connection that reserved less
  uint64_t delta_base = 0;           // the version the rank keeps for deltas (0: none)
  bool deltas = false;               // takes deltas this update (FERRY_DELTA and its link)
  bool open_compared = false;        // the open bucket holds parts compared for deltas
};

namespace {
// A bucket holding parts compared for deltas is sent at the end of a tensor once what it holds
// (dense parts too) was this share of a bucket's dense bytes: delta buckets are a twentieth as heavy, and by the
// bucket rule alone a rank would get its first only after a bucket's worth of the model was
// compared, and apply the rest after the trainer's last compare (sharding/buckets.h counts the dense
// bytes; the ranks count the buckets the trainer says it sent).
constexpr uint64_t kDeltaBucketShare = 8;
}  // namespace

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

// The trainer's last writes to its weights on `device` land before any rank or copy reads them.
Status BucketSender::sync_source(Device device) {
  if (device.is_cpu() || synced_devices_.contains(device.index)) return ok_status();
  FERRY_RETURN_IF_ERROR(transport::ipc_device_synchronize(device.index));
  synced_devices_.insert(device.index);
  return ok_status();
}

// A direct piece: the rank reads the rows of `piece` from this trainer's device tensor in place.
// False when the rows are not contiguous runs (the piece then travels as bytes).
Result<bool> BucketSender::send_direct(Destination& d, const sharding::Piece& piece, const Region& dst,
                                       const TensorView& tensor) {
  const auto runs = row_runs(tensor.shape(), tensor.dtype(), piece.src);
  if (!runs) return false;
  FERRY_RETURN_IF_ERROR(sync_source(tensor.device()));
  auto located = exporter_->locate(tensor.data(), tensor.nbytes());
  if (!located.ok()) {
    // Memory without a legacy IPC handle (stream-ordered pools, expandable segments): as bytes.
    if (!warned_export_) {
      FERRY_LOG_WARN("direct reads unavailable for some weights, which travel as bytes instead: {}",
                     located.status().message());
      warned_export_ = true;
    }
    return false;
  }
  const transport::SharedRef ref = *located;
  const sharding::PieceRows pr = sharding::piece_rows(piece.src.size, piece.bytes);
  for (int64_t row = 0; row < pr.rows;) {
    FERRY_ASSIGN_OR_RETURN(const Part part, next_part(d, pr.rows - row, pr.row_bytes, /*payload=*/false));
    if (!d.announced.contains(ref.id)) {
      const transport::SharedAllocation* a = exporter_->allocation(ref.id);
      wire::IpcAllocation w;
      w.set_id(a->id);
      w.set_handle(a->handle);
      w.set_size(a->size);
      w.set_process_nonce(a->process_nonce);
      w.set_base(a->base);
      w.set_device(a->device);
      w.set_pid(a->pid);
      part.bucket->add_allocation(w);
      d.announced.insert(ref.id);
    }
    const uint64_t bytes = static_cast<uint64_t>(part.rows) * pr.row_bytes;
    part.bucket->add_ref_piece(static_cast<uint32_t>(piece.param), sharding::part_regions(piece.src, dst, row, part.rows).second,
                               tensor.dtype(), bytes, ref.id,
                               ref.offset + runs->first + static_cast<uint64_t>(row) * runs->second, runs->second,
                               static_cast<uint64_t>(part.rows));
    bytes_ += bytes;
    direct_bytes_ += bytes;
    row += part.rows;
    FERRY_RETURN_IF_ERROR(placed(d, part.rows, pr.row_bytes));
  }
  return true;
}

struct BucketSender::Route {
  sharding::Piece piece;
  Region dst;
  const DeltaBases::Base* base = nullptr;
};

Status BucketSender::send(size_t source, const sharding::SourceTensor& meta, const TensorView& tensor_in,
                          const Region& held) {
  const std::string& name = meta.name;
  TensorView tensor = tensor_in;
  Buffer host;  // a device tensor's bytes for pieces that travel as bytes
  bool any_bytes = false;
  // This sender's pieces of the tensor, each as it lies in the local tensor (its box of the global
  // tensor less the held box's origin; one outside `held` lies in another box this sender holds).
  std::vector<Route> routes;
  const bool at_origin = std::all_of(held.offset.begin(), held.offset.end(), [](int64_t o) { return o == 0; });
  for (int pi : plan_->by_source[source]) {
    const sharding::Piece& global = plan_->pieces[static_cast<size_t>(pi)];
    if (global.sender != identity_.index) continue;
    const sharding::ParamSpec& param = (*ranks_)[static_cast<size_t>(global.dst)].params[static_cast<size_t>(global.param)];
    Route r{global, sharding::piece_dst_region(global, param)};
    if (!at_origin) {
      for (size_t k = 0; k < r.piece.src.offset.size(); ++k) r.piece.src.offset[k] -= held.offset[k];
    }
    if (!r.piece.src.inside(tensor_in.shape())) continue;
    const Destination& d = dests_[static_cast<size_t>(r.piece.dst)];
    // A delta needs the rank to hold the version this sender last recorded the tensor at.
    r.base = bases_ && d.deltas && d.delta_base != 0 ? bases_->find(name, held, tensor_in.dtype(), tensor_in.shape())
                                                     : nullptr;
    if (r.base != nullptr && r.base->version != d.delta_base) r.base = nullptr;
    // A copy kept on the device is compared there (the tensor never crosses to the host whole).
    if (r.base != nullptr && r.base->values.device().is_cuda() && r.base->values.device() != tensor_in.device())
      r.base = nullptr;
    routes.push_back(std::move(r));
  }
  FERRY_ASSIGN_OR_RETURN(DeltaBases::Base* const kept, compare_boxes(name, tensor_in, held, routes, host, tensor));
  for (const Route& r : routes) {
    const sharding::Piece& piece = r.piece;
    Destination& d = dests_[static_cast<size_t>(piece.dst)];
    if (tensor_in.device().is_cuda() && d.direct) {
      auto sent = send_direct(d, piece, r.dst, tensor_in);
      if (!sent.ok()) return sent.status().with_context(name);
      if (*sent) {
        ++pieces_sent_[source];
        continue;
      }
    }
    const DeltaBases::Base* base = r.base;
    const bool device_delta = base != nullptr && base->values.device().is_cuda();
    // Into a device bucket, rows that are contiguous runs are copied straight from the tensor (no
    // delta goes into a device bucket).
    const auto runs = d.bucket_device.is_cuda() && base == nullptr
                          ? row_runs(tensor_in.shape(), tensor_in.dtype(), piece.src)
                          : std::nullopt;
    // The trainer's work on the tensor lands before it is read on the device (a copy's, a compare's).
    if (runs || device_delta) FERRY_RETURN_IF_ERROR(sync_source(tensor_in.device()).with_context(name));
    if (!runs && !device_delta && !tensor.device().is_cpu()) {
      FERRY_RETURN_IF_ERROR(host_copy(tensor_in, host, tensor).with_context(name));
    }
    any_bytes = true;
    const sharding::PieceRows pr = sharding::piece_rows(piece.src.size, piece.bytes);
    for (int64_t row = 0; row < pr.rows;) {
      FERRY_ASSIGN_OR_RETURN(const Part part, next_part(d, pr.rows - row, pr.row_bytes, /*payload=*/true));
      const auto [src, dst] = sharding::part_regions(piece.src, r.dst, row, part.rows);
      FERRY_RETURN_IF_ERROR(pack_part(*part.bucket, d.bucket_device, static_cast<uint32_t>(piece.param), src, dst,
                                      meta.dtype, runs, tensor_in, tensor, row, part.rows, pr.row_bytes, base,
                                      DeltaOptions{settings_.delta == DeltaMode::kAlways, settings_.delta_zstd},
                                      scratch_, delta_tallies_[static_cast<size_t>(piece.dst)])
                                .with_context(name));
      bytes_ += static_cast<uint64_t>(part.rows) * pr.row_bytes;
      row += part.rows;
      FERRY_RETURN_IF_ERROR(placed(d, part.rows, pr.row_bytes));
      d.open_compared = d.open_compared || (base != nullptr && d.open >= 0);
    }
    ++pieces_sent_[source];
  }
  for (Destination& d : dests_) {
    if (d.open_compared && d.cutter.bytes() >= d.cutter.bucket_bytes() / kDeltaBucketShare) {
      FERRY_RETURN_IF_ERROR(flush(d).with_context(name));
    }
  }
  // The copy deltas are computed against next time: what this sender holds of the tensor now, when
  // it is on the host (a device tensor's bytes are, once a piece travelled as host bytes). A device
  // tensor read in place (direct reads) or copied device to device (nccl, cuda_ipc) keeps none: its
  // ranks' shadows miss those pieces too, and a copy would cost every byte once more.
  // A copy kept on the device (FERRY_DELTA_COPY=device) is taken there, from the tensor itself.
  // A copy the compare brought up to date (compare_boxes) is the new version already.
  if (kept != nullptr) {
    kept->version = version_;
  } else if (bases_ && keep_bases_ && (any_bytes || pieces_given_[source] == 0)) {
    const auto copy_start = std::chrono::steady_clock::now();
    if (bases_->keeps_on(tensor_in.device())) {
      bases_->record(name, held, tensor_in, version_);
    } else if (tensor.device().is_cpu()) {
      bases_->record(name, held, tensor, version_);
    }
    scratch_.copy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
  }
  return ok_status();
}

// The boxes of the tensor that go to some rank as deltas against a copy on the host, compared
// together (TensorScan; pack_part encodes their parts from the scan). When they are every piece
// compared against the copy and tile the tensor, the compare also brings the copy up to date, and
// returns it: its version is 0 until send() stamps the new one, so that an update that fails before
// leaves a copy no delta is computed against (the coordinator sends the ranks of a failed update
// dense bytes anyway; this keeps the copy from passing for the version before whatever a rank
// reports). A device tensor's bytes are copied to the host first (`host`, viewed as `tensor`).
Result<DeltaBases::Base*> BucketSender::compare_boxes(const std::string& name, const TensorView& tensor_in,
                                                      const Region& held, const std::vector<Route>& routes,
                                                      Buffer& host, TensorView& tensor) {
  scratch_.scan.clear();
  std::vector<Region> boxes;
  bool every = true;  // every piece compared against the copy is among them
  for (const Route& r : routes) {
    if (r.base == nullptr || r.base->values.device().is_cuda()) continue;
    // A piece a direct read may take (or leave to travel as bytes) is compared alone, if at all.
    if (tensor_in.device().is_cuda() && dests_[static_cast<size_t>(r.piece.dst)].direct) {
      every = false;
      continue;
    }
    boxes.push_back(r.piece.src);
  }
  if (boxes.empty()) return nullptr;
  if (!tensor.device().is_cpu()) FERRY_RETURN_IF_ERROR(host_copy(tensor_in, host, tensor).with_context(name));
  DeltaBases::Base* base = bases_->find_to_update(name, held, tensor_in.dtype(), tensor_in.shape());
  const uint64_t was = base->version;
  const bool keep = every && keep_bases_;
  if (keep) base->version = 0;
  const auto start = std::chrono::steady_clock::now();
  const bool kept = scratch_.scan.compare(tensor, static_cast<uint8_t*>(base->values.data()), boxes,
                                          settings_.delta_zstd > 0, keep, was);
  scratch_.compare_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  scratch_.compared_bytes += scratch_.scan.compared_bytes();
  if (kept) return base;
  base->version = was;  // left as it was
  return nullptr;
}

std::vector<size_t> BucketSender::unsent() const {
  std::vector<size_t> out;
  for (size_t i = 0; i < pieces_given_.size(); ++i) {
    if (pieces_sent_[i] < pieces_given_[i]) out.push_back(i);
  }
  return out;
}

}  // namespace ferry::dataplane
