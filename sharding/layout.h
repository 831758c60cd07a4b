// A model described as rules, one per engine parameter, each with a layout that says how its
// checkpoint sources are fused and sharded over the TP (and expert-parallel) ranks of a replica.
// Presets, Hugging Face configs and user mapping files all become a ModelDesc; one engine turns it
// into every rank's RankSpec.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "sharding/model_spec.h"

namespace ferry::sharding {

enum class Layout : uint8_t {
  kReplicated,     // every rank holds the whole tensor (norms, routers, row-parallel biases)
  kColumn,         // dim 0 split over TP in units of `unit` rows (heads)
  kRow,            // dim 1 split over TP
  kMergedColumn,   // several sources (or sections of one), each split on dim 0, one after another (gate_up)
  kQkv,            // q, k, v split by heads; KV heads replicated when TP exceeds them
  kVocabParallel,  // dim 0 split in shards padded to a multiple of `pad_multiple` rows
  kExperts,        // per-expert sources fused into [experts on this rank, rows, cols]
};

std::string_view layout_name(Layout layout);
Result<Layout> parse_layout(std::string_view name);

struct ParamRule {
  std::string param;                 // engine name on every rank
  std::string layer;                 // empty: layer_of(param)
  Layout layout = Layout::kReplicated;
  std::vector<std::string> sources;  // checkpoint names; for kExperts templates holding "{E}"
  std::vector<Shape> shapes;         // full shape of each source (of one expert for kExperts)
  DType dtype = DType::kBF16;        // dtype of the sources
  bool quantize = false;             // true: the rank's linear scheme; false: none
  int64_t unit = 1;                  // kColumn: rows that stay together (a head)
  // kMergedColumn of one source: its dim-0 sections, each split over TP like a source of its own
  // (a depthwise conv1d's q, k and v channels, as vLLM's mamba_v2_sharded_weight_loader cuts them).
  std::vector<int64_t> sections;
  int64_t num_heads = 0;             // kQkv
  int64_t num_kv_heads = 0;          // kQkv
  int64_t head_dim = 0;              // kQkv
  int64_t pad_multiple = 1;          // kVocabParallel
  int64_t num_experts = 0;           // kExperts
  Layout expert_split = Layout::kColumn;  // kExperts: kColumn (gate, up), kRow (down) or kReplicated
  // kExperts: the name of one tensor that holds every expert stacked, [num_experts, rows of the
  // sources one after another, cols] (transformers' fused experts: gate_up_proj, down_proj); the
  // trainer then sends it instead of one tensor per expert and source, and the plan cuts whole
  // boxes of experts from it. Empty: the {E} sources, one tensor each.
  std::string stacked;
};

struct ModelDesc {
  std::string name;
  std::vector<ParamRule> params;
};

// Name of expert `e` from a template holding "{E}".
std::string expert_name(std::string_view tmpl, int64_t e);

// The shape of a kExperts rule's stacked tensor: [num_experts, rows of every source, cols].
Shape stacked_shape(const ParamRule& rule);

// Every expert rule of `model` with its experts held stacked, named with the suffixes transformers'
// fused experts use (Qwen3MoeExperts): the {E} template's prefix ("model.layers.N.mlp.experts.")
// plus "gate_up_proj" for a column-split rule (gate and up, in that order) or "down_proj" for a
// row-split one. A trainer whose stacked tensors are named otherwise (or whose module path differs
// from the checkpoint's) names them in a mapping file's "stacked" key. A rule already stacked stays.
Status stack_experts(ModelDesc& model);

// Every tensor a trainer sends, each once (a tied source used by two rules appears once).
Manifest model_manifest(const ModelDesc& model);
// Parameters of the model (elements of the manifest).
int64_t model_numel(const ModelDesc& model);

// Checks that every rule can be laid out over `tp_size` ranks in `ep_size` expert groups; errors
// name the parameter and its source.
Status validate_model(const ModelDesc& model, int tp_size, int ep_size);

// TP rank `tp_rank` of `tp_size`; experts split in `ep_size` groups of tp_size / ep_size ranks, each
// group TP-sharding its experts. `expects` lists only the sources this rank takes.
Result<RankSpec> model_rank_spec(const ModelDesc& model, int tp_rank, int tp_size, int ep_size,
                                 Scheme linear_scheme, int replica = 0);

// Every rank of `replicas` replicas, replica-major (the planner's destination order). The replicas'
// specs of one TP rank are copies sharing its tensors and parameters (RankSpec), built once.
Result<std::vector<RankSpec>> model_rank_specs(const ModelDesc& model, int replicas, int tp_size, int ep_size,
                                               Scheme linear_scheme);

}  // namespace ferry::sharding
