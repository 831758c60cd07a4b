#include "coordinator/trainer.h"

#include <unistd.h>

#include <chrono>
#include <optional>
#include <cstdio>
#include <deque>
#include <set>
#include <thread>

#include "core/asio.h"
#include <fmt/format.h>
#include <xxhash.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "core/region_copy.h"
#include "core/settings.h"
#include "coordinator/bucket.h"
#include "coordinator/channel.h"
#include "coordinator/coordinator.h"
#include "coordinator/mailbox.h"
#include "coordinator/member.h"
#include "coordinator/wire.h"
#include "sharding/planner.h"
#include "reload/processing.h"
#include "transport/ipc_share.h"
#include "transport/transport.h"

namespace ferry::coordinator {
namespace {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

constexpr size_t kBucketSlack = 1 << 20;  // room for headers beyond FERRY_BUCKET_BYTES of payload

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// XXH3-64 over every tensor's name, dtype and shape, in order.
uint64_t manifest_digest(const sharding::Manifest& manifest) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const auto& t : manifest) {
    XXH3_64bits_update(st, t.name.data(), t.name.size() + 1);
    const auto d = static_cast<int64_t>(t.dtype);
    XXH3_64bits_update(st, &d, sizeof d);
    const int64_t rank = static_cast<int64_t>(t.shape.size());
    XXH3_64bits_update(st, &rank, sizeof rank);
    XXH3_64bits_update(st, t.shape.data(), t.shape.size() * sizeof(int64_t));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h == 0 ? 1 : h;  // 0 means "no digest"
}

// One destination rank: its connection, a pool of bucket buffers, and the buckets in flight.
struct Destination {
  std::string endpoint;  // the blob connected to
  transport::Transport* transport = nullptr;
  std::unique_ptr<transport::Connection> conn;
  std::vector<std::unique_ptr<BucketBuilder>> pool;
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions;
  std::deque<std::pair<std::unique_ptr<transport::TransferHandle>, size_t>> in_flight;
  std::vector<size_t> free;
  int open = -1;  // builder being filled
  uint64_t buckets = 0;
  uint64_t seq = 0;
  bool direct = false;               // reads this trainer's device tensors in place
  Device bucket_device = Device::cpu();  // where the buckets are (a device transport's device)
  std::set<uint64_t> announced;      // shared allocations this connection was told of
};

// Where the rows of `src` lie inside a contiguous tensor of `shape` and `dtype`: the first row's
// byte offset and the bytes between rows, when every row of the box is one contiguous run.
std::optional<std::pair<uint64_t, uint64_t>> row_runs(const Shape& shape, DType dtype, const Region& src) {
  if (shape.empty()) return std::pair<uint64_t, uint64_t>{0, 0};
  for (size_t d = 2; d < shape.size(); ++d) {
    if (src.offset[d] != 0 || src.size[d] != shape[d]) return std::nullopt;
  }
  int64_t inner = 1;
  for (size_t d = 2; d < shape.size(); ++d) inner *= shape[d];
  const int64_t row = shape.size() > 1 ? shape[1] * inner : 1;
  const int64_t first = src.offset[0] * row + (shape.size() > 1 ? src.offset[1] * inner : 0);
  return std::pair<uint64_t, uint64_t>{dtype_bytes(dtype, first), dtype_bytes(dtype, row)};
}

class TrainerImpl final : public Trainer {
 public:
  explicit TrainerImpl(TrainerOptions o) : options_(std::move(o)), work_(asio::make_work_guard(io_)) {}

  ~TrainerImpl() override {
    heartbeat_.reset();
    if (channel_) channel_->close(Status::unavailable("trainer closed"));
    // Connections go before their transport, bucket memory only after the transport's thread ended.
    for (auto& d : dests_) d.conn.reset();
    transports_.clear();
    dests_.clear();
    work_.reset();
    if (thread_.joinable()) thread_.join();
    if (embedded_) embedded_->stop();
  }

  Status init() {
    FERRY_RETURN_IF_ERROR(validate_settings());
    FERRY_ASSIGN_OR_RETURN(timeout_ms_, setting_int("FERRY_TIMEOUT_MS"));
    FERRY_ASSIGN_OR_RETURN(bucket_bytes_, setting_bytes("FERRY_BUCKET_BYTES"));
    FERRY_ASSIGN_OR_RETURN(int64_t inflight, setting_int("FERRY_BUCKETS_IN_FLIGHT"));
    FERRY_ASSIGN_OR_RETURN(verify_, setting_bool("FERRY_VERIFY"));
    FERRY_ASSIGN_OR_RETURN(uint64_t max_frame, setting_bytes("FERRY_MAX_FRAME_BYTES"));
    if (inflight < 1) return Status::invalid_argument("FERRY_BUCKETS_IN_FLIGHT must be at least 1");
    if (bucket_bytes_ < 4096) return Status::invalid_argument("FERRY_BUCKET_BYTES must be at least 4K");
    FERRY_ASSIGN_OR_RETURN(std::string direct, setting_string("FERRY_DIRECT"));
    direct_ = direct == "auto" && transport::ipc_share_available();
    in_flight_ = static_cast<size_t>(inflight);
    std::string address = options_.coordinator;
    if (address.empty()) {
      CoordinatorOptions co;
      co.host = options_.listen_host;
      co.port = options_.port;
      FERRY_ASSIGN_OR_RETURN(embedded_, Coordinator::start(co));
      address = embedded_->address();
    }
    address_ = address;
    thread_ = std::thread([this] { io_.run(); });
    FERRY_ASSIGN_OR_RETURN(auto socket, connect_control(io_, address, timeout_ms_));
    channel_ = std::make_shared<Channel>(std::move(socket), max_frame);
    channel_->start([this](const std::shared_ptr<Channel>&, wire::Envelope& e) { mailbox_.push(std::move(e)); },
                    [this](const std::shared_ptr<Channel>&, const Status& why) { mailbox_.close(why); });
    wire::Envelope hello;
    hello.mutable_hello()->set_role("trainer");
    hello.mutable_hello()->set_pid(static_cast<int32_t>(getpid()));
    FERRY_RETURN_IF_ERROR(join(*channel_, mailbox_, std::move(hello), deadline()).status());
    heartbeat_ = std::make_unique<Heartbeat>(channel_, std::chrono::milliseconds(std::max<int64_t>(timeout_ms_ / 4, 1)));
    return ok_status();
  }

  std::string coordinator_address() const override { return address_; }

  Status wait_for_ranks(int n, int64_t timeout_ms) override {
    if (!embedded_) return Status::failed_precondition("wait_for_ranks needs the coordinator embedded in this trainer");
    return embedded_->wait_for_ranks(n, timeout_ms);
  }

  Status start_weight_update(uint64_t version, const sharding::Manifest& manifest) override {
    return start_weight_update(version, manifest, UpdateOptions{options_.pause_mode, options_.clear_cache, {}});
  }

  Status start_weight_update(uint64_t version, const sharding::Manifest& manifest, const UpdateOptions& o) override {
    if (in_update_) return Status::failed_precondition(fmt::format("update v{} is still open; finish it first", version_));
    t_start_ = Clock::now();
    // The manifest travels only when it differs from the last one the coordinator accepted.
    const uint64_t digest = manifest_digest(manifest);
    const bool omit = digest == accepted_digest_;
    wire::Envelope env;
    auto* s = env.mutable_start_update();
    s->set_version(version);
    s->set_pause_mode(o.pause_mode);
    s->set_clear_cache(o.clear_cache);
    for (int r : o.replicas) s->add_replicas(r);
    s->set_manifest_digest(digest);
    s->set_manifest_omitted(omit);
    if (!omit) {
      for (const auto& t : manifest) to_wire(t, s->add_manifest());
    }
    channel_->send(env);
    FERRY_ASSIGN_OR_RETURN(auto reply, mailbox_.wait(wire::Envelope::kStartReply, deadline(2), "start reply"));
    const auto& r = reply.start_reply();
    if (Status st = from_wire(r.status()); !st.ok()) {
      accepted_digest_ = 0;  // resend the manifest next time
      return st;
    }
    accepted_digest_ = digest;
    pause_seconds_ = since(t_start_);
    const auto t_plan = Clock::now();
    std::vector<int> members;
    endpoints_.clear();
    storage_devices_.clear();
    for (const auto& m : r.ranks()) {
      // A member's spec comes once; it never changes (a rejoining rank is a new member).
      if (m.has_spec()) {
        FERRY_ASSIGN_OR_RETURN(auto spec, from_wire(m.spec()));
        specs_[m.member_id()] = std::move(spec);
      } else if (!specs_.contains(m.member_id())) {
        return Status::internal(fmt::format("the coordinator sent no spec for member {}", m.member_id()));
      }
      members.push_back(m.member_id());
      endpoints_.emplace_back(m.endpoints().begin(), m.endpoints().end());
      storage_devices_.push_back(m.storage_device());
    }
    if (!plan_ || members != plan_members_ || digest != plan_digest_) {
      ranks_.clear();
      for (int id : members) ranks_.push_back(specs_.at(id));
      manifest_ = manifest;
      index_.clear();
      for (size_t i = 0; i < manifest_.size(); ++i) index_[manifest_[i].name] = i;
      auto plan = plans_.get(manifest_, ranks_, {sharding::SenderInfo{}});
      if (!plan.ok()) return plan.status();
      plan_ = *plan;
      plan_members_ = members;
      plan_digest_ = digest;
    }
    plan_seconds_ = since(t_plan);
    FERRY_RETURN_IF_ERROR(connect_all());
    version_ = version;
    sent_.assign(manifest_.size(), false);
    failure_ = Status();
    bytes_ = 0;
    direct_bytes_ = 0;
    synced_devices_.clear();
    in_update_ = true;
    t_transfer_ = Clock::now();
    return ok_status();
  }

  Status send(const std::string& name, const TensorView& tensor) override {
    if (!in_update_) return Status::failed_precondition("send(" + name + ") outside an update");
    Status st = send_one(name, tensor);
    if (!st.ok() && failure_.ok()) failure_ = st;
    return st;
  }

  Status update_weights(WeightSource& source) override {
    if (!in_update_) return Status::failed_precondition("update_weights outside an update");
    for (int i : plan_->source_order) {
      const std::string& name = manifest_[static_cast<size_t>(i)].name;
      if (sent_[static_cast<size_t>(i)]) continue;
      auto t = source.get(name);
      if (!t.ok()) {
        if (failure_.ok()) failure_ = t.status();
        return t.status();
      }
      FERRY_RETURN_IF_ERROR(send(name, *t));
    }
    return ok_status();
  }

  Result<UpdateReport> finish_weight_update() override {
    if (!in_update_) return Status::failed_precondition("finish_weight_update without start_weight_update");
    in_update_ = false;
    for (auto& d : dests_) {
      if (failure_.ok()) record(flush(d));
    }
    for (auto& d : dests_) {
      while (!d.in_flight.empty()) {
        Status st = d.in_flight.front().first->wait(deadline());
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
    progress(true);
    progress_shown_ = false;
    const double transfer = since(t_transfer_);
    wire::Envelope env;
    auto* f = env.mutable_finish_update();
    f->set_version(version_);
    for (auto& d : dests_) f->add_buckets(d.buckets);
    f->set_bytes(bytes_);
    f->set_transfer_seconds(transfer);
    channel_->send(env);
    FERRY_ASSIGN_OR_RETURN(auto reply, mailbox_.wait(wire::Envelope::kFinishReply, deadline(4), "finish reply"));
    const auto& r = reply.finish_reply();
    Status st = from_wire(r.status());
    if (!st.ok()) return failure_.ok() ? st : failure_.with_context(st.message());
    if (!failure_.ok()) return failure_;
    UpdateReport rep;
    rep.version = r.version();
    rep.ranks = r.ranks();
    rep.bytes = r.bytes();
    rep.direct_bytes = direct_bytes_;
    rep.moved = r.moved();
    rep.registered = r.registered();
    rep.peak_staging_bytes = r.peak_staging_bytes();
    rep.seconds = since(t_start_);
    rep.pause_seconds = pause_seconds_;
    rep.ranks_pause_seconds = r.pause_seconds();
    rep.plan_seconds = plan_seconds_;
    rep.transfer_seconds = transfer;
    rep.process_seconds = r.process_seconds();
    rep.resume_seconds = r.resume_seconds();
    return rep;
  }

 private:
  Clock::time_point deadline(int factor = 1) const {
    return Clock::now() + std::chrono::milliseconds(timeout_ms_ * factor);
  }

  void record(const Status& st) {
    if (!st.ok() && failure_.ok()) failure_ = st;
  }

  // The transport instance of `name`, created on first use.
  Result<transport::Transport*> transport_named(const std::string& name) {
    for (auto& t : transports_) {
      if (t->name() == name) return t.get();
    }
    FERRY_ASSIGN_OR_RETURN(auto t, transport::create_transport(name));
    transports_.push_back(std::move(t));
    return transports_.back().get();
  }

  // Connects to the first of the rank's endpoints, in its preference order, that can be reached;
  // FERRY_TRANSPORT, when set, allows only that one.
  Status connect_dest(Destination& d, size_t i) {
    FERRY_ASSIGN_OR_RETURN(std::string forced, setting_string("FERRY_TRANSPORT"));
    Status last = Status::unavailable(fmt::format("replica {} rank {} advertises no data transport this trainer can use",
                                                  ranks_[i].replica, ranks_[i].tp_rank));
    for (const auto& e : endpoints_[i]) {
      if (forced != "auto" && forced != e.transport()) continue;
      auto t = transport_named(e.transport());
      if (!t.ok()) {
        last = t.status();
        continue;
      }
      auto c = (*t)->connect(e.blob(), deadline());
      if (!c.ok()) {
        FERRY_LOG_INFO("{} cannot reach replica {} rank {}: {}", e.transport(), ranks_[i].replica, ranks_[i].tp_rank,
                       c.status().message());
        last = c.status().with_context(fmt::format("replica {} rank {}", ranks_[i].replica, ranks_[i].tp_rank));
        continue;
      }
      d.conn = std::move(*c);
      d.transport = *t;
      d.endpoint = e.blob();
      return ok_status();
    }
    return last;
  }

  Status connect_all() {
    // Bucket buffers hold at least the largest row of any piece, so every piece can be chunked.
    uint64_t max_row = 0;
    for (const auto& p : plan_->pieces) max_row = std::max<uint64_t>(max_row, p.bytes / std::max<int64_t>(1, p.src.size[0]));
    std::vector<Destination> next(ranks_.size());
    for (size_t i = 0; i < ranks_.size(); ++i) {
      Destination& d = next[i];
      for (auto& old : dests_) {
        bool same = false;
        for (const auto& e : endpoints_[i]) same = same || e.blob() == old.endpoint;
        if (same && old.conn && old.in_flight.empty()) {
          d = std::move(old);
          break;
        }
      }
      if (!d.conn) {
        FERRY_RETURN_IF_ERROR(connect_dest(d, i));
        d.announced.clear();
      }
      // Direct reads need the rank on this node (shm reached it) with device storage.
      d.direct = direct_ && d.transport->name() == "shm" && storage_devices_[i].starts_with("cuda");
      d.buckets = 0;
      d.open = -1;
      // Transports that move device memory only (nccl, cuda_ipc) send buckets built on their device.
      const transport::Capabilities caps = d.transport->capabilities();
      const Device where = caps.host_memory || caps.device < 0 ? Device::cpu() : Device::cuda(caps.device);
      const size_t want = std::max<uint64_t>(std::min<uint64_t>(bucket_bytes_, plan_->bytes_per_dst[i]), max_row) + kBucketSlack;
      if (d.pool.empty() || d.pool.front()->capacity() < want || d.bucket_device != where) {
        d.bucket_device = where;
        d.pool.clear();
        d.regions.clear();
        d.free.clear();
        for (size_t k = 0; k < in_flight_; ++k) {
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
  Result<BucketBuilder*> open_bucket(Destination& d) {
    if (d.open >= 0) return d.pool[static_cast<size_t>(d.open)].get();
    if (d.free.empty()) {
      auto& [handle, k] = d.in_flight.front();
      FERRY_RETURN_IF_ERROR(handle->wait(deadline()));
      d.free.push_back(k);
      d.in_flight.pop_front();
    }
    d.open = static_cast<int>(d.free.back());
    d.free.pop_back();
    BucketBuilder* b = d.pool[static_cast<size_t>(d.open)].get();
    b->reset(version_, 0, d.seq++);
    b->set_sender_nonce(transport::ipc_process_nonce());
    return b;
  }

  Status flush(Destination& d) {
    if (d.open < 0) return ok_status();
    const size_t k = static_cast<size_t>(d.open);
    d.open = -1;
    BucketBuilder& b = *d.pool[k];
    if (b.piece_count() == 0) {
      d.free.push_back(k);
      return ok_status();
    }
    FERRY_ASSIGN_OR_RETURN(size_t size, b.seal(verify_));
    FERRY_ASSIGN_OR_RETURN(auto handle, d.conn->post(*d.regions[k], 0, size));
    d.in_flight.emplace_back(std::move(handle), k);
    ++d.buckets;
    progress(false);
    return ok_status();
  }

  // A progress bar on a terminal, for updates that run longer than a second.
  void progress(bool done) {
    if (!tty_) return;
    const auto now = Clock::now();
    if (!done && (now - t_start_ < std::chrono::seconds(1) || now - last_progress_ < std::chrono::milliseconds(100))) {
      return;
    }
    if (done && !progress_shown_) return;
    last_progress_ = now;
    progress_shown_ = true;
    const double total = static_cast<double>(std::max<uint64_t>(plan_->total_bytes, 1));
    const double frac = std::min(1.0, static_cast<double>(bytes_) / total);
    const int width = 30, filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < width) bar += '>' + std::string(static_cast<size_t>(width - filled - 1), ' ');
    std::fprintf(stderr, "\r[ferry] v%llu [%s] %3.0f%% %.2f/%.2f GB%s", static_cast<unsigned long long>(version_), bar.c_str(),
                 frac * 100, static_cast<double>(bytes_) / 1e9, total / 1e9, done ? "\n" : "");
  }

  // The trainer's last writes to its weights on `device` land before any rank or copy reads them.
  Status sync_source(Device device) {
    if (device.is_cpu() || synced_devices_.contains(device.index)) return ok_status();
    FERRY_RETURN_IF_ERROR(transport::ipc_device_synchronize(device.index));
    synced_devices_.insert(device.index);
    return ok_status();
  }

  // A direct piece: the rank reads the rows of `piece` from this trainer's device tensor in place.
  // False when the rows are not contiguous runs (the piece then travels as bytes).
  Result<bool> send_direct(Destination& d, const sharding::Piece& piece, const Region& dst, const TensorView& tensor) {
    const auto runs = row_runs(tensor.shape(), tensor.dtype(), piece.src);
    if (!runs) return false;
    FERRY_RETURN_IF_ERROR(sync_source(tensor.device()));
    auto located = exporter_.locate(tensor.data(), tensor.nbytes());
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
    FERRY_ASSIGN_OR_RETURN(BucketBuilder * b, open_bucket(d));
    if (b->payload_room() < 1024) {
      FERRY_RETURN_IF_ERROR(flush(d));
      FERRY_ASSIGN_OR_RETURN(b, open_bucket(d));
    }
    if (!d.announced.contains(ref.id)) {
      const transport::SharedAllocation* a = exporter_.allocation(ref.id);
      wire::IpcAllocation w;
      w.set_id(a->id);
      w.set_handle(a->handle);
      w.set_size(a->size);
      w.set_process_nonce(a->process_nonce);
      w.set_base(a->base);
      w.set_device(a->device);
      w.set_pid(a->pid);
      b->add_allocation(w);
      d.announced.insert(ref.id);
    }
    const uint64_t rows = piece.src.size.empty() ? 1 : static_cast<uint64_t>(piece.src.size[0]);
    b->add_ref_piece(static_cast<uint32_t>(piece.param), dst, tensor.dtype(), piece.bytes, ref.id,
                     ref.offset + runs->first, runs->second, rows);
    bytes_ += piece.bytes;
    direct_bytes_ += piece.bytes;
    return true;
  }

  // Packs `bytes` of `src` (rows [row, row + n) of the piece) at `where` in a bucket on `bucket`:
  // on the host from `host_view`; on a device straight from `tensor` when its rows are `runs`, else
  // packed on the host and copied. Device copies land when the bucket is sealed.
  static Status pack_piece(Device bucket, const std::optional<std::pair<uint64_t, uint64_t>>& runs,
                           const TensorView& tensor, const TensorView& host_view, const Region& src, int64_t row,
                           int64_t n, size_t row_bytes, uint8_t* where, size_t bytes) {
    if (bucket.is_cpu()) return pack_region(host_view, src, where, bytes);
    if (runs) {
      const auto* from = static_cast<const uint8_t*>(tensor.data()) + runs->first + static_cast<uint64_t>(row) * runs->second;
      if (runs->second == row_bytes) return copy_async(bucket.index, where, from, bytes);
      return copy_rows_async(bucket.index, where, row_bytes, from, runs->second, row_bytes, static_cast<size_t>(n));
    }
    FERRY_ASSIGN_OR_RETURN(Buffer packed, Buffer::allocate(bytes));
    FERRY_RETURN_IF_ERROR(pack_region(host_view, src, packed.data(), bytes));
    return copy_now(bucket.index, where, packed.data(), bytes);
  }

  Status send_one(const std::string& name, const TensorView& tensor_in) {
    auto it = index_.find(name);
    if (it == index_.end()) return Status::invalid_argument("send(" + name + "): not in this update's manifest");
    const sharding::SourceTensor& meta = manifest_[it->second];
    FERRY_RETURN_IF_ERROR(expect_tensor(tensor_in, "send(" + name + ")", meta.dtype, meta.shape));
    if (sent_[it->second]) return Status::invalid_argument("send(" + name + "): already sent in this update");
    sent_[it->second] = true;
    TensorView tensor = tensor_in;
    Buffer host;  // a device tensor's bytes for pieces that travel as bytes
    for (int pi : plan_->by_source[it->second]) {
      const sharding::Piece& piece = plan_->pieces[static_cast<size_t>(pi)];
      const sharding::ParamSpec& param = ranks_[static_cast<size_t>(piece.dst)].params[static_cast<size_t>(piece.param)];
      const Region dst_full = sharding::slice_dst_region(param.slices[static_cast<size_t>(piece.slice)], param);
      Destination& d = dests_[static_cast<size_t>(piece.dst)];
      if (tensor_in.device().is_cuda() && d.direct) {
        auto sent = send_direct(d, piece, dst_full, tensor_in);
        if (!sent.ok()) return sent.status().with_context(name);
        if (*sent) continue;
      }
      // Into a device bucket, rows that are contiguous runs are copied straight from the tensor.
      const auto runs = d.bucket_device.is_cuda() ? row_runs(tensor_in.shape(), tensor_in.dtype(), piece.src) : std::nullopt;
      if (runs) FERRY_RETURN_IF_ERROR(sync_source(tensor_in.device()).with_context(name));
      if (!runs && !tensor.device().is_cpu()) {
        FERRY_ASSIGN_OR_RETURN(host, Buffer::allocate(tensor_in.nbytes()));
        FERRY_RETURN_IF_ERROR(
            reload::copy_bytes(host.data(), Device::cpu(), tensor_in.data(), tensor_in.device(), tensor_in.nbytes())
                .with_context(name));
        tensor = TensorView(host.data(), tensor_in.dtype(), tensor_in.shape());
      }
      const int64_t rows = piece.src.size.empty() ? 1 : piece.src.size[0];
      const size_t row_bytes = rows ? piece.bytes / static_cast<uint64_t>(rows) : 0;
      const size_t k = dst_full.size.size() - piece.src.size.size();  // dst dim of src dim 0
      int64_t row = 0;
      while (row < rows) {
        FERRY_ASSIGN_OR_RETURN(BucketBuilder * b, open_bucket(d));
        const int64_t n = std::min<int64_t>(rows - row, static_cast<int64_t>(b->payload_room() / std::max<size_t>(1, row_bytes)));
        if (n == 0) {
          FERRY_RETURN_IF_ERROR(flush(d));
          continue;
        }
        Region src = piece.src;
        Region dst = dst_full;
        if (!src.size.empty()) {
          src.offset[0] += row;
          src.size[0] = n;
          dst.offset[k] += row;
          dst.size[k] = n;
        }
        const size_t bytes = static_cast<size_t>(n) * row_bytes;
        uint8_t* where = b->add_piece(static_cast<uint32_t>(piece.param), dst, meta.dtype, bytes);
        FERRY_RETURN_IF_ERROR(pack_piece(d.bucket_device, runs, tensor_in, tensor, src, row, n, row_bytes, where, bytes)
                                  .with_context(name));
        bytes_ += bytes;
        row += n;
      }
    }
    return ok_status();
  }

  TrainerOptions options_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
  std::unique_ptr<Coordinator> embedded_;
  std::string address_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<Heartbeat> heartbeat_;
  Mailbox mailbox_;
  int64_t timeout_ms_ = 0;
  uint64_t bucket_bytes_ = 0;
  size_t in_flight_ = 1;
  bool verify_ = false;

  std::vector<std::unique_ptr<transport::Transport>> transports_;
  sharding::PlanCache plans_;
  std::shared_ptr<const sharding::Plan> plan_;
  sharding::Manifest manifest_;
  std::map<std::string, size_t> index_;
  std::vector<sharding::RankSpec> ranks_;
  std::vector<std::vector<wire::Endpoint>> endpoints_;  // per destination, in its preference order
  std::vector<Destination> dests_;
  std::vector<bool> sent_;
  std::vector<std::string> storage_devices_;  // per destination
  std::map<int, sharding::RankSpec> specs_;    // by member id, as the coordinator sent them once
  uint64_t accepted_digest_ = 0;              // of the manifest the coordinator holds from us
  std::vector<int> plan_members_;             // the members and manifest plan_ was made for
  uint64_t plan_digest_ = 0;
  bool direct_ = false;                       // FERRY_DIRECT allows direct reads
  transport::IpcExporter exporter_;
  std::set<int> synced_devices_;  // devices synchronized in this update
  bool warned_export_ = false;
  bool in_update_ = false;
  uint64_t version_ = 0;
  uint64_t bytes_ = 0;
  uint64_t direct_bytes_ = 0;
  Status failure_;
  Clock::time_point t_start_, t_transfer_, last_progress_;
  const bool tty_ = isatty(STDERR_FILENO) != 0;
  bool progress_shown_ = false;
  double pause_seconds_ = 0, plan_seconds_ = 0;
};

}  // namespace

Result<TensorView> MapSource::get(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return Status::not_found("weight source has no tensor " + name);
  return it->second;
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerOptions& options) {
  auto t = std::make_unique<TrainerImpl>(options);
  FERRY_RETURN_IF_ERROR(t->init());
  return std::unique_ptr<Trainer>(std::move(t));
}

}  // namespace ferry::coordinator
