// Pieces into the engine: validation, coverage, and where each piece's bytes are held until its
// layer is complete (kept as they are, or staged; rows a kernel takes alone are processed into
// storage on arrival, or into scratch while staging), with the accounting that bounds staging.
#include "reload/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/log.h"
#include "core/region_copy.h"
#include "core/work_pool.h"

namespace ferry::reload {

std::string ReloadEngine::input_name(uint32_t param, uint32_t input) const {
  const Param& p = params_[param];
  const std::string& name = spec_.params[param].name;
  return p.inputs.size() == 1 ? name : storage_name(name, p.inputs[input].suffix);
}

bool ReloadEngine::complete(const Param& p) const {
  for (const Coverage& c : p.coverage) {
    if (!c.complete()) return false;
  }
  return true;
}

// Every byte held for a layer between its first piece and its copy-in goes through here.
Status ReloadEngine::account(Layer& layer, uint32_t param, uint32_t input, Held held, uint64_t bytes) {
  if (!layer.staged && staged_layers_ > 0 && !stage_all_) {
    // In plan order one layer is held at a time (an update staged while serving holds them all);
    // anything else is out-of-order input. Several
    // senders each in plan order hold about one layer each: warned about beyond that.
    ++report_.out_of_order_layers;
    if (!warned_out_of_order_ && staged_layers_ >= static_cast<size_t>(senders_)) {
      // Warned once per engine: an input order that holds several layers at once (a sharded
      // trainer's buckets, each spanning many layers) does so on every update, and a rank would
      // log it every training step. Later updates log it at debug level and count it in the report.
      warned_out_of_order_ = true;
      std::string open;
      for (const Layer& l : layers_) {
        if (l.staged) open += (open.empty() ? "" : ", ") + l.name;
      }
      const double mb = static_cast<double>(staging_bytes_ + bytes) / 1e6;
      if (out_of_order_warned_once_) {
        FERRY_LOG_DEBUG(
            "update v{}: out-of-order input: layer {} starts while {} is still incomplete; staging {:.1f} MB", version_,
            layer.name, open, mb);
      } else {
        out_of_order_warned_once_ = true;
        FERRY_LOG_WARN(
            "update v{}: out-of-order input: layer {} starts while {} is still incomplete; staging {:.1f} MB (said "
            "once; "
            "later updates count it in EngineReport.out_of_order_layers)",
            version_, layer.name, open, mb);
      }
    }
  }
  if (max_staging_ > 0 && staging_bytes_ + bytes > max_staging_) {
    // Named here only: accounting runs once per held piece, the message at most once a layer.
    const std::string& name = spec_.params[param].name;
    const std::string what = held == Held::kStaging   ? storage_name(name, params_[param].inputs[input].suffix)
                             : held == Held::kScratch ? name + " (quantized scratch)"
                                                      : input_name(param, input) + " (lent)";
    return Status::resource_exhausted(fmt::format(
        "staging {} for layer {} would hold {} bytes, over FERRY_MAX_STAGING_BYTES={} bytes; layer {} is refused", what,
        layer.name, staging_bytes_ + bytes, max_staging_, layer.name));
  }
  if (!layer.staged) ++staged_layers_;
  layer.staged = true;
  layer.staging_bytes += bytes;
  staging_bytes_ += bytes;
  report_.peak_staging_bytes = std::max(report_.peak_staging_bytes, staging_bytes_);
  return ok_status();
}

Status ReloadEngine::stage_input(Layer& layer, Param& p, uint32_t input, Device where) {
  if (p.staging.size() != p.inputs.size()) p.staging.resize(p.inputs.size());
  if (p.staging[input].data() != nullptr) return ok_status();
  const auto& in = p.inputs[input];
  const uint64_t bytes = dtype_bytes(in.dtype, shape_numel(in.shape));
  FERRY_RETURN_IF_ERROR(account(layer, static_cast<uint32_t>(&p - params_.data()), input, Held::kStaging, bytes));
  auto taken = pool_.take(bytes, where);
  if (!taken.ok() && !where.is_cpu()) {
    // No room on the device (an engine that reserved its memory): host staging instead.
    FERRY_LOG_WARN("staging {} ({:.1f} MB) on the host: {}", input_name(static_cast<uint32_t>(&p - params_.data()), input),
                   static_cast<double>(bytes) / 1e6, taken.status().message());
    where = Device::cpu();
    taken = pool_.take(bytes, where);
  }
  if (!taken.ok()) return taken.status();
  p.staging[input] = std::move(*taken);
  if (!where.is_cpu()) return p.padding.empty() ? ok_status() : p.staging[input].zero();
  for (const auto& [at, n] : p.padding) std::memset(static_cast<char*>(p.staging[input].data()) + at, 0, n);
  return ok_status();
}

namespace {

// Copies a packed piece into its region of `staged`, a device tensor, when the region is whole in
// every dimension after the third (every piece a plan makes of a parameter of rank 1 to 3): one
// strided copy per index of dim 0 on the device, complete on return. False for another region.
// The copies are ordered after the work queued on the legacy stream: the zeroing of the staging, a
// gather that filled the piece, a kernel still reading the buffer's previous contents.
Result<bool> unpack_rows_on_device(const TensorView& staged, const Region& dst, const void* data, size_t bytes) {
  const Shape& shape = staged.shape();
  const size_t rank = shape.size();
  if (rank == 0 || static_cast<size_t>(dst.rank()) != rank) return false;
  for (size_t d = 3; d < rank; ++d) {
    if (dst.offset[d] != 0 || dst.size[d] != shape[d]) return false;
  }
  // As [d0, d1, d2, inner]: leading unit dimensions for ranks 1 and 2.
  const size_t lead = rank >= 3 ? 0 : 3 - rank;
  auto dim = [&](size_t i) { return i < lead ? int64_t{1} : shape[i - lead]; };
  auto off = [&](size_t i) { return i < lead ? int64_t{0} : dst.offset[i - lead]; };
  auto len = [&](size_t i) { return i < lead ? int64_t{1} : dst.size[i - lead]; };
  int64_t inner = 1;
  for (size_t d = 3; d < rank; ++d) inner *= shape[d];
  const size_t row_bytes = dtype_bytes(staged.dtype(), len(2) * inner);
  const size_t block_bytes = row_bytes * static_cast<size_t>(len(1));
  if (block_bytes * static_cast<size_t>(len(0)) != bytes) return false;
  const size_t pitch = dtype_bytes(staged.dtype(), dim(2) * inner);
  const int device = staged.device().index;
  FERRY_RETURN_IF_ERROR(order_default_before_copies(device));
  for (int64_t i = 0; i < len(0); ++i) {
    const int64_t first = (((off(0) + i) * dim(1) + off(1)) * dim(2) + off(2)) * inner;
    char* out = static_cast<char*>(staged.data()) + dtype_bytes(staged.dtype(), first);
    const char* in = static_cast<const char*>(data) + static_cast<size_t>(i) * block_bytes;
    FERRY_RETURN_IF_ERROR(copy_rows_async(device, out, pitch, in, row_bytes, row_bytes, static_cast<size_t>(len(1))));
  }
  FERRY_RETURN_IF_ERROR(wait_copies(device));
  return true;
}

}  // namespace

Status ReloadEngine::stage_piecewise(Layer& layer, Param& p) {
  if (!p.piecewise.empty()) return ok_status();
  uint64_t bytes = 0;
  for (const TensorView& s : p.storage) bytes += s.nbytes();
  FERRY_RETURN_IF_ERROR(account(layer, static_cast<uint32_t>(&p - params_.data()), 0, Held::kScratch, bytes));
  for (const TensorView& s : p.storage) {
    FERRY_ASSIGN_OR_RETURN(Buffer b, pool_.take(s.nbytes()));
    FERRY_ASSIGN_OR_RETURN(TensorView v, b.view(s.dtype(), s.shape()));
    p.piecewise_views.push_back(v);
    p.piecewise.push_back(std::move(b));
  }
  return ok_status();
}

// Holds one piece (or the part of one) until its layer is processed, as `rows` (the kernel processes
// it on its own) and `kept` (its bytes stay valid until then) allow.
Status ReloadEngine::hold(Layer& layer, uint32_t param, uint32_t input, const Region& dst, const void* data,
                          size_t bytes, const std::shared_ptr<const void>* owner, Device data_device, bool rows,
                          bool kept, bool completes, bool borrowed, bool band) {
  Param& p = params_[param];
  const auto& in = p.inputs[input];
  const DType dtype = in.dtype;
  const bool on_device = !data_device.is_cpu();
  // Pieces whose bytes stay valid until the layer is processed (lent ones, and the piece that
  // completes the layer, processed within this call) are kept as they are: row pieces are
  // processed at completion straight into storage, and a piece covering a whole input is read in
  // place of its staging, by any kernel. Kept bands of one stacked matrix are processed at
  // completion too. Other row pieces are processed now: straight into storage, unless the update
  // stages while the rank serves (then into a scratch copy of the storage, copied in at the
  // apply); the rest is staged in full precision.
  enum class Hold { kKept, kWhole, kBand, kOnArrival, kStaged };
  const bool whole = dst.offset == Shape(in.shape.size(), 0) && dst.size == in.shape;
  const Hold how = rows               ? (kept ? Hold::kKept : Hold::kOnArrival)
                   : kept && whole    ? Hold::kWhole
                   : kept && band     ? Hold::kBand
                                      : Hold::kStaged;
  Status st = ok_status();
  if (how == Hold::kStaged) {
    // A device piece into device storage is staged on the device (a whole fused parameter that one
    // scale covers, say): it never goes through host memory.
    st = stage_input(layer, p, input, on_device && data_device == storage_.device() ? data_device : Device::cpu());
  } else if (how == Hold::kOnArrival) {
    // Storage is written before the layer completes only where nobody reads it meanwhile: the rank
    // is paused (no staging while serving) and stays inconsistent until an update completes, or
    // rollback restores the layer from the snapshot taken here, before the first row lands.
    st = stage_all_ ? stage_piecewise(layer, p) : snapshot_before_write(layer);
  } else if (!completes && !borrowed) {
    st = account(layer, param, input, Held::kLent, bytes);
  }
  if (!st.ok()) {
    // Refused before anything of this piece was written.
    layer.refused = true;
    release(layer);
    return st;
  }
  if ((how == Hold::kWhole || how == Hold::kKept || how == Hold::kBand) && borrowed && !completes) {
    borrowed_.push_back(Borrowed{param, input, dst, data, bytes, rows});
  }
  if (how == Hold::kWhole) {
    if (p.whole.size() != p.inputs.size()) p.whole.resize(p.inputs.size());
    p.whole[input] = Param::Lent{TensorView(const_cast<void*>(data), dtype, in.shape, data_device), 0,
                                 owner != nullptr ? *owner : nullptr, borrowed};
  } else if (how == Hold::kKept) {
    p.lent.push_back(Param::Lent{TensorView(const_cast<void*>(data), dtype, dst.size, data_device), dst.offset[0],
                                 owner != nullptr ? *owner : nullptr, borrowed});
  } else if (how == Hold::kBand) {
    const Shape band_shape(dst.size.begin() + 1, dst.size.end());  // [rows, cols...] of matrix dst.offset[0]
    p.lent.push_back(Param::Lent{TensorView(const_cast<void*>(data), dtype, band_shape, data_device), dst.offset[0],
                                 owner != nullptr ? *owner : nullptr, borrowed, dst.offset[1]});
  } else if (how == Hold::kOnArrival) {
    // Whole rows of a row-major tensor are contiguous: the packed piece is the input as it is. Into
    // storage, or its scratch copy (process_on_arrival()).
    ArrivalRows rows{param, TensorView(const_cast<void*>(data), dtype, dst.size), dst.offset[0], {}};
    if (defer_rows_ != nullptr) {
      defer_rows_->push_back(std::move(rows));
    } else {
      std::vector<ArrivalRows> one{std::move(rows)};
      process_on_arrival(one);
      if (!one.front().status.ok()) {
        // Its rows are covered but not processed: the layer cannot complete correctly now.
        layer.refused = true;
        release(layer);
        return one.front().status.with_context(fmt::format("layer {} is refused", layer.name));
      }
    }
  } else if (const Device staged_on = p.staging[input].device(); !staged_on.is_cpu()) {
    TensorView staged(p.staging[input].data(), in.dtype, in.shape, staged_on);
    auto copied = unpack_rows_on_device(staged, dst, data, bytes);
    if (!copied.ok()) return copied.status().with_context(input_name(param, input));
    if (*copied) {
      ++report_.staged_on_device_pieces;
    } else {
      // A region no strided copy describes: packed into place through host memory.
      ++report_.device_staged_pieces;
      FERRY_ASSIGN_OR_RETURN(Buffer host, pool_.take(bytes));
      FERRY_ASSIGN_OR_RETURN(Buffer image, pool_.take(staged.nbytes()));
      Status st2 = copy_bytes(image.data(), Device::cpu(), staged.data(), staged_on, staged.nbytes());
      if (st2.ok()) st2 = copy_bytes(host.data(), Device::cpu(), data, data_device, bytes);
      if (st2.ok()) st2 = unpack_region(TensorView(image.data(), in.dtype, in.shape), dst, host.data(), bytes);
      if (st2.ok()) st2 = copy_bytes(staged.data(), staged_on, image.data(), Device::cpu(), staged.nbytes());
      pool_.give(std::move(host));
      pool_.give(std::move(image));
      if (!st2.ok()) return st2.with_context(input_name(param, input));
    }
  } else {
    TensorView staged(p.staging[input].data(), in.dtype, in.shape);
    if (on_device) {
      // A device piece no kernel can take on its own (part of a per-tensor shard, a band of blocks)
      // into host staging (host storage, or staging a host piece started): through host memory.
      FERRY_ASSIGN_OR_RETURN(Buffer host, pool_.take(bytes));
      FERRY_RETURN_IF_ERROR(copy_bytes(host.data(), Device::cpu(), data, data_device, bytes));
      Status unpacked = unpack_region(staged, dst, host.data(), bytes);
      pool_.give(std::move(host));
      if (!unpacked.ok()) return unpacked.with_context(input_name(param, input));
      ++report_.device_staged_pieces;
    } else {
      Status unpacked = unpack_region(staged, dst, data, bytes);
      if (!unpacked.ok()) return unpacked.with_context(input_name(param, input));
    }
  }
  return ok_status();
}

Status ReloadEngine::apply_named_piece(const std::string& param, uint32_t input, const Region& dst, DType dtype,
                                       const void* data, size_t bytes) {
  auto idx = param_index(param);
  if (!idx.ok()) {
    if (in_update_) unknown_.push_back(param);
    return idx.status();
  }
  return apply_input_piece(*idx, input, dst, dtype, data, bytes);
}

Status ReloadEngine::take_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, PieceBytes b) {
  switch (b.intake) {
    case Intake::kCopy:
      return apply(param, input, dst, dtype, b.data, b.bytes, nullptr);
    case Intake::kLend:
      return apply(param, input, dst, dtype, b.data, b.bytes, &b.owner, b.device);
    case Intake::kBorrow:
      return apply(param, input, dst, dtype, b.data, b.bytes, nullptr, Device::cpu(), true);
  }
  return Status::internal("unknown intake");
}

Status ReloadEngine::apply_input_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype,
                                       const void* data, size_t bytes) {
  return take_piece(param, input, dst, dtype, PieceBytes{Intake::kCopy, data, bytes, nullptr, Device::cpu()});
}

Status ReloadEngine::lend_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype,
                                std::shared_ptr<const void> owner, const void* data, size_t bytes, Device data_device) {
  return take_piece(param, input, dst, dtype, PieceBytes{Intake::kLend, data, bytes, std::move(owner), data_device});
}

Status ReloadEngine::borrow_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data,
                                  size_t bytes) {
  return take_piece(param, input, dst, dtype, PieceBytes{Intake::kBorrow, data, bytes, nullptr, Device::cpu()});
}

Status ReloadEngine::release_borrowed() {
  Status first = ok_status();
  std::vector<Borrowed> borrowed;
  borrowed.swap(borrowed_);
  if (!in_update_) return first;  // the update ended: its layers hold nothing any more
  auto refuse = [&](Layer& layer, Status st) {
    // Its borrowed rows are gone: the layer cannot complete correctly now.
    if (!layer.refused) {
      layer.refused = true;
      release(layer);
      st = st.with_context(fmt::format("layer {} is refused", layer.name));
    }
    if (first.ok()) first = st;
  };
  // Every borrowed entry of a parameter is dropped at once, then each borrowed piece is held again
  // as a copied one would have been. Rows the kernel takes alone are processed afterwards, all of
  // them at once on the work pool: a bucket of several trainer ranks' buckets holds many small
  // pieces (a quarter of a slice each, from four), each too small for more than one thread.
  std::vector<ArrivalRows> deferred;
  {
    defer_rows_ = &deferred;
    struct Undefer {  // at the end of the block, and on a throw
      std::vector<ArrivalRows>*& at;
      ~Undefer() { at = nullptr; }
    } undefer{defer_rows_};
    for (const Borrowed& b : borrowed) {
      Param& p = params_[b.param];
      Layer& layer = layers_[p.layer];
      if (layer.processed || layer.refused) continue;
      std::erase_if(p.lent, [](const Param::Lent& l) { return l.borrowed; });
      for (Param::Lent& w : p.whole) {
        if (w.borrowed) w = Param::Lent{};
      }
      // Rows the kernel takes on their own are processed, unless the input is staged already (the
      // run of whole bands of a split piece): then into staging, as a copied piece would.
      const bool staged = b.input < p.staging.size() && p.staging[b.input].data() != nullptr;
      Status st = hold(layer, b.param, b.input, b.dst, b.data, b.bytes, nullptr, Device::cpu(), b.rows && !staged,
                       false, false);
      if (!st.ok()) refuse(layer, st);
    }
  }
  // A refused layer's rows are not processed (it gave back its scratch, if it had one).
  std::erase_if(deferred, [&](const ArrivalRows& d) { return layers_[params_[d.param].layer].refused; });
  process_on_arrival(deferred);
  for (const ArrivalRows& d : deferred) {
    if (!d.status.ok()) refuse(layers_[params_[d.param].layer], d.status);  // its rows_done go with it
  }
  return first;
}

void ReloadEngine::process_on_arrival(std::vector<ArrivalRows>& rows) {
  if (rows.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  run_pieces(rows.size(), [&](size_t k) {
    ArrivalRows& d = rows[k];
    Param& p = params_[d.param];
    d.status =
        p.kernel->process_rows(d.rows, d.row0, p.piecewise.empty() ? p.storage : p.piecewise_views, options_.exec);
  });
  report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (ArrivalRows& d : rows) {
    if (!d.status.ok()) {
      d.status = d.status.with_context(fmt::format("{} rows {}+{}", spec_.params[d.param].name, d.row0, d.rows.dim(0)));
      continue;
    }
    params_[d.param].rows_done.emplace_back(d.row0, d.row0 + d.rows.dim(0));
    ++report_.piecewise_pieces;
  }
}

Status ReloadEngine::check_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes) const {
  if (param >= params_.size()) {
    return Status::not_found(fmt::format("piece for parameter #{}; this rank has {}", param, params_.size()));
  }
  const sharding::ParamSpec& ps = spec_.params[param];
  const Param& p = params_[param];
  if (input >= p.inputs.size()) {
    return Status::invalid_argument(
        fmt::format("{}: piece for input {}; its {} kernel takes {}", ps.name, input, p.kernel->name(), p.inputs.size()));
  }
  const auto& in = p.inputs[input];
  // Built only for messages: this runs once per piece.
  const auto in_name = [&] { return input_name(param, input); };
  if (dtype != in.dtype) {
    return Status::invalid_argument(
        fmt::format("{}: piece of dtype {} where {} is expected", in_name(), dtype_name(dtype), dtype_name(in.dtype)));
  }
  if (bytes != dtype_bytes(dtype, dst.numel())) {
    return Status::invalid_argument(fmt::format("{}: piece {} of {} bytes where {} elements of {} take {}", in_name(),
                                                dst.to_string(), bytes, dst.numel(), dtype_name(dtype),
                                                dtype_bytes(dtype, dst.numel())));
  }
  return ok_status();
}

Status ReloadEngine::apply(uint32_t param, uint32_t input, const Region& dst, DType dtype, const void* data,
                           size_t bytes, const std::shared_ptr<const void>* owner, Device data_device, bool borrowed) {
  if (!in_update_) return Status::failed_precondition("piece received outside an update");
  const bool on_device = !data_device.is_cpu();
  if (on_device && (owner == nullptr || data_device != storage_.device())) {
    return Status::invalid_argument(fmt::format("piece in {} memory for storage on {}: device pieces are lent, on the "
                                                "storage's device", data_device.to_string(), storage_.device().to_string()));
  }
  if (param >= params_.size()) unknown_.push_back(fmt::format("#{}", param));
  FERRY_RETURN_IF_ERROR(check_piece(param, input, dst, dtype, bytes));
  Param& p = params_[param];
  const auto in_name = [&] { return input_name(param, input); };
  Layer& layer = layers_[p.layer];
  if (layer.refused) return Status::failed_precondition(fmt::format("{}: layer {} was refused", in_name(), layer.name));
  if (layer.processed) {
    return Status::invalid_argument(
        fmt::format("{}: piece {} arrives after layer {} was complete", in_name(), dst.to_string(), layer.name));
  }
  FERRY_RETURN_IF_ERROR(p.coverage[input].add(dst));
  if (!in_delta_) p.delta_only = false;
  if (options_.delta_shadow && !shadow_stale_) {
    FERRY_RETURN_IF_ERROR(shadow_write(param, input, dst, data, bytes, data_device).with_context(in_name()));
  }
  // Row pieces are processed where their bytes are: host rows into host storage (or its scratch),
  // lent device rows straight into device storage.
  const bool where_kernel_reads = p.inputs.size() == 1 && (storage_.device().is_cpu() || on_device);
  const bool rows = where_kernel_reads && dst.rank() >= 1 && p.kernel->can_process_rows(dst);
  // Staging while serving, a complete layer waits for apply_staged(): its pieces are kept as if it
  // were still incomplete.
  bool completes = !stage_all_;
  for (uint32_t q : layer.params) completes = completes && complete(params_[q]);
  const bool kept = owner != nullptr || completes || borrowed;
  // A kept band of one stacked matrix (an expert's gate rows from a trainer tensor per expert) is
  // read in place at completion, as whole rows are, instead of being staged.
  const bool band = !rows && kept && where_kernel_reads && p.kernel->can_process_band(dst);
  if (band) {
    FERRY_RETURN_IF_ERROR(hold(layer, param, input, dst, data, bytes, owner, data_device, false, kept, completes,
                               borrowed, true));
  } else if (!rows && kept && where_kernel_reads && dst.rank() >= 1) {
    // A kept piece of whole rows that the kernel cannot take as it is (a vocabulary shard that ends
    // inside a 128-row band, rows across per-tensor shards) may still hold a run of rows that it
    // can: that run is processed from the piece at completion, and only the rows around it are
    // copied into staging. (A piece that is not kept is staged whole: processing its run into
    // scratch would hold scratch beside the staging it needs anyway.)
    const auto [r0, r1] = p.kernel->rows_within(dst);
    if (r0 < r1) {
      const size_t row_bytes = bytes / static_cast<size_t>(dst.size[0]);
      const int64_t bounds[] = {dst.offset[0], r0, r1, dst.offset[0] + dst.size[0]};
      for (int k = 0; k < 3; ++k) {
        if (bounds[k + 1] <= bounds[k]) continue;
        Region part = dst;
        part.offset[0] = bounds[k];
        part.size[0] = bounds[k + 1] - bounds[k];
        const auto* at = static_cast<const char*>(data) + static_cast<size_t>(bounds[k] - dst.offset[0]) * row_bytes;
        FERRY_RETURN_IF_ERROR(hold(layer, param, input, part, at, static_cast<size_t>(part.size[0]) * row_bytes, owner,
                                   data_device, k == 1, kept, completes, borrowed));
      }
    } else {
      FERRY_RETURN_IF_ERROR(
          hold(layer, param, input, dst, data, bytes, owner, data_device, false, kept, completes, borrowed));
    }
  } else {
    FERRY_RETURN_IF_ERROR(hold(layer, param, input, dst, data, bytes, owner, data_device, rows, kept, completes, borrowed));
  }
  report_.bytes += bytes;
  report_.pieces += 1;
  return completes ? process(layer) : ok_status();
}

}  // namespace ferry::reload
