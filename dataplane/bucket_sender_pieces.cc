// A tensor's pieces into a BucketSender's buckets (bucket_sender.h): each routed to its rank, read
// in place by a rank that reads this trainer's device memory, compared for deltas against the copy
// kept of the tensor (TensorScan), or packed as bytes; then the copy kept for the next update.
#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "core/log.h"
#include "dataplane/bucket_sender.h"
#include "dataplane/bucket_sender_destination.h"
#include "dataplane/piece_pack.h"
#include "sharding/planner.h"
#include "transport/ipc_share.h"

namespace ferry::dataplane {
namespace {
// A bucket holding parts compared for deltas is sent at the end of a tensor once what it holds
// (dense parts too) was this share of a bucket's dense bytes: delta buckets are a twentieth as heavy, and by the
// bucket rule alone a rank would get its first only after a bucket's worth of the model was
// compared, and apply the rest after the trainer's last compare (sharding/buckets.h counts the dense
// bytes; the ranks count the buckets the trainer says it sent).
constexpr uint64_t kDeltaBucketShare = 8;
}  // namespace

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
    part.bucket->add_ref_piece(static_cast<uint32_t>(piece.param),
                               sharding::part_regions(piece.src, dst, row, part.rows).second, tensor.dtype(), bytes,
                               ref.id, ref.offset + runs->first + static_cast<uint64_t>(row) * runs->second,
                               runs->second, static_cast<uint64_t>(part.rows));
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
    const sharding::ParamSpec& param =
        (*ranks_)[static_cast<size_t>(global.dst)].params[static_cast<size_t>(global.param)];
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

}  // namespace ferry::dataplane
