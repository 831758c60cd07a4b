// Processing kernels: what turns one parameter's checkpoint-format inputs into its registered
// storage. A kernel receives views of registered storage (it cannot rebind them: it never sees the
// live table) and writes into them in place; scratch comes only from the engine, which frees it
// after the copy-in.
#pragma once

#include "core/device_copy.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "kernels/quantize.h"
#include "sharding/model_spec.h"

namespace ferry::reload {

// Engine-owned scratch for one layer's processing; everything is freed together after the copy-in.
class ScratchArena {
 public:
  explicit ScratchArena(Device device) : device_(device) {}
  Result<TensorView> allocate(DType dtype, const Shape& shape);
  uint64_t bytes() const { return bytes_; }
  void clear();

 private:
  Device device_;
  std::vector<Buffer> buffers_;
  uint64_t bytes_ = 0;
};

class ProcessingKernel {
 public:
  virtual ~ProcessingKernel() = default;
  virtual std::string name() const = 0;
  // The checkpoint-format tensors the parameter's pieces fill, in order (input index of a piece).
  // Online schemes take one: the full-precision parameter.
  virtual std::vector<kernels::StorageTensor> inputs() const = 0;
  // Processes the whole parameter: `inputs` (checkpoint format, on the storage device) into
  // `storage` (registered views, kernels::storage_layout order).
  virtual Status process(std::span<const TensorView> inputs, std::span<const TensorView> storage,
                         ScratchArena& scratch, const kernels::Exec& exec) = 0;
  // Piece by piece: true when a piece landing at `dst` can be processed on its own (it covers whole
  // rows, or whole blocks). Such pieces never wait for the rest of the parameter.
  virtual bool can_process_rows(const Region& /*dst*/) const { return false; }
  // For a piece of whole rows that can_process_rows() refuses: the largest run of its rows
  // [first, second) that it accepts, so that only the rest waits in staging; empty when none.
  virtual std::pair<int64_t, int64_t> rows_within(const Region& /*dst*/) const { return {0, 0}; }
  // The smallest run of whole rows around rows [r0, r1) whose processing writes everything those
  // rows' values reach: the rows themselves for row-local schemes, their 128-row blocks under
  // fp8_block, their logical shards under fp8_per_tensor (a scale sees every element of its shard).
  virtual std::pair<int64_t, int64_t> rows_around(int64_t r0, int64_t r1) const { return {r0, r1}; }
  // Rows [row0, row0 + input.dim(0)), a run rows_around() gave (`input` holding exactly those rows),
  // of a parameter whose rows outside `changed` (sorted, disjoint, inside the run) are as they were
  // when `out` was processed: writes what processing the run would, touching only what changed
  // (fp8_per_tensor: a shard whose scale comes out as stored gets only its changed rows), and
  // returns the rows processed; 0 when it wrote nothing and the run must be processed whole.
  virtual Result<int64_t> process_changed_rows(const TensorView& /*input*/, int64_t /*row0*/,
                                               std::span<const std::pair<int64_t, int64_t>> /*changed*/,
                                               std::span<const TensorView> /*out*/, const kernels::Exec& /*exec*/) {
    return 0;
  }
  // Processes rows [row0, row0 + input.dim(0)) of the parameter, `input` holding exactly those
  // rows, into `out`, which has the layout of the storage (the storage itself, or a scratch copy of
  // it while an update is staged). It writes those rows of `out` and nothing else.
  virtual Status process_rows(const TensorView& /*input*/, int64_t /*row0*/, std::span<const TensorView> /*out*/,
                              const kernels::Exec& /*exec*/) {
    return Status::internal(name() + ": no piece-by-piece processing");
  }
  // A band of one matrix of stacked ones ([matrices, rows, cols...]: the rows of one expert's gate
  // or up in a fused w13, from a trainer that holds a tensor per expert): true when a piece landing
  // at `dst` (one matrix, whole in every dimension after the rows) can be processed on its own
  // (row-local schemes; fp8_block on whole 128-row blocks), whatever covers the matrix's other rows.
  virtual bool can_process_band(const Region& /*dst*/) const { return false; }
  // Processes rows [row0, row0 + input.dim(0)) of matrix `matrix`, `input` holding exactly those
  // rows (as [rows, cols...]), into `out` (the storage's layout, all matrices).
  virtual Status process_band(const TensorView& /*input*/, int64_t /*matrix*/, int64_t /*row0*/,
                              std::span<const TensorView> /*out*/, const kernels::Exec& /*exec*/) {
    return Status::internal(name() + ": no band processing");
  }
};

// The kernel ferry uses for `param`'s scheme: online quantization for every online scheme, and
// quantized reload for gptq_int4 (inputs qweight, scales, g_idx; the permutation and the zeroed
// workspace are written in place into their registered runtime tensors).
// `layout`: whose kernels read the storage (kernels/quantize.h "Engine layouts").
Result<std::unique_ptr<ProcessingKernel>> scheme_kernel(const sharding::ParamSpec& param,
                                                        DType none_dtype = DType::kBF16,
                                                        EngineLayout layout = EngineLayout::kFerry);

// Chooses a kernel per parameter; tests plug in their own.
using KernelFactory = std::function<Result<std::unique_ptr<ProcessingKernel>>(const sharding::ParamSpec&)>;

// Views of rows [row0, row0 + rows) of every tensor of an online scheme's storage `full` (which
// follows storage_layout for `shape`, in any engine layout: a [1, rows] scale gives its columns).
// Fails when the rows do not align with the scheme's grouping.
Result<std::vector<TensorView>> storage_rows(Scheme scheme, std::span<const TensorView> full, int64_t row0,
                                             int64_t rows);

// Host/device byte copies and device waits live in core (core/device_copy.h).
using ::ferry::copy_bytes;
using ::ferry::device_synchronize;

// A few streams of a CUDA device that an engine's layers are processed on, one layer to a stream in
// turn, so that the kernels of one layer (and their tails: most of a layer's tensors fill the GPU for
// a few microseconds) overlap the next layer's. They fork from and join back to the device's legacy
// default stream: fork() makes them wait for what was queued there before (the paused engine's own
// work, when an update begins), and join(layer) makes what is queued there afterwards wait for the
// layer (a device bucket's payload copy about to reuse a buffer the layer read: coordinator/
// device_bucket.cc), so the engine's ordering with other work is what it was on the legacy stream.
class ProcessStreams {
 public:
  // Unavailable without CUDA.
  static Result<std::unique_ptr<ProcessStreams>> create(int device, int count);
  ~ProcessStreams();
  ProcessStreams(const ProcessStreams&) = delete;
  ProcessStreams& operator=(const ProcessStreams&) = delete;

  Status fork();  // every stream waits for the legacy stream's work so far
  // The stream of `layer` alone waits for it: the layer reads bytes that work queued there wrote
  // (a gathered or copied piece in a pooled buffer); that work comes after the earlier layers'
  // joins, so such a layer starts after them, as on the legacy stream.
  Status fork(size_t layer);
  void* stream(size_t layer) const;  // a cudaStream_t
  Status join(size_t layer);

 private:
  ProcessStreams() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::reload
