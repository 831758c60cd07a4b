// `ferry bench e2e --delta`: what sending only the changed elements, and staging while serving, do
// to an update, on a 117M-parameter Llama (e2e::model_config("delta")) whose step-to-step changes
// come from real Adam steps (beta 0.9 / 0.999, lr 1e-6, fp32 master weights cast to the bf16 the
// trainer sends; gradients are seeded noise around a fixed direction per element, as a loss
// landscape would give). Per transport, four cases, each with a trainer and rank processes of its
// own, one dense warm-up update and `updates` timed ones of the same Adam trajectory:
//   dense          FERRY_DELTA=off, pause first
//   delta          FERRY_DELTA=on, pause first (on: the bench's ranks share its host, where auto
//                  would send dense bytes)
//   dense_staged   FERRY_DELTA=off, staged while serving
//   delta_staged   FERRY_DELTA=on, staged while serving
// Each prints the bytes on the wire (payload, summed over ranks), the update's seconds, the pause
// window (time the replica did not serve) and the ranks' processing time (the apply). One line per
// transport:
//   {"bench":"e2e-delta","case":"<transport>/<scheme>","tp":T,"updates":N,"bytes":B,
//    "changed_fraction":F,"dense":{..},"delta":{..},"dense_staged":{..},"delta_staged":{..},
//    "wire_ratio":dense wire/delta wire,"speedup":dense s/delta s,
//    "window_over_apply":delta_staged window/delta_staged apply}
// where each case is {"wire_bytes":..,"seconds":..,"pause_window":..,"apply":..,"staged":..,"sending":..,
// "compare":..,"copy":..} (sending: the trainer's transfer; compare and copy: its delta work within it,
// UpdateReport::compare_seconds and copy_seconds): medians over the
// timed updates.
#pragma once

#include <string>

#include "bench/e2e_bench.h"
#include "core/status.h"

namespace ferry {

Status run_delta_case(const E2eOptions& options, const std::string& transport);

}  // namespace ferry
