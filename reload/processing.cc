#include "reload/processing.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

#include "kernels/gptq.h"
#include "kernels/marlin_layout.h"
#include "reload/model_storage.h"

namespace ferry::reload {

Result<TensorView> ScratchArena::allocate(DType dtype, const Shape& shape) {
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(dtype_bytes(dtype, shape_numel(shape)), device_));
  FERRY_ASSIGN_OR_RETURN(TensorView v, b.view(dtype, shape));
  bytes_ += b.size();
  buffers_.push_back(std::move(b));
  return v;
}

void ScratchArena::clear() {
  buffers_.clear();
  bytes_ = 0;
}


#if FERRY_HAVE_CUDA
struct ProcessStreams::Impl {
  int device = 0;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> done;  // one per stream, recorded by join()
  cudaEvent_t forked = nullptr;
  ~Impl() {
    ScopedDevice d(device);
    for (cudaEvent_t e : done) cudaEventDestroy(e);
    if (forked != nullptr) cudaEventDestroy(forked);
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }
};

Result<std::unique_ptr<ProcessStreams>> ProcessStreams::create(int device, int count) {
  std::unique_ptr<ProcessStreams> ps(new ProcessStreams());
  ps->impl_ = std::make_unique<Impl>();
  Impl& m = *ps->impl_;
  m.device = device;
  ScopedDevice d(device);
  if (!d.ok()) return Status::unavailable(fmt::format("process streams: cannot use cuda:{}", device));
  FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&m.forked, cudaEventDisableTiming));
  for (int i = 0; i < std::max(count, 1); ++i) {
    // Non-blocking: the legacy default stream orders them only through fork() and join().
    cudaStream_t s = nullptr;
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    m.streams.push_back(s);
    cudaEvent_t e = nullptr;
    FERRY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.done.push_back(e);
  }
  return ps;
}

ProcessStreams::~ProcessStreams() = default;

Status ProcessStreams::fork() {
  for (size_t i = 0; i < impl_->streams.size(); ++i) FERRY_RETURN_IF_ERROR(fork(i));
  return ok_status();
}

Status ProcessStreams::fork(size_t layer) {
  ScopedDevice d(impl_->device);
  FERRY_CUDA_CHECK(cudaEventRecord(impl_->forked, cudaStreamLegacy));
  FERRY_CUDA_CHECK(cudaStreamWaitEvent(impl_->streams[layer % impl_->streams.size()], impl_->forked, 0));
  return ok_status();
}

void* ProcessStreams::stream(size_t layer) const { return impl_->streams[layer % impl_->streams.size()]; }

Status ProcessStreams::join(size_t layer) {
  const size_t i = layer % impl_->streams.size();
  ScopedDevice d(impl_->device);
  FERRY_CUDA_CHECK(cudaEventRecord(impl_->done[i], impl_->streams[i]));
  FERRY_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamLegacy, impl_->done[i], 0));
  return ok_status();
}
#else
struct ProcessStreams::Impl {};
Result<std::unique_ptr<ProcessStreams>> ProcessStreams::create(int, int) {
  return Status::unavailable("process streams: ferry was built without CUDA");
}
ProcessStreams::~ProcessStreams() = default;
Status ProcessStreams::fork() { return Status::unavailable("process streams: ferry was built without CUDA"); }
Status ProcessStreams::fork(size_t) { return Status::unavailable("process streams: ferry was built without CUDA"); }
void* ProcessStreams::stream(size_t) const { return nullptr; }
Status ProcessStreams::join(size_t) { return Status::unavailable("process streams: ferry was built without CUDA"); }
#endif

namespace {

// Rows [row0, row0 + rows) of a matrix of `total` rows are whole 128-row blocks of fp8_block (the
// last one however short when they reach the matrix's end).
bool whole_blocks(int64_t row0, int64_t rows, int64_t total) {
  return row0 % kFp8BlockSize == 0 && (rows % kFp8BlockSize == 0 || row0 + rows == total);
}

}  // namespace

Result<std::vector<TensorView>> storage_rows(Scheme scheme, std::span<const TensorView> full, int64_t row0,
                                             int64_t rows) {
  if (scheme == Scheme::kFp8PerTensor || scheme == Scheme::kGptqInt4) {
    return Status::invalid_argument(fmt::format("{}: no row-wise storage views", scheme_name(scheme)));
  }
  if (full.empty()) return Status::invalid_argument("storage_rows: no storage");
  const int64_t total = full[0].dim(0);
  if (row0 < 0 || rows < 0 || row0 + rows > total) {
    return Status::out_of_range(fmt::format("storage_rows: rows {}+{} of {}", row0, rows, total));
  }
  // fp8_block's scales cover 128-row bands of a matrix; of stacked matrices ([E, rows, cols]) the
  // first dimension counts whole matrices, each with its own scales, as it does any scheme's.
  const bool blocks = scheme == Scheme::kFp8Block && full[0].rank() == 2;
  if (blocks && !whole_blocks(row0, rows, total)) {
    return Status::invalid_argument(fmt::format("fp8_block: rows {}+{} do not cover whole 128-row blocks", row0, rows));
  }
  std::vector<TensorView> out;
  out.reserve(full.size());
  for (size_t i = 0; i < full.size(); ++i) {
    const TensorView& t = full[i];
    int64_t r0 = row0, n = rows;
    if (blocks && i == 1) {
      r0 = row0 / kFp8BlockSize;
      n = (row0 + rows + kFp8BlockSize - 1) / kFp8BlockSize - r0;
    }
    Shape shape = t.shape();
    if (shape.empty()) return Status::invalid_argument("storage_rows: scalar storage tensor");
    if (!blocks && i > 0 && shape.size() == 2 && shape[0] == 1 && shape[1] == total && total > 1) {
      // Scales of all rows in one row ([1, rows], SGLang's per-channel layout): columns of it.
      out.emplace_back(static_cast<char*>(t.data()) + dtype_bytes(t.dtype(), row0), t.dtype(), Shape{1, rows},
                       t.device());
      continue;
    }
    const int64_t per_row = shape[0] ? t.numel() / shape[0] : 0;
    shape[0] = n;
    char* base = static_cast<char*>(t.data()) + dtype_bytes(t.dtype(), r0 * per_row);
    out.emplace_back(base, t.dtype(), shape, t.device());
  }
  return out;
}

namespace {

// Marlin's tile of outputs: the rows of a 2-D int4 weight in an engine layout go in runs of it.
constexpr int64_t kMarlinRows = kernels::marlin::kChunkN;

class OnlineKernel final : public ProcessingKernel {
 public:
  OnlineKernel(sharding::ParamSpec param, EngineLayout layout)
      : scheme_(param.scheme), layout_(layout),
        marlin_(layout != EngineLayout::kFerry && param.scheme == Scheme::kInt4Group), param_(std::move(param)) {
    // An engine layout keeps one fp8_per_tensor scale for the whole fused parameter: only the whole
    // parameter is processed on its own then.
    if (layout_ != EngineLayout::kFerry && scheme_ == Scheme::kFp8PerTensor) param_.shard_rows.clear();
  }

  std::string name() const override { return std::string(scheme_name(scheme_)); }
  std::vector<kernels::StorageTensor> inputs() const override {
    return {{"weight", param_.source_dtype, param_.shape, false}};
  }
  Status process(std::span<const TensorView> inputs, std::span<const TensorView> storage, ScratchArena&,
                 const kernels::Exec& exec) override {
    return kernels::quantize(scheme_, layout_, inputs[0], param_.shard_rows, storage, exec);
  }
  bool can_process_rows(const Region& dst) const override {
    const Shape& s = param_.shape;
    for (size_t d = 1; d < s.size(); ++d) {
      if (dst.offset[d] != 0 || dst.size[d] != s[d]) return false;
    }
    // Marlin's repacked int4: a 2-D weight in whole 64-output chunks, a stacked one in whole matrices.
    if (marlin_ && s.size() == 2) return dst.offset[0] % kMarlinRows == 0 && dst.size[0] % kMarlinRows == 0;
    if (scheme_ == Scheme::kFp8PerTensor) {
      // Whole logical shards (q, k, v of a fused qkv): each has its own scale.
      return s.size() == 2 && shard_span(dst.offset[0], dst.size[0]).has_value();
    }
    if (scheme_ == Scheme::kFp8Block && s.size() == 2) {  // stacked matrices: any whole ones
      return whole_blocks(dst.offset[0], dst.size[0], s[0]);
    }
    return true;
  }
  std::pair<int64_t, int64_t> rows_within(const Region& dst) const override {
    const Shape& s = param_.shape;
    if (dst.rank() != static_cast<int>(s.size()) || s.empty()) return {0, 0};
    for (size_t d = 1; d < s.size(); ++d) {
      if (dst.offset[d] != 0 || dst.size[d] != s[d]) return {0, 0};
    }
    const int64_t begin = dst.offset[0], end = begin + dst.size[0];
    int64_t r0 = begin, r1 = end;
    if ((scheme_ == Scheme::kFp8Block || marlin_) && s.size() == 2) {
      // Whole bands (Marlin's 64-output chunks), and under fp8_block the last one however long when
      // the piece reaches the end of the tensor.
      const int64_t b = band_rows();
      r0 = (begin + b - 1) / b * b;
      r1 = end == s[0] ? end : end / b * b;
    } else if (scheme_ == Scheme::kFp8PerTensor) {
      // Whole logical shards.
      if (s.size() != 2) return {0, 0};
      const std::vector<int64_t> shards = param_.shard_rows.empty() ? std::vector<int64_t>{s[0]} : param_.shard_rows;
      int64_t at = 0;
      r0 = -1;
      for (size_t i = 0; i <= shards.size(); ++i) {
        if (r0 < 0 && at >= begin) r0 = at;
        if (at <= end) r1 = at;
        if (i < shards.size()) at += shards[i];
      }
    }
    if (r0 < begin || r1 > end || r0 >= r1) return {0, 0};
    Region run = dst;
    run.offset[0] = r0;
    run.size[0] = r1 - r0;
    return can_process_rows(run) ? std::pair<int64_t, int64_t>{r0, r1} : std::pair<int64_t, int64_t>{0, 0};
  }
  std::pair<int64_t, int64_t> rows_around(int64_t r0, int64_t r1) const override {
    const Shape& s = param_.shape;
    if (s.size() != 2) return {r0, r1};  // stacked matrices: a row of the first dimension is a matrix
    if (scheme_ == Scheme::kFp8Block || marlin_) {
      const int64_t b = band_rows();
      return {r0 / b * b, std::min(s[0], (r1 + b - 1) / b * b)};
    }
    if (scheme_ != Scheme::kFp8PerTensor) return {r0, r1};
    if (param_.shard_rows.empty()) return {0, s[0]};
    int64_t at = 0, b0 = 0, b1 = s[0];
    for (const int64_t n : param_.shard_rows) {
      if (at <= r0) b0 = at;
      at += n;
      if (at >= r1) {
        b1 = at;
        break;
      }
    }
    return {b0, b1};
  }
  bool can_process_band(const Region& dst) const override {
    const Shape& s = param_.shape;
    if (s.size() != 3 || dst.rank() != 3 || dst.size[0] != 1 || dst.offset[2] != 0 || dst.size[2] != s[2]) return false;
    if (marlin_) return dst.offset[1] % kMarlinRows == 0 && dst.size[1] % kMarlinRows == 0;
    if (scheme_ == Scheme::kFp8PerTensor) return false;  // one scale a matrix: only whole ones
    if (scheme_ == Scheme::kFp8Block) return whole_blocks(dst.offset[1], dst.size[1], s[1]);
    return true;  // row-local: every row's codes and scale are its own
  }
  Status process_band(const TensorView& input, int64_t matrix, int64_t row0, std::span<const TensorView> out,
                      const kernels::Exec& exec) override {
    // Matrix `matrix` of every storage tensor (each [matrices, ...]), then its rows as a 2-D
    // parameter's.
    std::vector<TensorView> one;
    one.reserve(out.size());
    for (const TensorView& t : out) {
      if (t.rank() < 2 || t.dim(0) != param_.shape[0]) {
        return Status::internal(fmt::format("{}: storage {} is not stacked by matrix", param_.name,
                                            shape_to_string(t.shape())));
      }
      const Shape inner(t.shape().begin() + 1, t.shape().end());
      const int64_t per = t.numel() / t.dim(0);
      one.emplace_back(static_cast<char*>(t.data()) + dtype_bytes(t.dtype(), matrix * per), t.dtype(), inner, t.device());
    }
    if (marlin_) {
      return kernels::quantize_marlin_rows(layout_, Shape(param_.shape.begin() + 1, param_.shape.end()), input, row0,
                                           one, exec);
    }
    FERRY_ASSIGN_OR_RETURN(auto rows, storage_rows(scheme_, one, row0, input.dim(0)));
    return kernels::quantize(scheme_, layout_, input, {}, rows, exec);
  }
  Result<int64_t> process_changed_rows(const TensorView& input, int64_t row0,
                                       std::span<const std::pair<int64_t, int64_t>> changed,
                                       std::span<const TensorView> out, const kernels::Exec& exec) override {
    if (scheme_ != Scheme::kFp8PerTensor || param_.shape.size() != 2) return 0;
    FERRY_ASSIGN_OR_RETURN(const ShardRows sr, shard_rows_of(input, row0, out));
    std::vector<std::pair<int64_t, int64_t>> rows;
    rows.reserve(changed.size());
    for (const auto& [r0, r1] : changed) rows.emplace_back(r0 - row0, r1 - row0);
    return kernels::quantize_rows_keeping_scales(scheme_, layout_, input, sr.shards, rows, sr.views, exec);
  }
  Status process_rows(const TensorView& input, int64_t row0, std::span<const TensorView> out,
                      const kernels::Exec& exec) override {
    if (marlin_) return kernels::quantize_marlin_rows(layout_, param_.shape, input, row0, out, exec);
    if (scheme_ == Scheme::kFp8PerTensor) {
      FERRY_ASSIGN_OR_RETURN(const ShardRows sr, shard_rows_of(input, row0, out));
      return kernels::quantize(scheme_, layout_, input, sr.shards, sr.views, exec);
    }
    FERRY_ASSIGN_OR_RETURN(auto rows, storage_rows(scheme_, out, row0, input.dim(0)));
    return kernels::quantize(scheme_, layout_, input, {}, rows, exec);
  }

 private:
  // fp8_per_tensor: the storage of whole shards, rows [row0, row0 + input.dim(0)) (their codes and
  // their scales), and those shards' rows.
  struct ShardRows {
    std::vector<TensorView> views;
    std::vector<int64_t> shards;
  };
  Result<ShardRows> shard_rows_of(const TensorView& input, int64_t row0, std::span<const TensorView> out) const {
    const auto span = shard_span(row0, input.dim(0));
    if (!span || out.size() != 2) {
      return Status::invalid_argument(
          fmt::format("{}: rows {}+{} are not whole shards", param_.name, row0, input.dim(0)));
    }
    const auto [s0, s1] = *span;
    const TensorView& codes = out[0];
    const int64_t cols = codes.rank() == 2 ? codes.dim(1) : 0;
    ShardRows sr;
    sr.views.emplace_back(static_cast<uint8_t*>(codes.data()) + row0 * cols, codes.dtype(), Shape{input.dim(0), cols},
                          codes.device());
    sr.views.emplace_back(out[1].data_as<float>() + s0, out[1].dtype(), Shape{s1 - s0}, out[1].device());
    if (!param_.shard_rows.empty()) sr.shards.assign(param_.shard_rows.begin() + s0, param_.shard_rows.begin() + s1);
    return sr;
  }

  // The shards [s0, s1) that rows [row0, row0 + n) cover exactly, if they do.
  std::optional<std::pair<int64_t, int64_t>> shard_span(int64_t row0, int64_t n) const {
    const int64_t total = param_.shape.empty() ? 0 : param_.shape[0];
    if (param_.shard_rows.empty()) {
      return row0 == 0 && n == total ? std::optional(std::pair<int64_t, int64_t>{0, 1}) : std::nullopt;
    }
    int64_t at = 0, s0 = -1;
    for (size_t i = 0; i <= param_.shard_rows.size(); ++i) {
      if (at == row0) s0 = static_cast<int64_t>(i);
      if (at == row0 + n && s0 >= 0 && n > 0) return std::pair<int64_t, int64_t>{s0, static_cast<int64_t>(i)};
      if (i < param_.shard_rows.size()) at += param_.shard_rows[i];
    }
    return std::nullopt;
  }

  // The rows a run of a 2-D weight goes in multiples of, where it does: fp8_block's 128-row blocks
  // and Marlin's 64-output chunks.
  int64_t band_rows() const { return marlin_ ? kMarlinRows : kFp8BlockSize; }

  Scheme scheme_;
  EngineLayout layout_;
  bool marlin_;
  sharding::ParamSpec param_;
};

class GptqKernel final : public ProcessingKernel {
 public:
  GptqKernel(std::vector<kernels::StorageTensor> inputs, EngineLayout layout)
      : inputs_(std::move(inputs)), layout_(layout) {}
  std::string name() const override { return "gptq_int4"; }
  std::vector<kernels::StorageTensor> inputs() const override { return inputs_; }
  Status process(std::span<const TensorView> in, std::span<const TensorView> storage, ScratchArena&,
                 const kernels::Exec& exec) override {
    // Derives perm from g_idx into the registered perm and zeroes the registered workspace: both
    // runtime tensors are rewritten in place, never reallocated.
    return kernels::gptq_reload(layout_, in[0], in[1], in[2], storage, exec);
  }

 private:
  std::vector<kernels::StorageTensor> inputs_;
  EngineLayout layout_;
};

}  // namespace

Result<std::unique_ptr<ProcessingKernel>> scheme_kernel(const sharding::ParamSpec& param, DType /*none_dtype*/,
                                                        EngineLayout layout) {
  if (param.scheme == Scheme::kGptqInt4) {
    auto in = kernels::gptq_checkpoint_layout(param.shape);
    if (!in.ok()) return in.status().with_context(param.name);
    return std::unique_ptr<ProcessingKernel>(new GptqKernel(std::move(*in), layout));
  }
  return std::unique_ptr<ProcessingKernel>(new OnlineKernel(param, layout));
}

}  // namespace ferry::reload
