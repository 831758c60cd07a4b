// Processing a complete layer into its registered storage: rows kept or processed on arrival, staged
// inputs, the rollback snapshot before the first write, and releasing the layer's staging.
#include "reload/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "core/log.h"
#include "core/parallel.h"
#include "core/work_pool.h"

namespace ferry::reload {

Result<const Buffer*> ReloadEngine::input_buffer(Param& p, uint32_t i) {
  // Inputs never staged are all padding (a shard with no expected slices): zeros.
  if (p.staging.size() != p.inputs.size()) p.staging.resize(p.inputs.size());
  if (p.staging[i].data() == nullptr) {
    const auto& in = p.inputs[i];
    const size_t bytes = dtype_bytes(in.dtype, shape_numel(in.shape));
    FERRY_ASSIGN_OR_RETURN(p.staging[i], pool_.take(bytes));
    std::memset(p.staging[i].data(), 0, bytes);
  }
  return &p.staging[i];
}

Status ReloadEngine::process_rows(Param& p, const sharding::ParamSpec& ps, const kernels::Exec& exec) {
  // Into the scratch copy when pieces were processed into it on arrival, else straight into the
  // registered storage: the layer is complete, so only a kernel error can stop it now (and rollback
  // covers that).
  const bool scratch = !p.piecewise.empty();
  const std::vector<TensorView>& target = scratch ? p.piecewise_views : p.storage;
  const auto& in = p.inputs[0];
  std::map<int64_t, int64_t> banded;  // matrix -> rows its bands cover
  std::vector<const Param::Lent*> kept;
  for (const Param::Lent& l : p.lent) {
    if (l.band >= 0) {
      banded[l.row0] += l.rows.dim(0);
    } else {
      kept.push_back(&l);
    }
  }
  // Kept row pieces write rows of their own: host ones all at once on the work pool (several trainer
  // ranks' pieces are a quarter of a slice each from four, too small to keep every thread busy one
  // after another); device ones in turn on the layer's stream.
  std::vector<Status> kept_status(kept.size());
  const auto one = [&](size_t k) {
    kept_status[k] = p.kernel->process_rows(kept[k]->rows, kept[k]->row0, target, exec);
  };
  if (storage_.device().is_cpu()) {
    run_pieces(kept.size(), one);
  } else {
    for (size_t k = 0; k < kept.size(); ++k) one(k);
  }
  for (size_t k = 0; k < kept.size(); ++k) {
    if (!kept_status[k].ok())
      return kept_status[k].with_context(fmt::format("{} rows from {}", ps.name, kept[k]->row0));
    p.rows_done.emplace_back(kept[k]->row0, kept[k]->row0 + kept[k]->rows.dim(0));
    if (!scratch) ++report_.direct_pieces;
  }
  // A matrix its bands cover whole needs nothing from staging.
  for (const auto& [m, n] : banded) {
    if (in.shape.size() >= 2 && n == in.shape[1]) p.rows_done.emplace_back(m, m + 1);
  }
  // Rows no piece covered whole: staged pieces and padding, processed from staging.
  std::sort(p.rows_done.begin(), p.rows_done.end());
  const int64_t rows = in.shape[0], per_row = rows ? shape_numel(in.shape) / rows : 0;
  int64_t next = 0;
  const Device dev = storage_.device();
  ScratchArena uploads(dev), downloads(Device::cpu());
  const bool staged = !p.staging.empty() && p.staging[0].data() != nullptr;
  const bool staged_on_device = staged && !p.staging[0].device().is_cpu();
  auto run = [&](int64_t r0, int64_t r1) -> Status {
    if (r1 <= r0) return ok_status();
    Shape s = in.shape;
    s[0] = r1 - r0;
    // Without staging, the rows no piece covered are padding: zeros for those rows only (an
    // embedding padded to a multiple of TP would otherwise clear a copy of its whole size on every
    // update to quantize its few padding rows).
    Buffer zeros;
    void* src = nullptr;
    if (staged) {
      src = static_cast<char*>(p.staging[0].data()) + dtype_bytes(in.dtype, r0 * per_row);
    } else {
      const size_t bytes = dtype_bytes(in.dtype, (r1 - r0) * per_row);
      FERRY_ASSIGN_OR_RETURN(zeros, pool_.take(bytes));
      std::memset(zeros.data(), 0, bytes);
      src = zeros.data();
    }
    TensorView v(src, in.dtype, s, staged_on_device ? dev : Device::cpu());
    if (staged_on_device && scratch) {
      // Scratch is host memory: the staged device rows come down first.
      FERRY_ASSIGN_OR_RETURN(TensorView h, downloads.allocate(in.dtype, s));
      FERRY_RETURN_IF_ERROR(copy_bytes(h.data(), Device::cpu(), v.data(), dev, h.nbytes()));
      v = h;
    } else if (!scratch && !dev.is_cpu() && !staged_on_device) {
      // Device storage beside lent device rows: the staged rows go up first.
      FERRY_ASSIGN_OR_RETURN(TensorView d, uploads.allocate(in.dtype, s));
      FERRY_RETURN_IF_ERROR(copy_bytes(d.data(), dev, v.data(), Device::cpu(), d.nbytes()));
      v = d;
    }
    Status st = p.kernel->process_rows(v, r0, target, exec).with_context(ps.name);
    pool_.give(std::move(zeros));
    return st;
  };
  for (const auto& [r0, r1] : p.rows_done) {
    FERRY_RETURN_IF_ERROR(run(next, r0));
    next = r1;
  }
  FERRY_RETURN_IF_ERROR(run(next, rows));
  // Bands last: a matrix that bands cover in part was processed from staging just above, and its
  // bands' rows (whole blocks under fp8_block, rows otherwise) are written over with their own.
  for (const Param::Lent& l : p.lent) {
    if (l.band < 0) continue;
    if (Status st = p.kernel->process_band(l.rows, l.row0, l.band, target, exec); !st.ok()) {
      return st.with_context(fmt::format("{} rows {}+{} of matrix {}", ps.name, l.band, l.rows.dim(0), l.row0));
    }
    if (!scratch) ++report_.direct_pieces;
  }
  if (uploads.bytes() > 0) FERRY_RETURN_IF_ERROR(device_synchronize(dev));  // before the uploads are freed
  if (!scratch) return ok_status();
  // Copy-in: values go into the registered storage; its identity stays. Host storage is copied on
  // the work pool's threads: a rank fed by several trainer ranks copies in most of its layers, and
  // one thread's copy would take as long as the pool's quantizing them.
  for (size_t i = 0; i < p.storage.size(); ++i) {
    if (storage_.device().is_cpu()) {
      copy_parallel(p.storage[i].data(), p.piecewise_views[i].data(), p.storage[i].nbytes());
      continue;
    }
    FERRY_RETURN_IF_ERROR(copy_bytes(p.storage[i].data(), storage_.device(), p.piecewise_views[i].data(),
                                     Device::cpu(), p.storage[i].nbytes()));
  }
  return ok_status();
}

Status ReloadEngine::process_param(Param& p, const sharding::ParamSpec& ps, const kernels::Exec& exec) {
  FERRY_ASSIGN_OR_RETURN(const bool done, process_changed_rows(p, ps, exec));
  if (done) return ok_status();
  if (!p.piecewise.empty() || !p.lent.empty() || !p.rows_done.empty()) return process_rows(p, ps, exec);
  const Device dev = storage_.device();
  ScratchArena scratch(dev);
  std::vector<TensorView> inputs;
  for (uint32_t i = 0; i < p.inputs.size(); ++i) {
    const void* src = nullptr;
    if (i < p.whole.size() && p.whole[i].rows.data() != nullptr) {
      src = p.whole[i].rows.data();
      if (p.whole[i].rows.device() == dev) {
        // In place: host bytes into host storage, or a colocated trainer's device tensor.
        ++report_.direct_pieces;
        inputs.push_back(p.whole[i].rows);
        continue;
      }
    } else {
      FERRY_ASSIGN_OR_RETURN(const Buffer* b, input_buffer(p, i));
      src = b->data();
      if (!dev.is_cpu() && b->device() == dev) {  // staged on the device: read in place
        inputs.emplace_back(b->data(), p.inputs[i].dtype, p.inputs[i].shape, dev);
        continue;
      }
    }
    const auto& in = p.inputs[i];
    if (dev.is_cpu()) {
      inputs.emplace_back(const_cast<void*>(src), in.dtype, in.shape);
    } else {
      FERRY_ASSIGN_OR_RETURN(TensorView d, scratch.allocate(in.dtype, in.shape));
      FERRY_RETURN_IF_ERROR(copy_bytes(d.data(), dev, src, Device::cpu(), d.nbytes()));
      inputs.push_back(d);
    }
  }
  FERRY_RETURN_IF_ERROR(p.kernel->process(inputs, p.storage, scratch, exec).with_context(ps.name));
  // Scratch is freed on return: its readers finish first. Without scratch, finalize() waits once.
  if (!dev.is_cpu() && scratch.bytes() > 0) FERRY_RETURN_IF_ERROR(device_synchronize(dev));
  return ok_status();
}

Status ReloadEngine::snapshot_before_write(const Layer& layer) {
  const auto index = static_cast<uint32_t>(&layer - layers_.data());
  if (rollback_ != RollbackMode::kHost || snapshots_.holds(index)) return ok_status();
  // Before the first byte of this layer is overwritten: every registered tensor it owns.
  std::vector<TensorView> views;
  for (size_t i : registry_.layer_tensors(layer.name)) views.push_back(registry_.tensors()[i].view);
  return snapshots_.take(index, views).with_context("rollback snapshot of layer " + layer.name);
}

Status ReloadEngine::process(Layer& layer) {
  Status st = process_layer(layer);
  if (!st.ok() && !layer.processed) {
    // The layer cannot complete now: it is refused (finalize() names it) and keeps none of its
    // pieces, so lent or borrowed bytes are never read again, once the work it queued is done.
    if (Status synced = device_synchronize(storage_.device()); !synced.ok()) {
      FERRY_LOG_WARN("layer {}: {}", layer.name, synced.message());
    }
    layer.refused = true;
    release(layer);
  }
  return st;
}

Status ReloadEngine::process_layer(Layer& layer) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto index = static_cast<uint32_t>(&layer - layers_.data());
  FERRY_RETURN_IF_ERROR(snapshot_before_write(layer));
  kernels::Exec exec = options_.exec;
  if (streams_ != nullptr) {
    if (!forked_) FERRY_RETURN_IF_ERROR(streams_->fork());
    forked_ = true;
    // Device bytes someone else owns (a pooled buffer that a gather or a payload copy on the legacy
    // stream filled) are read after that work; bytes read in place need no wait.
    const auto filled = [](const Param::Lent& l) { return l.owner != nullptr && l.rows.device().is_cuda(); };
    const bool owned = std::any_of(layer.params.begin(), layer.params.end(), [&](uint32_t q) {
      const Param& p = params_[q];
      return std::any_of(p.lent.begin(), p.lent.end(), filled) || std::any_of(p.whole.begin(), p.whole.end(), filled);
    });
    if (owned) FERRY_RETURN_IF_ERROR(streams_->fork(index));
    exec.stream = streams_->stream(index);
  }
  Status st;
  for (uint32_t q : layer.params) {
    st = process_param(params_[q], spec_.params[q], exec);
    if (!st.ok()) break;
  }
  // Joined even after an error: what the layer queued is ordered before later work all the same.
  if (streams_ != nullptr) {
    if (Status joined = streams_->join(index); st.ok()) st = joined;
  }
  FERRY_RETURN_IF_ERROR(st);
  layer.processed = true;
  release(layer);
  report_.layers += 1;
  report_.process_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok_status();
}

void ReloadEngine::release(Layer& layer) {
  staging_bytes_ -= layer.staging_bytes;
  layer.staging_bytes = 0;
  if (layer.staged) --staged_layers_;
  layer.staged = false;
  for (uint32_t q : layer.params) {
    Param& p = params_[q];
    for (Buffer& b : p.staging) pool_.give(std::move(b));
    for (Buffer& b : p.piecewise) pool_.give(std::move(b));
    p.staging.clear();
    p.piecewise.clear();
    p.piecewise_views.clear();
    p.rows_done.clear();
    p.lent.clear();
    p.whole.clear();
  }
}

}  // namespace ferry::reload
