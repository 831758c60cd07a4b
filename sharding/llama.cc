#include "sharding/llama.h"

#include <fmt/format.h>

namespace ferry::sharding {

Result<LlamaConfig> to_llama_config(const ModelConfig& c) {
  if (c.num_experts > 0) return Status::invalid_argument(fmt::format("{} is a mixture of experts, not a dense model", c.family));
  return c;
}

Manifest llama_manifest(const LlamaConfig& cfg) {
  auto model = describe_model(cfg);
  return model.ok() ? model_manifest(*model) : Manifest{};
}

Result<RankSpec> llama_rank_spec(const LlamaConfig& cfg, int tp_rank, int tp_size, Scheme linear_scheme) {
  FERRY_ASSIGN_OR_RETURN(LlamaConfig dense, to_llama_config(cfg));
  FERRY_RETURN_IF_ERROR(dense.validate(tp_size));
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return Status::invalid_argument(fmt::format("tp rank {} outside TP size {}", tp_rank, tp_size));
  }
  FERRY_ASSIGN_OR_RETURN(ModelDesc model, describe_model(dense));
  return model_rank_spec(model, tp_rank, tp_size, /*ep_size=*/1, linear_scheme);
}

}  // namespace ferry::sharding
