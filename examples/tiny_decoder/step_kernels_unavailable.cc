// Without CUDA the decoder never runs on a device (Decoder::create refuses one); these keep the
// step's launches linkable.
#include "examples/tiny_decoder/step_kernels.h"

namespace tiny::cuda {
namespace {
ferry::Status unavailable() { return ferry::Status::unavailable("tiny decoder: ferry was built without CUDA"); }
}  // namespace

ferry::Status embed(const int32_t*, const uint16_t*, int64_t, int64_t, float*, void*) { return unavailable(); }
ferry::Status rmsnorm(const float*, const uint16_t*, float*, int64_t, float, void*) { return unavailable(); }
ferry::Status attention(float*, const int32_t*, float*, float*, float*, int, int, int, int, float, void*) {
  return unavailable();
}
ferry::Status residual(float*, const float*, int64_t, void*) { return unavailable(); }
ferry::Status swiglu(const float*, float*, int64_t, void*) { return unavailable(); }
ferry::Status argmax(const float*, int64_t, int32_t*, void*) { return unavailable(); }

}  // namespace tiny::cuda
