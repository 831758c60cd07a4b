// A user-described model: an explicit JSON mapping from checkpoint tensors to engine parameters,
// read at run time (no recompiling). Format (docs/cost_model.md, "Mapping files"):
//   {"ferry_mapping": 1, "name": "...", "dtype": "bf16", "vars": {"H": 4096},
//    "params": [{"param": "model.layers.{L}.mlp.gate_up_proj.weight", "layers": [0, 32],
//                "layout": "merged_column", "sources": [".. gate_proj ..", ".. up_proj .."],
//                "shapes": [["I", "H"], ["I", "H"]], "quantize": true}, ...]}
// "{L}" expands over "layers" [begin, end); "{E}" names an expert of an "experts" layout.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"
#include "sharding/layout.h"

namespace ferry::sharding {

Result<ModelDesc> parse_mapping(std::string_view json_text);

// True when the text is a mapping file rather than a Hugging Face config.json.
bool looks_like_mapping(std::string_view json_text);

}  // namespace ferry::sharding
