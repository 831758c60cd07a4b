// An independent reference for the demo: what every TP rank's storage must hold after an update,
// computed from the trainer's full tensors with none of ferry's planner, sharding or kernels.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace demo {

struct Model {
  int64_t hidden = 256;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t intermediate = 512;
  int64_t vocab = 1000;
  int64_t layers = 4;
  int64_t vocab_pad = 64;
  int64_t head_dim() const { return hidden / heads; }
};

// A full-precision checkpoint tensor, bf16 bits, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<uint16_t> bf16;
};

using Checkpoint = std::map<std::string, HostTensor>;

// The checkpoint of `version`: every tensor changes with the version.
Checkpoint make_checkpoint(const Model& m, uint64_t version);

// Storage name -> expected bytes on TP rank `r` of `tp`, linear layers in fp8_per_tensor.
std::map<std::string, std::vector<uint8_t>> expected_storage(const Model& m, const Checkpoint& ck, int r, int tp);

}  // namespace demo
