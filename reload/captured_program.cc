#include "reload/captured_program.h"

#include <fmt/format.h>

#if FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace ferry::reload {

BakedPointer baked(const TensorView& view, std::string what) { return {view.data(), view.nbytes(), std::move(what)}; }

#if FERRY_HAVE_CUDA
struct CapturedProgram::CudaState {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~CudaState() {
    if (exec) (void)cudaGraphExecDestroy(exec);
    if (graph) (void)cudaGraphDestroy(graph);
    if (stream) (void)cudaStreamDestroy(stream);
  }
};
#else
struct CapturedProgram::CudaState {};
#endif

Result<std::unique_ptr<CapturedProgram>> CapturedProgram::create(Device device) {
  std::unique_ptr<CapturedProgram> p(new CapturedProgram(device));
  if (device.is_cuda()) {
#if FERRY_HAVE_CUDA
    p->cuda_ = std::make_unique<CudaState>();
    FERRY_CUDA_CHECK(cudaSetDevice(device.index));
    FERRY_CUDA_CHECK(cudaStreamCreateWithFlags(&p->cuda_->stream, cudaStreamNonBlocking));
#else
    return Status::unavailable("CUDA graph: ferry was built without CUDA");
#endif
  }
  return p;
}

CapturedProgram::CapturedProgram(Device device) : device_(device) {}
CapturedProgram::~CapturedProgram() = default;

Result<TensorView> CapturedProgram::own(DType dtype, const Shape& shape) {
  if (captured_) return Status::failed_precondition("program memory must be allocated before capture ends");
  FERRY_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(dtype_bytes(dtype, shape_numel(shape)), device_));
  FERRY_RETURN_IF_ERROR(b.zero());
  FERRY_ASSIGN_OR_RETURN(TensorView v, b.view(dtype, shape));
  owned_.push_back(std::move(b));
  return v;
}

Status CapturedProgram::begin_capture() {
  if (capturing_ || captured_) return Status::failed_precondition("a program is captured once");
  capturing_ = true;
#if FERRY_HAVE_CUDA
  if (cuda_) FERRY_CUDA_CHECK(cudaStreamBeginCapture(cuda_->stream, cudaStreamCaptureModeThreadLocal));
#endif
  return ok_status();
}

Status CapturedProgram::record(std::string kernel, std::vector<BakedPointer> pointers, Launch launch) {
  if (!capturing_) return Status::failed_precondition("record() outside capture");
  for (auto& p : pointers) {
    if (p.what.empty()) p.what = kernel;
    baked_.push_back(std::move(p));
  }
  kernels_.push_back(std::move(kernel));
#if FERRY_HAVE_CUDA
  if (cuda_) {
    kernels::Exec exec;
    exec.stream = cuda_->stream;
    Status st = launch(exec);
    if (!st.ok()) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(cuda_->stream, &g);
      if (g) (void)cudaGraphDestroy(g);
      capturing_ = false;
      return st.with_context("capturing " + kernels_.back());
    }
    return ok_status();
  }
#endif
  launches_.push_back(std::move(launch));
  return ok_status();
}

Status CapturedProgram::end_capture() {
  if (!capturing_) return Status::failed_precondition("end_capture() without begin_capture()");
  capturing_ = false;
#if FERRY_HAVE_CUDA
  if (cuda_) {
    FERRY_CUDA_CHECK(cudaStreamEndCapture(cuda_->stream, &cuda_->graph));
    FERRY_CUDA_CHECK(cudaGraphInstantiate(&cuda_->exec, cuda_->graph, 0));
  }
#endif
  captured_ = true;
  return ok_status();
}

Status CapturedProgram::replay() {
  if (!captured_) return Status::failed_precondition("replay() of a program that was not captured");
#if FERRY_HAVE_CUDA
  if (cuda_) {
    FERRY_CUDA_CHECK(cudaGraphLaunch(cuda_->exec, cuda_->stream));
    FERRY_CUDA_CHECK(cudaStreamSynchronize(cuda_->stream));
    return ok_status();
  }
#endif
  const kernels::Exec exec{};
  for (size_t i = 0; i < launches_.size(); ++i) {
    FERRY_RETURN_IF_ERROR(launches_[i](exec).with_context("replaying " + kernels_[i]));
  }
  return ok_status();
}

std::vector<Identity> CapturedProgram::owned() const {
  std::vector<Identity> out;
  for (const Buffer& b : owned_) out.push_back({b.data(), b.size()});
  return out;
}

std::string AuditReport::to_string() const {
  return fmt::format("audit: {} stale of {} baked pointers ({} registered, {} owned)", stale.size(), pointers,
                     registered, owned);
}

AuditReport audit(const CapturedProgram& program, const LayerRegistry& registry, const LiveTable& live) {
  AuditReport r;
  const auto owned = program.owned();
  for (const BakedPointer& p : program.baked_pointers()) {
    ++r.pointers;
    if (registry.owner_of(live, p.ptr, p.bytes) != nullptr) {
      ++r.registered;
      continue;
    }
    bool mine = false;
    for (const Identity& o : owned) mine = mine || o.contains(p.ptr, p.bytes);
    if (mine) {
      ++r.owned;
      continue;
    }
    r.stale.push_back(fmt::format("{} at {} ({} bytes)", p.what, p.ptr, p.bytes));
  }
  return r;
}

Status audit_status(const CapturedProgram& program, const LayerRegistry& registry, const LiveTable& live) {
  const AuditReport r = audit(program, registry, live);
  if (r.clean()) return ok_status();
  std::string names;
  for (size_t i = 0; i < r.stale.size() && i < 8; ++i) names += "\n  " + r.stale[i];
  return Status::internal(fmt::format("{}: the program reads memory outside live registered storage:{}{}",
                                      r.to_string(), names, r.stale.size() > 8 ? "\n  ..." : ""));
}

}  // namespace ferry::reload
