// Feeds a whole checkpoint held in host memory into a ReloadEngine as pieces, the way a rank
// receives them from buckets: slice by slice in plan order, optionally cut into chunks of rows or
// reordered. Used by the tiny decoder, the benchmark and the tests.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "reload/engine.h"

namespace ferry::reload {

// Host tensors by checkpoint name. Quantized-reload inputs (gptq_int4) are named after the engine
// parameter with the input's suffix: "model.layers.0.mlp.down_proj.qweight".
using Checkpoint = std::map<std::string, TensorView>;

struct LoadOptions {
  int64_t chunk_rows = 0;   // cut each slice into pieces of at most this many rows; 0: whole slices
  bool reverse_layers = false;  // feed layers last to first
  uint64_t shuffle_seed = 0;    // non-zero: shuffle the pieces of every layer
  bool interleave_layers = false;  // alternate pieces between all layers (out-of-order input)
  // A CUDA device: every piece is uploaded there and lent to the engine in device memory, the way a
  // colocated trainer's tensors reach a rank (read in place by the kernels). CPU: host pieces.
  Device lend_from = Device::cpu();
  // Host pieces are lent (lend_piece(), each packed piece owned by the engine until its layer is
  // processed) instead of copied (apply_input_piece()): a rank that owns its received buckets.
  bool lend = false;
  // Non-zero: pieces are packed one after another into a bucket of this many bytes (a larger piece
  // fills one of its own) and borrowed (borrow_piece()) until the bucket is full; then
  // release_borrowed(), and the bucket is overwritten with 0xff bytes before it is reused, the way a
  // transport reuses its receive buffer once the bucket's callback returned.
  uint64_t borrow_bucket_bytes = 0;
  // The update's trainer ranks (ReloadEngine::begin), and what runs after begin() before the first
  // piece (a test's note_sender() or drop_shadow(), as buckets would say them).
  int senders = 1;
  std::function<void(ReloadEngine&)> after_begin;
  // A staged update (ReloadEngine::begin's `stage`): every piece is held, then apply_staged().
  bool stage = false;
  // Staged: called with every piece held, before apply_staged().
  std::function<void(ReloadEngine&)> before_apply;
};

// begin(version), every piece, finalize().
Result<EngineReport> load_checkpoint(ReloadEngine& engine, const Checkpoint& checkpoint, uint64_t version,
                                     const LoadOptions& options = {});

}  // namespace ferry::reload
