// Captured programs: a recorded sequence of kernel launches whose pointers are baked at capture and
// replayed without looking anything up, the way a CUDA graph runs. On the CPU the launches are
// closures over the views they were given; on a CUDA device they are enqueued on a capturing
// stream and instantiated as a real CUDA graph. Either way every launch declares the pointers it
// bakes, so audit() can prove that each one lies inside live registered storage (a CUDA graph's
// kernel parameters cannot be walked generically, so they are declared at capture instead).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "kernels/quantize.h"
#include "reload/registry.h"

namespace ferry::reload {

struct BakedPointer {
  const void* ptr = nullptr;
  size_t bytes = 0;
  std::string what;  // "layer 3 qkv gemm: weight_scale"
};

// A baked pointer for every byte range of `view`.
BakedPointer baked(const TensorView& view, std::string what);

class CapturedProgram {
 public:
  // A launch: enqueues (CUDA) or runs (CPU) one kernel with the pointers it was built with.
  using Launch = std::function<Status(const kernels::Exec&)>;

  // A program for `device`; on CUDA, capture() runs inside stream capture.
  static Result<std::unique_ptr<CapturedProgram>> create(Device device);
  ~CapturedProgram();
  CapturedProgram(const CapturedProgram&) = delete;
  CapturedProgram& operator=(const CapturedProgram&) = delete;

  // Memory the program owns (activations, caches), on its device; lives as long as the program.
  Result<TensorView> own(DType dtype, const Shape& shape);

  // Capture: between begin_capture() and end_capture(), record() declares a launch and the
  // pointers it bakes. On CUDA the launch is enqueued once on the capturing stream now; on the CPU
  // it is kept for replay.
  Status begin_capture();
  Status record(std::string kernel, std::vector<BakedPointer> pointers, Launch launch);
  Status end_capture();

  // Replays every launch in order and waits for them.
  Status replay();

  Device device() const { return device_; }
  bool is_cuda_graph() const { return device_.is_cuda(); }
  size_t launches() const { return kernels_.size(); }
  const std::vector<BakedPointer>& baked_pointers() const { return baked_; }
  std::vector<Identity> owned() const;

 private:
  explicit CapturedProgram(Device device);
  struct CudaState;

  Device device_;
  std::vector<Buffer> owned_;
  std::vector<std::string> kernels_;
  std::vector<Launch> launches_;
  std::vector<BakedPointer> baked_;
  bool capturing_ = false;
  bool captured_ = false;
  std::unique_ptr<CudaState> cuda_;
};

struct AuditReport {
  uint64_t pointers = 0;    // baked pointers checked
  uint64_t registered = 0;  // inside live registered storage
  uint64_t owned = 0;       // inside the program's own memory
  std::vector<std::string> stale;  // neither: the program reads memory the engine no longer owns
  bool clean() const { return stale.empty(); }
  std::string to_string() const;  // "audit: 0 stale of 57 baked pointers (52 registered, 5 owned)"
};

// Checks every pointer baked into `program` against the registry's live storage (`live` is the
// engine's live table) and the program's own memory.
AuditReport audit(const CapturedProgram& program, const LayerRegistry& registry, const LiveTable& live);
// The same as a Status: Internal naming the stale pointers.
Status audit_status(const CapturedProgram& program, const LayerRegistry& registry, const LiveTable& live);

}  // namespace ferry::reload
