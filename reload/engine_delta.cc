// The delta shadow: a full-precision copy of every input of the rank (host memory, or the storage's
// device: engine_delta_device.cc), kept in step with the
// version its storage holds, so that a delta piece (only the elements that changed) can be turned
// back into the piece's complete new values and processed as any other piece. Processing from the
// complete values is what makes a delta update byte-identical to a dense one, for every scheme:
// a per-tensor or per-block scale sees every element it would have seen.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/log.h"
#include "core/region_copy.h"
#include "reload/engine.h"

namespace ferry::reload {
namespace {
// The most runs of changed rows a parameter in device storage is processed in, one launch each.
constexpr size_t kDeviceRuns = 8;
}  // namespace

Result<TensorView> ReloadEngine::shadow_view(uint32_t param, uint32_t input, bool allocate) {
  if (shadow_.size() != params_.size()) shadow_.resize(params_.size());
  auto& per_input = shadow_[param];
  const auto& in = params_[param].inputs[input];
  if (per_input.size() != params_[param].inputs.size()) per_input.resize(params_[param].inputs.size());
  Buffer& b = per_input[input];
  if (b.data() == nullptr) {
    if (!allocate) return Status::internal(fmt::format("no shadow of {}", input_name(param, input)));
    FERRY_ASSIGN_OR_RETURN(b, Buffer::allocate(dtype_bytes(in.dtype, shape_numel(in.shape)), shadow_device()));
    // Padding no piece covers stays zero, as in staging: a row re-processed from the shadow holds it.
    FERRY_RETURN_IF_ERROR(b.zero());
    report_.shadow_bytes += b.size();
  }
  return TensorView(b.data(), in.dtype, in.shape, b.device());
}

void ReloadEngine::note_sender(int64_t sender, bool sends_deltas) {
  if (sends_deltas) {
    heard_deltas_ = true;
    return;
  }
  no_delta_senders_.insert(sender);
  if (no_delta_senders_.size() >= static_cast<size_t>(std::max(senders_, 1))) drop_shadow();
}

Status ReloadEngine::shadow_write(uint32_t param, uint32_t input, const Region& dst, const void* data, size_t bytes,
                                  Device data_device) {
  // A delta applied in place: the bytes are the shadow's own.
  if (!shadow_.empty() && input < shadow_[param].size() && shadow_[param][input].data() != nullptr) {
    const Buffer& b = shadow_[param][input];
    const auto* p = static_cast<const uint8_t*>(data);
    if (p >= b.data_as<uint8_t>() && p < b.data_as<uint8_t>() + b.size()) return ok_status();
  }
  if (options_.shadow_on_device) {
    // Host or device bytes into device memory: strided copies, no kernel.
    FERRY_ASSIGN_OR_RETURN(TensorView shadow, shadow_view(param, input, /*allocate=*/true));
    return unpack_region_on_device(shadow, dst, data, bytes);
  }
  if (!data_device.is_cpu()) {
    // A device bucket's piece (nccl, cuda_ipc): copying every byte back to the host would cost the
    // update more than a delta could save on such links. The shadow misses it; the next update
    // comes dense.
    drop_shadow();
    return ok_status();
  }
  FERRY_ASSIGN_OR_RETURN(TensorView shadow, shadow_view(param, input, /*allocate=*/true));
  return unpack_region(shadow, dst, data, bytes);
}

Status ReloadEngine::take_delta_piece(uint32_t param, uint32_t input, const Region& dst, DType dtype, size_t bytes,
                                      uint64_t base_version, const DeltaSource& delta) {
  if (!in_update_) return Status::failed_precondition("delta piece received outside an update");
  FERRY_RETURN_IF_ERROR(check_piece(param, input, dst, dtype, bytes));
  const std::string name = input_name(param, input);
  if (!options_.delta_shadow) {
    return Status::failed_precondition(fmt::format(
        "{}: delta piece against v{} refused: this rank keeps no full-precision shadow (FERRY_DELTA_SHADOW=off)", name,
        base_version));
  }
  // (Pieces of this update that bypassed the shadow left other regions stale, never this one:
  // every region is written once per update.)
  if (base_version != shadow_base_) {
    return Status::failed_precondition(
        fmt::format("{}: delta piece against v{} refused, not applied: this rank's shadow holds {}", name, base_version,
                    shadow_base_ == 0 ? std::string("no complete version") : fmt::format("v{}", shadow_base_)));
  }
  FERRY_ASSIGN_OR_RETURN(TensorView shadow, shadow_view(param, input, /*allocate=*/false));
  if (!dst.inside(shadow.shape())) {
    return Status::invalid_argument(fmt::format("{}: delta piece {} outside {}", name, dst.to_string(),
                                                shape_to_string(shadow.shape())));
  }
  if (options_.shadow_on_device) return take_device_delta(param, input, dst, dtype, bytes, shadow, delta);
  const DeltaApply& apply_delta = delta.apply;
  if (!apply_delta) return Status::internal(fmt::format("{}: a delta without a host form", name));
  // Whole rows are one run of the shadow: the delta lands there in place, and the engine is lent
  // those bytes (they stay put until the update ends: every region is written once per update).
  // A piece that breaks coverage (a region sent twice) is refused by apply() after its delta was
  // written; the update then fails, and a failed update leaves the shadow without a version, so
  // those values are never a delta's base.
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  // Only the rows a delta writes in matter (note_changed_rows): its runs come widened to them.
  const uint64_t per_row = units_per_row(dtype, dst);
  const uint64_t granularity = std::max<uint64_t>(per_row, 1);
  if (const uint8_t* span = region_span(shadow, dst); span != nullptr) {
    auto* at = const_cast<uint8_t*>(span);
    FERRY_RETURN_IF_ERROR(apply_delta(at, bytes, &runs, granularity).with_context(name));
    note_changed_rows(params_[param], dst, runs, per_row);
    static const std::shared_ptr<const void> kUntilTheUpdateEnds;
    const DeltaIntake taking(in_delta_);
    Status st = apply(param, input, dst, dtype, at, bytes, &kUntilTheUpdateEnds);
    if (st.ok()) ++report_.delta_pieces;
    return st;
  }
  FERRY_ASSIGN_OR_RETURN(Buffer values, pool_.take(bytes));
  Status st = pack_region(shadow, dst, values.data(), bytes);
  if (st.ok()) st = apply_delta(static_cast<uint8_t*>(values.data()), bytes, &runs, granularity);
  if (!st.ok()) {
    pool_.give(std::move(values));
    return st.with_context(name);
  }
  note_changed_rows(params_[param], dst, runs, per_row);
  // The new values go in as a copied piece: coverage, the shadow, and processing as for any other.
  {
    const DeltaIntake taking(in_delta_);
    st = apply(param, input, dst, dtype, values.data(), bytes, nullptr);
  }
  pool_.give(std::move(values));
  if (st.ok()) ++report_.delta_pieces;
  return st;
}

uint64_t ReloadEngine::units_per_row(DType dtype, const Region& dst) {
  if (dst.rank() == 0 || dst.size[0] == 0) return 1;
  const uint64_t elements = static_cast<uint64_t>(dst.numel() / dst.size[0]);
  const auto bits = static_cast<uint64_t>(dtype_bits(dtype));
  if (bits >= 8) return elements;
  return elements * bits % 8 == 0 ? elements * bits / 8 : 0;
}

void ReloadEngine::note_changed_rows(Param& p, const Region& dst,
                                     const std::vector<std::pair<uint64_t, uint64_t>>& runs, uint64_t per_row) {
  if (dst.rank() == 0 || dst.size[0] == 0 || runs.empty()) return;
  if (per_row == 0) {
    p.changed_rows.emplace_back(dst.offset[0], dst.offset[0] + dst.size[0]);
    return;
  }
  // Unit e of the packed piece lies in row dst.offset[0] + e / (units per row of the piece).
  // Past the rows noted so far, from this piece's first element on (runs come in order: a run that
  // ends before it adds no row, and costs no division; at a few percent changed, a row holds many).
  uint64_t noted = 0;
  for (const auto& [first, count] : runs) {
    if (first + count <= noted) continue;
    const int64_t r0 = dst.offset[0] + static_cast<int64_t>(first / per_row);
    const int64_t r1 = dst.offset[0] + static_cast<int64_t>((first + count - 1) / per_row) + 1;
    if (!p.changed_rows.empty() && p.changed_rows.back().second >= r0 && p.changed_rows.back().first <= r0) {
      p.changed_rows.back().second = std::max(p.changed_rows.back().second, r1);
    } else {
      p.changed_rows.emplace_back(r0, r1);
    }
    noted = static_cast<uint64_t>(r1 - dst.offset[0]) * per_row;
  }
}

// A parameter all of whose pieces came as deltas holds, outside the rows they changed, exactly the
// input its storage was processed from last time (the shadow's base version; a delta is refused on
// any other). A row-local kernel (none, per-channel, int4 groups) then writes the same bytes there
// again: those rows are left as they are, and only the changed rows are processed, from the
// shadow, straight into storage; under fp8_block the 128-row blocks they fall in, under
// fp8_per_tensor the changed rows alone when their shards' scales come out as stored, else the
// whole shards (a scale sees every element of its shard). Device storage does the same from a
// shadow on its device (FERRY_DELTA_SHADOW=device) in up to kDeviceRuns runs; past that, from a host
// shadow, and for pieces processed on arrival, the whole path is taken.
Result<bool> ReloadEngine::process_changed_rows(Param& p, const sharding::ParamSpec& ps, const kernels::Exec& exec) {
  // (shadow_base_: storage holds that version processed; a first update, or one after a failure,
  // has none and processes everything.)
  // (A stale shadow missed pieces: it is not the input these rows were processed from.)
  if (shadow_base_ == 0 || shadow_stale_ || !p.delta_only || !options_.delta_shadow || p.inputs.size() != 1 ||
      !p.piecewise.empty() || !p.rows_done.empty() || !p.whole.empty() || p.inputs[0].shape.empty()) {
    return false;
  }
  const uint32_t param = static_cast<uint32_t>(&p - params_.data());
  if (shadow_.size() <= param || shadow_[param].empty() || shadow_[param][0].data() == nullptr) return false;
  const Buffer& shadow = shadow_[param][0];
  if (shadow.device() != storage_.device()) return false;  // rows of a host shadow for device storage
  const auto& in = p.inputs[0];
  // The changed runs, merged; then each widened to what its processing rewrites (blocks, shards)
  // and merged again, each widened run keeping the changed runs inside it.
  std::sort(p.changed_rows.begin(), p.changed_rows.end());
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& r : p.changed_rows) {
    if (!runs.empty() && r.first <= runs.back().second) {
      runs.back().second = std::max(runs.back().second, r.second);
    } else {
      runs.push_back(r);
    }
  }
  struct Widened {
    int64_t r0, r1;
    size_t first, last;  // its changed runs: runs[first, last)
  };
  std::vector<Widened> rows;
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto [w0, w1] = p.kernel->rows_around(runs[i].first, runs[i].second);
    if (!rows.empty() && w0 <= rows.back().r1) {
      rows.back().r1 = std::max(rows.back().r1, w1);
      rows.back().last = i + 1;
    } else {
      rows.push_back({w0, w1, i, i + 1});
    }
  }
  // On a GPU each run is a kernel launch: past a few runs (a norm's changed elements are as many
  // one-element rows) the whole parameter in one launch costs less.
  if (!storage_.device().is_cpu() && rows.size() > kDeviceRuns) return false;
  for (const auto& w : rows) {
    Region region = Region::whole(in.shape);
    region.offset[0] = w.r0;
    region.size[0] = w.r1 - w.r0;
    if (!p.kernel->can_process_rows(region)) return false;
  }
  const int64_t per_row = shape_numel(in.shape) / std::max<int64_t>(in.shape[0], 1);
  int64_t changed = 0;
  for (const auto& w : rows) {
    Shape s = in.shape;
    s[0] = w.r1 - w.r0;
    TensorView v(shadow.data_as<uint8_t>() + dtype_bytes(in.dtype, w.r0 * per_row), in.dtype, s, shadow.device());
    // Only what the change reaches (a per-tensor shard whose scale held: its changed rows), else
    // the run whole.
    const std::span<const std::pair<int64_t, int64_t>> inside(runs.data() + w.first, w.last - w.first);
    const auto done = p.kernel->process_changed_rows(v, w.r0, inside, p.storage, exec);
    if (!done.ok()) return done.status().with_context(ps.name);
    if (*done > 0) {
      changed += *done;
      continue;
    }
    FERRY_RETURN_IF_ERROR(p.kernel->process_rows(v, w.r0, p.storage, exec).with_context(ps.name));
    changed += w.r1 - w.r0;
  }
  report_.kept_rows += static_cast<uint64_t>(in.shape[0] - changed);
  return true;
}

}  // namespace ferry::reload
