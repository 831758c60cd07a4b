#include "sharding/mapping.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ferry::sharding {
namespace {

using json = nlohmann::json;

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

class Parser {
 public:
  Status parse(const json& root, ModelDesc* out) {
    if (!root.is_object()) return err("the mapping is not a JSON object");
    static const std::set<std::string> kTop = {"ferry_mapping", "name", "dtype", "vars", "params"};
    for (const auto& [k, v] : root.items()) {
      if (!kTop.count(k)) return err(fmt::format("unknown key \"{}\"", k));
    }
    if (root.value("ferry_mapping", 0) != 1) return err("\"ferry_mapping\": 1 is required (format version)");
    out->name = root.value("name", std::string("custom"));
    if (root.contains("dtype")) {
      FERRY_ASSIGN_OR_RETURN(dtype_, parse_dt(root["dtype"], "dtype"));
    }
    if (auto it = root.find("vars"); it != root.end()) {
      if (!it->is_object()) return err("\"vars\" must be an object of integers");
      for (const auto& [k, v] : it->items()) {
        if (!v.is_number_integer()) return err(fmt::format("var {} is not an integer", k));
        vars_[k] = v.get<int64_t>();
      }
    }
    auto params = root.find("params");
    if (params == root.end() || !params->is_array()) return err("\"params\" must be an array");
    for (size_t i = 0; i < params->size(); ++i) {
      Status s = parse_param((*params)[i], out);
      if (!s.ok()) return s.with_context(fmt::format("mapping params[{}]", i));
    }
    return ok_status();
  }

 private:
  static Status err(std::string m) { return Status::invalid_argument("mapping: " + std::move(m)); }

  Result<DType> parse_dt(const json& v, const char* what) {
    if (!v.is_string()) return err(fmt::format("\"{}\" must be a dtype name", what));
    return parse_dtype(v.get<std::string>());
  }

  Result<int64_t> dim(const json& v) {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_string()) {
      auto it = vars_.find(v.get<std::string>());
      if (it == vars_.end()) return err(fmt::format("unknown var \"{}\"", v.get<std::string>()));
      return it->second;
    }
    return err("a dimension must be an integer or a var name");
  }

  Result<int64_t> opt_dim(const json& p, const char* key, int64_t fallback) {
    auto it = p.find(key);
    if (it == p.end()) return fallback;
    return dim(*it);
  }

  Result<Shape> shape(const json& v) {
    if (!v.is_array() || v.empty()) return err("a shape must be a non-empty array");
    Shape s;
    for (const auto& d : v) {
      FERRY_ASSIGN_OR_RETURN(int64_t x, dim(d));
      s.push_back(x);
    }
    return s;
  }

  Status parse_param(const json& p, ModelDesc* out) {
    static const std::set<std::string> kKeys = {"param", "layer", "layers", "layout", "source", "sources", "shape", "shapes",
                                                "dtype", "quantize", "unit", "num_heads", "num_kv_heads", "head_dim",
                                                "pad_multiple", "num_experts", "split", "stacked", "sections"};
    if (!p.is_object()) return err("a param entry must be an object");
    for (const auto& [k, v] : p.items()) {
      if (!kKeys.count(k)) return err(fmt::format("unknown key \"{}\"", k));
    }
    if (!p.contains("param") || !p["param"].is_string()) return err("\"param\" (engine name) is required");
    ParamRule r;
    r.param = p["param"].get<std::string>();
    if (!p.contains("layout") || !p["layout"].is_string()) return err(r.param + ": \"layout\" is required");
    FERRY_ASSIGN_OR_RETURN(r.layout, parse_layout(p["layout"].get<std::string>()));
    r.layer = p.value("layer", std::string());
    r.dtype = dtype_;
    if (p.contains("dtype")) {
      FERRY_ASSIGN_OR_RETURN(r.dtype, parse_dt(p["dtype"], "dtype"));
    }
    // Linear layouts are quantized unless told otherwise; the rest stay in full precision.
    const bool linear = r.layout == Layout::kColumn || r.layout == Layout::kRow || r.layout == Layout::kMergedColumn ||
                        r.layout == Layout::kQkv || r.layout == Layout::kExperts;
    if (p.contains("quantize") && !p["quantize"].is_boolean()) return err(r.param + ": \"quantize\" must be true or false");
    r.quantize = p.value("quantize", linear);
    if (p.contains("source") && p.contains("sources")) return err(r.param + ": give \"source\" or \"sources\", not both");
    if (p.contains("sources")) {
      if (!p["sources"].is_array()) return err(r.param + ": \"sources\" must be an array of names");
      for (const auto& s : p["sources"]) {
        if (!s.is_string()) return err(r.param + ": \"sources\" must be an array of names");
        r.sources.push_back(s.get<std::string>());
      }
    } else if (p.contains("source")) {
      if (!p["source"].is_string()) return err(r.param + ": \"source\" must be a name");
      r.sources.push_back(p["source"].get<std::string>());
    } else {
      r.sources.push_back(r.param);
    }
    if (p.contains("shape") && p.contains("shapes")) return err(r.param + ": give \"shape\" or \"shapes\", not both");
    if (p.contains("shapes")) {
      if (!p["shapes"].is_array()) return err(r.param + ": \"shapes\" must be an array of shapes");
      for (const auto& s : p["shapes"]) {
        FERRY_ASSIGN_OR_RETURN(Shape sh, shape(s));
        r.shapes.push_back(std::move(sh));
      }
    } else if (p.contains("shape")) {
      FERRY_ASSIGN_OR_RETURN(Shape sh, shape(p["shape"]));
      r.shapes.assign(r.sources.size(), sh);
    } else {
      return err(r.param + ": \"shape\" or \"shapes\" is required");
    }
    FERRY_ASSIGN_OR_RETURN(r.unit, opt_dim(p, "unit", 1));
    FERRY_ASSIGN_OR_RETURN(r.num_heads, opt_dim(p, "num_heads", 0));
    FERRY_ASSIGN_OR_RETURN(r.num_kv_heads, opt_dim(p, "num_kv_heads", r.num_heads));
    FERRY_ASSIGN_OR_RETURN(r.head_dim, opt_dim(p, "head_dim", 0));
    FERRY_ASSIGN_OR_RETURN(r.pad_multiple, opt_dim(p, "pad_multiple", 1));
    FERRY_ASSIGN_OR_RETURN(r.num_experts, opt_dim(p, "num_experts", 0));
    if (p.contains("split")) {
      if (!p["split"].is_string()) return err(r.param + ": \"split\" must be column, row or replicated");
      FERRY_ASSIGN_OR_RETURN(r.expert_split, parse_layout(p["split"].get<std::string>()));
    }
    if (p.contains("sections")) {
      if (!p["sections"].is_array() || p["sections"].empty()) {
        return err(fmt::format("{}: \"sections\" must be a non-empty array of row counts, got {}", r.param,
                               p["sections"].dump()));
      }
      if (r.layout != Layout::kMergedColumn) {
        return err(fmt::format("{}: \"sections\" is for the merged_column layout, not \"{}\"", r.param,
                               layout_name(r.layout)));
      }
      for (const auto& s : p["sections"]) {
        FERRY_ASSIGN_OR_RETURN(int64_t rows, dim(s));
        r.sections.push_back(rows);
      }
    }
    if (p.contains("stacked")) {
      if (!p["stacked"].is_string() || p["stacked"].get<std::string>().empty()) {
        return err(fmt::format("{}: \"stacked\" must name the tensor holding the experts, got {}", r.param,
                               p["stacked"].dump()));
      }
      if (r.layout != Layout::kExperts) {
        return err(fmt::format("{}: \"stacked\" is for the experts layout, not \"{}\"", r.param, layout_name(r.layout)));
      }
      r.stacked = p["stacked"].get<std::string>();
    }
    if (!p.contains("layers")) {
      if (r.param.find("{L}") != std::string::npos || r.stacked.find("{L}") != std::string::npos) {
        return err(r.param + ": \"{L}\" without \"layers\"");
      }
      out->params.push_back(std::move(r));
      return ok_status();
    }
    const json& l = p["layers"];
    if (!l.is_array() || l.size() != 2) return err(r.param + ": \"layers\" must be [begin, end)");
    FERRY_ASSIGN_OR_RETURN(int64_t begin, dim(l[0]));
    FERRY_ASSIGN_OR_RETURN(int64_t end, dim(l[1]));
    if (begin < 0 || end < begin) return err(fmt::format("{}: layers [{}, {}) is not a range", r.param, begin, end));
    for (int64_t i = begin; i < end; ++i) {
      const std::string n = std::to_string(i);
      ParamRule x = r;
      x.param = replace_all(x.param, "{L}", n);
      x.layer = replace_all(x.layer, "{L}", n);
      for (auto& s : x.sources) s = replace_all(s, "{L}", n);
      x.stacked = replace_all(x.stacked, "{L}", n);
      out->params.push_back(std::move(x));
    }
    return ok_status();
  }

  DType dtype_ = DType::kBF16;
  std::map<std::string, int64_t> vars_;
};

}  // namespace

Result<ModelDesc> parse_mapping(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::invalid_argument("mapping: not valid JSON");
  // nlohmann's typed getters throw on a mistyped value; no exception leaves this function.
  try {
    ModelDesc m;
    Parser p;
    FERRY_RETURN_IF_ERROR(p.parse(j, &m));
    // Checkpoint order: embeddings, then layer by layer (rules in file order within a layer), then
    // the rest, so a mapping and the built-in family of the same model give the same manifest.
    auto order = [](const ParamRule& r) -> int64_t {
      const int li = layer_index_of(r.param);
      if (li >= 0) return int64_t{li} + 1;
      return r.param.starts_with("model.embed_tokens") ? 0 : std::numeric_limits<int64_t>::max();
    };
    std::stable_sort(m.params.begin(), m.params.end(),
                     [&](const ParamRule& a, const ParamRule& b) { return order(a) < order(b); });
    return m;
  } catch (const json::exception& e) {
    return Status::invalid_argument(fmt::format("mapping: {}", e.what()));
  }
}

bool looks_like_mapping(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return !j.is_discarded() && j.is_object() && j.contains("ferry_mapping");
}

}  // namespace ferry::sharding
