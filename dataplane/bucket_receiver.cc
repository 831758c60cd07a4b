#include "dataplane/bucket_receiver.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "dataplane/bucket.h"
#include "dataplane/credential.h"
#include "dataplane/delta.h"
#include "dataplane/delta_device.h"
#include "reload/engine.h"
#include "transport/ipc_share.h"

namespace ferry::dataplane {

BucketReceiver::BucketReceiver(reload::ReloadEngine& engine, Device storage_device, bool verify)
    : engine_(engine), device_(storage_device), verify_(verify) {
  if (device_.is_cuda() && transport::ipc_share_available()) {
    importer_ = std::make_unique<transport::IpcImporter>(device_.index);
  }
}

BucketReceiver::~BucketReceiver() = default;

void BucketReceiver::set_receiver(int member_id) {
  std::lock_guard<std::mutex> lock(senders_mu_);
  receiver_ = member_id;
}

void BucketReceiver::set_senders(std::map<int, std::string> keys) {
  std::lock_guard<std::mutex> lock(senders_mu_);
  senders_ = std::move(keys);
}

Result<transport::Admission> BucketReceiver::admit(std::string_view credential) {
  std::lock_guard<std::mutex> lock(senders_mu_);
  FERRY_ASSIGN_OR_RETURN(const DataCredential c,
                         check_data_credential(credential, receiver_, [&](int id) -> const std::string* {
                           auto it = senders_.find(id);
                           return it == senders_.end() ? nullptr : &it->second;
                         }));
  // The connection takes buckets up to the largest its sender announced (its plan's), whatever
  // this rank's own bucket setting.
  return transport::Admission{static_cast<int64_t>(c.sender), c.max_bucket_bytes};
}

BucketReceiver::Decoded BucketReceiver::decode(const transport::ReceivedBucket& bucket, Device where) const {
  Decoded d;
  d.status = where.is_cpu() ? decode_bucket(bucket.data, bucket.size, &d.header)
                            : decode_device_bucket(bucket.data, bucket.size, where, &d.header);
  // A bucket belongs to the sender that proved itself on its connection.
  if (d.status.ok() && d.header.sender() != bucket.peer) {
    d.status = Status::unauthenticated(fmt::format("a bucket says it is from member {} on the connection of member {}",
                                                   d.header.sender(), bucket.peer));
  }
  if (d.status.ok() && verify_ && d.header.checksum() == 0) {
    d.status = Status::data_loss(fmt::format("bucket {} carries no checksum while FERRY_VERIFY=1", d.header.seq()));
  }
  return d;
}

bool BucketReceiver::take(const Decoded& d, const transport::ReceivedBucket& bucket, Device where, uint64_t open_update,
                          Status* status) {
  const wire::BucketHeader& header = d.header;
  Status st = d.status;
  // Data and control travel on different connections: buckets of an update that was aborted can
  // still be in flight when the next update starts. They are dropped, not counted.
  if (st.ok() && header.version() < open_update) {
    FERRY_LOG_DEBUG("dropping a bucket of aborted update v{} during v{}", header.version(), open_update);
    return false;
  }
  if (st.ok() && (header.version() != open_update || !engine_.in_update())) {
    st = Status::failed_precondition(fmt::format("bucket of update v{} while this rank is at v{}{}", header.version(),
                                                 open_update, engine_.in_update() ? "" : " (no update open)"));
  }
  // Its sender must be one of the open update's (a connection admitted for an earlier update's
  // trainer stays open).
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(senders_mu_);
    if (!senders_.count(header.sender())) {
      st = Status::unauthenticated(fmt::format("a bucket of update v{} from member {}, which is no sender of this update",
                                               header.version(), header.sender()));
    }
  }
  for (int i = 0; st.ok() && i < header.allocations_size(); ++i) st = announce(header.allocations(i));
  // A device bucket's payload is valid only during this call: it is kept in a pooled buffer on the
  // storage's device, or on the host when the storage is elsewhere, and its pieces are lent to the
  // engine from there (read in place, no second copy).
  const uint8_t* data = bucket.data;
  std::shared_ptr<const Buffer> kept;
  const Device payload_device = device_ == where ? where : Device::cpu();
  if (st.ok() && where.is_cuda() && header.payload_bytes() > 0) {
    auto k = payloads_.keep(data, header.payload_bytes(), where, payload_device);
    st = k.status();
    if (k.ok()) {
      kept = std::move(*k);
      data = static_cast<const uint8_t*>(kept->data());
    }
  }
  // A host bucket the transport hands over (tcp) is lent the same way when that saves the engine
  // staging copies: the bucket's buffer stays alive until the pieces' layers are done.
  // Any other bucket is borrowed: valid until this call returns, a layer the bucket completes is
  // processed from it in place, and release_borrowed() below copies the rest.
  reload::PieceBytes from_bucket{reload::Intake::kBorrow, nullptr, 0, nullptr, Device::cpu()};
  if (kept) {
    from_bucket = {reload::Intake::kLend, nullptr, 0, kept, payload_device};
  } else if (!where.is_cuda() && bucket.owner && engine_.lends_host_pieces()) {
    from_bucket = {reload::Intake::kLend, nullptr, 0, bucket.owner, Device::cpu()};
  }
  bool borrowed = false;
  // Borrows end before this call returns, also when something throws.
  struct EndBorrows {
    reload::ReloadEngine& engine;
    bool& borrowed;
    ~EndBorrows() {
      if (borrowed) engine.release_borrowed().ignore_error();
    }
  } end_borrows{engine_, borrowed};
  // Whether this sender may send the rank deltas decides whether the rank keeps its shadow.
  if (st.ok()) engine_.note_sender(header.sender(), !header.no_deltas());
  for (int i = 0; st.ok() && i < header.pieces_size(); ++i) {
    const auto& p = header.pieces(i);
    auto dt = parse_dtype(p.dtype());
    if (!dt.ok()) {
      st = dt.status();
      break;
    }
    Region dst{Shape(p.dst_offset().begin(), p.dst_offset().end()), Shape(p.size().begin(), p.size().end())};
    if (p.encoding() != 0) {
      st = take_delta(p, dst, *dt, data, payload_device);
      continue;
    }
    Result<reload::PieceBytes> bytes = from_bucket;
    if (p.ref_alloc() != 0) {
      engine_.drop_shadow();  // read in place on the device: the shadow (host or device) does not see it
      bytes = direct_bytes(header.sender_nonce(), p);
    } else {
      bytes->data = data + p.offset();
      bytes->bytes = p.bytes();
    }
    if (!bytes.ok()) {
      st = bytes.status();
      break;
    }
    borrowed = borrowed || bytes->intake == reload::Intake::kBorrow;
    st = engine_.take_piece(p.param(), 0, dst, *dt, std::move(*bytes));
  }
  if (borrowed) {
    borrowed = false;
    Status released = engine_.release_borrowed();
    if (st.ok()) st = released;
  }
  *status = st;
  return true;
}

// A delta piece: its encoding applied on top of the values of the version the rank's shadow holds
// (the engine refuses any other base). From a device payload into a shadow on that device, a runs
// encoding whose values' place the sender gave goes to the device as it lies (apply_device_runs);
// otherwise, or when the device refuses it, the encoding is copied to the host first.
Status BucketReceiver::take_delta(const wire::PieceHeader& p, const Region& dst, DType dtype, const uint8_t* payload,
                                  Device payload_device) {
  if (p.ref_alloc() != 0) return Status::data_loss(fmt::format("direct piece for parameter #{} carries a delta", p.param()));
  const uint32_t encoding = p.encoding();  // with its flags
  const uint8_t* encoded = payload + p.offset();
  std::vector<uint8_t> host;
  bool copied = payload_device.is_cpu();
  const auto host_bytes = [&]() -> Result<const uint8_t*> {
    if (!copied) {
      host.resize(p.encoded_bytes());
      FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), encoded, payload_device, host.size()));
      copied = true;
    }
    return payload_device.is_cpu() ? encoded : host.data();
  };
  const size_t elem = std::max<size_t>(dtype_bits(dtype) / 8, 1);
  const size_t n = p.bytes() / elem;
  reload::ReloadEngine::DeltaSource source;
  source.apply = [&](uint8_t* values, size_t, std::vector<std::pair<uint64_t, uint64_t>>* changed,
                     uint64_t per_row) -> Status {
    FERRY_ASSIGN_OR_RETURN(const uint8_t* e, host_bytes());
    return apply_delta(encoding, e, p.encoded_bytes(), values, n, elem, changed, per_row);
  };
  source.apply_on_device = [&](void* values, size_t, Device device, uint64_t per_row, uint8_t* row_marks) -> Status {
    const RowMarks rows{per_row, row_marks};
    if (payload_device == device && p.values_at() != 0 && encoding == static_cast<uint32_t>(DeltaEncoding::kRuns)) {
      const Status st = apply_device_runs(encoding, encoded, p.encoded_bytes(), p.values_at(), values, device, n, elem,
                                          delta_upload_, &rows);
      if (st.code() != StatusCode::kDataLoss) return st;
    }
    FERRY_ASSIGN_OR_RETURN(const uint8_t* e, host_bytes());
    return apply_delta_on_device(encoding, e, p.encoded_bytes(), values, device, n, elem, delta_upload_, &rows);
  };
  return engine_.take_delta_piece(p.param(), 0, dst, dtype, p.bytes(), p.base_version(), source);
}

Status BucketReceiver::announce(const wire::IpcAllocation& a) {
  if (!importer_) {
    return Status::failed_precondition(
        fmt::format("a sender shares device memory with this rank, whose storage is on {}", device_.to_string()));
  }
  transport::SharedAllocation s;
  s.id = a.id();
  s.handle = a.handle();
  s.size = a.size();
  s.process_nonce = a.process_nonce();
  s.base = a.base();
  s.device = a.device();
  s.pid = a.pid();
  return importer_->announce(s);
}

// A piece the rank reads in place from the colocated sender's device memory, lent to the engine.
// Rows that are not one run (columns of a row-parallel weight) are gathered on the device first.
Result<reload::PieceBytes> BucketReceiver::direct_bytes(uint64_t nonce, const wire::PieceHeader& p) {
  if (!importer_) {
    return Status::failed_precondition(
        fmt::format("direct piece for parameter #{} on a rank whose storage is on {}", p.param(), device_.to_string()));
  }
  const uint64_t rows = p.ref_rows(), row_bytes = rows ? p.bytes() / rows : 0;
  const uint64_t span = rows ? (rows - 1) * p.ref_row_stride() + row_bytes : 0;
  FERRY_ASSIGN_OR_RETURN(const uint8_t* src, importer_->resolve(nonce, p.ref_alloc(), p.ref_offset(), span));
  if (rows <= 1 || p.ref_row_stride() == row_bytes) {
    return reload::PieceBytes{reload::Intake::kLend, src, p.bytes(), nullptr, device_};
  }
  // Into a pooled buffer: the gather and the kernels that read it share the legacy default stream.
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const Buffer> packed, payloads_.take(p.bytes(), device_));
  void* to = packed->data();
  FERRY_RETURN_IF_ERROR(transport::gather_rows(to, src, rows, row_bytes, p.ref_row_stride(), device_.index));
  return reload::PieceBytes{reload::Intake::kLend, to, p.bytes(), std::move(packed), device_};
}

}  // namespace ferry::dataplane
