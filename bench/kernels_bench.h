// `ferry bench kernels`: quantize throughput of every scheme against a plain copy of its input.
#pragma once

#include <cstddef>
#include <string>

namespace ferry {

// Prints one line per scheme per device (`device`: "cpu", "cuda" or "all"; "all" skips CUDA when no
// device is present). With `json`, each line is
//   {"bench":"kernels","case":"<scheme>","device":"cpu|cuda","bytes":N,"seconds":S,"gbps":G,
//    "baseline":"memcpy","baseline_gbps":B,"ratio":R}
// bytes: the input read once plus every storage tensor written (fp8_per_tensor reads its input
// twice but is charged once); seconds: median of the timed runs; the baseline copies the kernel's
// input buffer (memcpy on the host, cudaMemcpy device-to-device on the GPU), its GB/s counting bytes
// read plus bytes written. The input is bf16 [rows, cols]; gptq_int4 times gptq_reload of the
// equivalent checkpoint. Returns 0, or 1 after printing the error.
int run_kernels_bench(bool json, const std::string& device, size_t rows, size_t cols);

}  // namespace ferry
