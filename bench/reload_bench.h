// `ferry bench reload`: a whole-model update into registered storage through the reload engine,
// from full-precision pieces (pre-quantized checkpoint pieces for gptq_int4) to quantized storage,
// for the demo's Llama shape and every scheme, beside the same-run copy baseline.
#pragma once

#include <string>

namespace ferry {

// Prints, per scheme, three lines (`device`: "cpu" or "all"; CUDA storage is not benchmarked yet):
//   {"bench":"reload","case":"<scheme>","device":"cpu","bytes":N,"seconds":S,"gbps":G,
//    "baseline":"memcpy","baseline_gbps":B,"ratio":R}
//     the engine fed by lend_piece() (a rank that owns its received buckets);
//   the same with "case":"<scheme>/copied": fed by apply_input_piece() (bytes valid during the
//     call only: whatever waits for its layer is copied);
//   the same with "case":"<scheme>/borrowed": fed by borrow_piece(), with release_borrowed() after
//     every FERRY_BUCKET_BYTES of pieces (a rank whose transport keeps its buckets);
//   the same with "case":"<scheme>/kernels": the bare processing kernels over the same parameters,
//   so that the engine's overhead over its kernels reads off the lines.
// bytes: piece bytes received plus storage bytes written; seconds: median of the timed updates
// (begin, every piece, finalize with the census); the baseline copies the same piece bytes.
// Returns 0, or 1 after printing the error.
int run_reload_bench(bool json, const std::string& device);

}  // namespace ferry
