#include "core/region_copy.h"

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/device_copy.h"
#include "core/parallel.h"
#include "core/work_pool.h"

namespace ferry {
namespace {

// Walks the region as contiguous runs: the innermost dimensions that the region spans completely
// merge into one run, so whole-row shards copy as one memcpy.
template <typename Fn>
Status for_each_run(const TensorView& t, const Region& region, size_t io_bytes, Fn&& fn) {
  if (!t.is_contiguous()) return Status::invalid_argument("region copy needs a contiguous tensor: " + t.describe());
  if (dtype_bits(t.dtype()) % 8) return Status::invalid_argument("region copy needs whole-byte elements");
  if (!region.inside(t.shape())) {
    return Status::out_of_range(fmt::format("region {} outside tensor {}", region.to_string(), t.describe()));
  }
  const size_t elem = static_cast<size_t>(dtype_bits(t.dtype()) / 8);
  const size_t need = static_cast<size_t>(region.numel()) * elem;
  if (io_bytes != need) {
    return Status::invalid_argument(fmt::format("region {} of {} holds {} bytes, buffer has {}", region.to_string(),
                                                t.describe(), need, io_bytes));
  }
  if (need == 0) return ok_status();
  const int rank = t.rank();
  const Shape strides = contiguous_strides(t.shape());
  // Merge trailing dims covered whole into one run.
  int inner = rank - 1;
  int64_t run = rank == 0 ? 1 : region.size[static_cast<size_t>(inner)];
  while (inner > 0 && region.size[static_cast<size_t>(inner)] == t.dim(inner) &&
         region.offset[static_cast<size_t>(inner)] == 0) {
    --inner;
    run *= region.size[static_cast<size_t>(inner)];
  }
  if (rank == 0) {
    fn(0, 0, elem);
    return ok_status();
  }
  Shape idx(static_cast<size_t>(inner), 0);  // counters over the outer dims
  size_t packed = 0;
  const size_t run_bytes = static_cast<size_t>(run) * elem;
  while (true) {
    int64_t off = 0;
    for (int d = 0; d < inner; ++d) off += (region.offset[static_cast<size_t>(d)] + idx[static_cast<size_t>(d)]) * strides[static_cast<size_t>(d)];
    off += region.offset[static_cast<size_t>(inner)] * strides[static_cast<size_t>(inner)];
    fn(static_cast<size_t>(off) * elem, packed, run_bytes);
    packed += run_bytes;
    int d = inner - 1;
    for (; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < region.size[static_cast<size_t>(d)]) break;
      idx[static_cast<size_t>(d)] = 0;
    }
    if (d < 0) break;
  }
  return ok_status();
}

Status host_only(const TensorView& t) {
  if (t.device().is_cpu()) return ok_status();
  return Status::invalid_argument("region copy runs on host tensors: " + t.describe());
}

// The runs of a region of a device tensor, each as a copy between it and `packed`, the runs that
// lie a fixed pitch apart merged into one strided copy; queued on this thread's stream of the
// device, then waited for.
Status copy_region_on_device(const TensorView& t, const Region& region, void* packed, size_t bytes, bool to_packed) {
  if (!t.device().is_cuda()) return Status::invalid_argument("device region copy of a host tensor: " + t.describe());
  // After the work queued so far on the legacy default stream (a new shadow's cudaMemset, kernels
  // still reading or writing these bytes); the copies run on this thread's own stream.
  FERRY_RETURN_IF_ERROR(order_default_before_copies(t.device().index));
  auto* base = static_cast<uint8_t*>(t.data());
  auto* p = static_cast<uint8_t*>(packed);
  struct Group {
    size_t t_off = 0, p_off = 0, run = 0, pitch = 0, rows = 0;
  } g;
  Status st = ok_status();
  const auto flush = [&] {
    if (g.rows == 0 || !st.ok()) return;
    st = to_packed ? copy_rows_async(t.device().index, p + g.p_off, g.run, base + g.t_off, g.pitch, g.run, g.rows)
                   : copy_rows_async(t.device().index, base + g.t_off, g.pitch, p + g.p_off, g.run, g.run, g.rows);
    g.rows = 0;
  };
  const Status walked = for_each_run(t, region, bytes, [&](size_t t_off, size_t p_off, size_t n) {
    if (g.rows == 1) g.pitch = t_off - g.t_off;
    if (g.rows > 0 && n == g.run && p_off == g.p_off + g.rows * n && t_off == g.t_off + g.rows * g.pitch) {
      ++g.rows;
      return;
    }
    flush();
    g = Group{t_off, p_off, n, n, 1};
  });
  if (walked.ok()) flush();
  // Whatever was queued lands before the caller reuses the memory, whichever way this ends.
  const Status waited = wait_copies(t.device().index);
  FERRY_RETURN_IF_ERROR(walked);
  FERRY_RETURN_IF_ERROR(st);
  return waited;
}

}  // namespace

Status pack_region_on_device(const TensorView& tensor, const Region& region, void* out, size_t out_bytes) {
  return copy_region_on_device(tensor, region, out, out_bytes, /*to_packed=*/true);
}

Status unpack_region_on_device(const TensorView& tensor, const Region& region, const void* in, size_t in_bytes) {
  return copy_region_on_device(tensor, region, const_cast<void*>(in), in_bytes, /*to_packed=*/false);
}

namespace {

// A host region's runs copied to (`to_packed`) or from a packed buffer. A region of 2 MiB or more
// is shared out on the work pool: a single run (whole rows) by copy_parallel, many runs (a rank's
// columns of a row-parallel weight) in slices of runs of at least 1 MiB.
Status copy_region_on_host(const TensorView& tensor, const Region& region, uint8_t* packed, size_t bytes,
                           bool to_packed) {
  FERRY_RETURN_IF_ERROR(host_only(tensor));
  auto* base = static_cast<uint8_t*>(const_cast<void*>(tensor.data()));
  const auto copy = [&](size_t t_off, size_t p_off, size_t n) {
    if (to_packed) {
      std::memcpy(packed + p_off, base + t_off, n);
    } else {
      std::memcpy(base + t_off, packed + p_off, n);
    }
  };
  constexpr size_t kSlice = size_t{1} << 20;
  if (bytes < 2 * kSlice) return for_each_run(tensor, region, bytes, copy);
  struct Run {
    size_t t_off, p_off, n;
  };
  std::vector<Run> runs;
  FERRY_RETURN_IF_ERROR(for_each_run(tensor, region, bytes, [&](size_t t, size_t p, size_t n) {
    runs.push_back(Run{t, p, n});
  }));
  if (runs.size() == 1) {
    const Run& r = runs.front();
    if (to_packed) {
      copy_parallel(packed + r.p_off, base + r.t_off, r.n);
    } else {
      copy_parallel(base + r.t_off, packed + r.p_off, r.n);
    }
    return ok_status();
  }
  const size_t slices = std::min(slices_for(bytes, kSlice), runs.size());
  run_pieces(slices, [&](size_t t) {
    for (size_t i = runs.size() * t / slices; i < runs.size() * (t + 1) / slices; ++i) {
      copy(runs[i].t_off, runs[i].p_off, runs[i].n);
    }
  });
  return ok_status();
}

}  // namespace

Status pack_region(const TensorView& tensor, const Region& region, void* out, size_t out_bytes) {
  return copy_region_on_host(tensor, region, static_cast<uint8_t*>(out), out_bytes, /*to_packed=*/true);
}

Status unpack_region(const TensorView& tensor, const Region& region, const void* in, size_t in_bytes) {
  return copy_region_on_host(tensor, region, static_cast<uint8_t*>(const_cast<void*>(in)), in_bytes,
                             /*to_packed=*/false);
}

const uint8_t* region_span(const TensorView& tensor, const Region& region) {
  return tensor.device().is_cpu() ? region_span_anywhere(tensor, region) : nullptr;
}

const uint8_t* region_span_anywhere(const TensorView& tensor, const Region& region) {
  if (!tensor.is_contiguous() || dtype_bits(tensor.dtype()) % 8 || !region.inside(tensor.shape())) {
    return nullptr;
  }
  // One run: past the first dimension the region does not span whole, every dimension is whole,
  // and before it every dimension is one element.
  const size_t rank = tensor.shape().size();
  size_t d = 0;
  while (d < rank && region.size[d] == 1) ++d;
  for (size_t k = d + 1; k < rank; ++k) {
    if (region.offset[k] != 0 || region.size[k] != tensor.shape()[k]) return nullptr;
  }
  const Shape strides = contiguous_strides(tensor.shape());
  int64_t off = 0;
  for (size_t k = 0; k < rank; ++k) off += region.offset[k] * strides[k];
  return static_cast<const uint8_t*>(tensor.data()) + static_cast<size_t>(off) * static_cast<size_t>(dtype_bits(tensor.dtype()) / 8);
}

}  // namespace ferry
