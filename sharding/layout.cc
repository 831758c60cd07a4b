#include "sharding/layout.h"

#include <array>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "sharding/scheme_check.h"

namespace ferry::sharding {
namespace {

constexpr std::array<std::pair<Layout, std::string_view>, 7> kLayoutNames = {{
    {Layout::kReplicated, "replicated"},
    {Layout::kColumn, "column"},
    {Layout::kRow, "row"},
    {Layout::kMergedColumn, "merged_column"},
    {Layout::kQkv, "qkv"},
    {Layout::kVocabParallel, "vocab_parallel"},
    {Layout::kExperts, "experts"},
}};

Status bad(const ParamRule& r, std::string_view what) {
  return Status::invalid_argument(
      fmt::format("{} (from {}): {}", r.param, r.sources.empty() ? std::string("no source") : r.sources.front(), what));
}

Region rows_of(const Shape& shape, int64_t row0, int64_t rows) {
  Region r = Region::whole(shape);
  r.offset[0] = row0;
  r.size[0] = rows;
  return r;
}

Region cols_of(const Shape& shape, int64_t col0, int64_t cols) {
  Region r = Region::whole(shape);
  r.offset[1] = col0;
  r.size[1] = cols;
  return r;
}

Shape zeros(size_t n) { return Shape(n, 0); }

// Destination offset `row` on dim 0 of a destination of rank `n`.
Shape at_row(size_t n, int64_t row) {
  Shape s = zeros(n);
  s[0] = row;
  return s;
}

// vLLM's and SGLang's VocabParallelEmbedding: the vocabulary padded to a multiple of `pad_multiple`
// (pad_vocab_size), split evenly (num_embeddings_per_partition = divide(num_embeddings_padded, tp)).
int64_t padded_vocab_rows(const ParamRule& r) {
  return (r.shapes[0][0] + r.pad_multiple - 1) / r.pad_multiple * r.pad_multiple;
}

int64_t vocab_shard_rows(const ParamRule& r, int tp) { return padded_vocab_rows(r) / tp; }

Status validate_rule(const ParamRule& r, int tp, int ep) {
  if (r.sources.empty()) return bad(r, "no source tensor");
  if (!r.stacked.empty() && r.layout != Layout::kExperts) {
    return bad(r, fmt::format("stacked tensor {} given to a {} layout; only experts hold experts stacked", r.stacked,
                              layout_name(r.layout)));
  }
  if (r.shapes.size() != r.sources.size()) return bad(r, "needs one shape per source");
  for (const Shape& s : r.shapes) {
    if (s.empty()) return bad(r, "a source shape is empty");
    for (int64_t d : s) {
      if (d <= 0) return bad(r, fmt::format("source shape {} has a non-positive dimension", shape_to_string(s)));
    }
  }
  auto need_sources = [&](size_t n) -> Status {
    return r.sources.size() == n ? ok_status() : bad(r, fmt::format("layout {} takes {} source(s), got {}", layout_name(r.layout), n, r.sources.size()));
  };
  switch (r.layout) {
    case Layout::kReplicated:
      return need_sources(1);
    case Layout::kColumn: {
      FERRY_RETURN_IF_ERROR(need_sources(1));
      if (r.unit <= 0) return bad(r, "unit must be positive");
      if (r.shapes[0][0] % (r.unit * tp)) {
        return bad(r, fmt::format("{} rows in units of {} do not split over TP {}", r.shapes[0][0], r.unit, tp));
      }
      return ok_status();
    }
    case Layout::kRow:
      FERRY_RETURN_IF_ERROR(need_sources(1));
      if (r.shapes[0].size() != 2) return bad(r, "row-parallel needs a matrix");
      if (r.shapes[0][1] % tp) return bad(r, fmt::format("{} input columns do not split over TP {}", r.shapes[0][1], tp));
      return ok_status();
    case Layout::kMergedColumn:
      if (!r.sections.empty()) {
        FERRY_RETURN_IF_ERROR(need_sources(1));
        int64_t rows = 0;
        for (int64_t s : r.sections) {
          if (s <= 0 || s % tp) return bad(r, fmt::format("a section of {} rows does not split over TP {}", s, tp));
          rows += s;
        }
        if (rows != r.shapes[0][0]) {
          return bad(r, fmt::format("sections of {} rows in all for {} rows", rows, r.shapes[0][0]));
        }
        return ok_status();
      }
      for (size_t i = 0; i < r.shapes.size(); ++i) {
        const Shape& s = r.shapes[i];
        if (s.size() != r.shapes[0].size() || !std::equal(s.begin() + 1, s.end(), r.shapes[0].begin() + 1)) {
          return bad(r, fmt::format("merged sources disagree on trailing dimensions: {} and {}", shape_to_string(r.shapes[0]),
                                    shape_to_string(s)));
        }
        if (s[0] % tp) return bad(r, fmt::format("{}: {} rows do not split over TP {}", r.sources[i], s[0], tp));
      }
      return ok_status();
    case Layout::kQkv: {
      FERRY_RETURN_IF_ERROR(need_sources(3));
      const int64_t nh = r.num_heads, kv = r.num_kv_heads, hd = r.head_dim;
      if (nh <= 0 || kv <= 0 || hd <= 0) return bad(r, "qkv needs num_heads, num_kv_heads and head_dim");
      if (nh % kv) return bad(r, fmt::format("{} heads are not a multiple of {} KV heads", nh, kv));
      if (nh % tp) return bad(r, fmt::format("{} attention heads do not split over TP {}", nh, tp));
      if (kv >= tp ? kv % tp : tp % kv) return bad(r, fmt::format("{} KV heads do not split over TP {}", kv, tp));
      const size_t rank = r.shapes[0].size();
      for (size_t i = 0; i < 3; ++i) {
        const int64_t rows = (i == 0 ? nh : kv) * hd;
        if (r.shapes[i].size() != rank || r.shapes[i][0] != rows ||
            !std::equal(r.shapes[i].begin() + 1, r.shapes[i].end(), r.shapes[0].begin() + 1)) {
          return bad(r, fmt::format("{} has shape {}, the heads say {} rows", r.sources[i], shape_to_string(r.shapes[i]), rows));
        }
      }
      return ok_status();
    }
    case Layout::kVocabParallel: {
      FERRY_RETURN_IF_ERROR(need_sources(1));
      if (r.pad_multiple <= 0) return bad(r, "pad_multiple must be positive");
      const int64_t padded = padded_vocab_rows(r);
      if (padded % tp) {
        return bad(r, fmt::format("{} rows padded to a multiple of {} ({}) do not split over TP {}", r.shapes[0][0],
                                  r.pad_multiple, padded, tp));
      }
      return ok_status();
    }
    case Layout::kExperts: {
      if (r.num_experts <= 0) return bad(r, "experts need num_experts");
      if (ep <= 0 || tp % ep) return bad(r, fmt::format("expert parallel size {} does not divide TP {}", ep, tp));
      if (r.num_experts % ep) return bad(r, fmt::format("{} experts do not split over EP {}", r.num_experts, ep));
      const int mtp = tp / ep;
      for (size_t i = 0; i < r.shapes.size(); ++i) {
        const Shape& s = r.shapes[i];
        if (r.sources[i].find("{E}") == std::string::npos) return bad(r, r.sources[i] + " lacks the {E} placeholder");
        if (s.size() != 2 || s[1] != r.shapes[0][1]) return bad(r, "expert sources must be matrices with equal columns");
        if (r.expert_split == Layout::kColumn && s[0] % mtp) {
          return bad(r, fmt::format("{}: {} rows do not split over {} ranks per expert group", r.sources[i], s[0], mtp));
        }
        if (r.expert_split == Layout::kRow && s[1] % mtp) {
          return bad(r, fmt::format("{}: {} columns do not split over {} ranks per expert group", r.sources[i], s[1], mtp));
        }
      }
      if (r.expert_split != Layout::kColumn && r.expert_split != Layout::kRow && r.expert_split != Layout::kReplicated) {
        return bad(r, "expert split must be column, row or replicated");
      }
      if (r.stacked.find("{E}") != std::string::npos) return bad(r, "the stacked tensor " + r.stacked + " names one tensor: no {E}");
      return ok_status();
    }
  }
  return bad(r, "unknown layout");
}

struct RankBuilder {
  int r;
  int tp;
  int ep;
  Scheme scheme;

  ParamSpec start(const ParamRule& rule, Shape shape) const {
    ParamSpec p;
    p.name = rule.param;
    p.layer = rule.layer.empty() ? layer_of(rule.param) : rule.layer;
    p.shape = std::move(shape);
    p.source_dtype = rule.dtype;
    p.scheme = rule.quantize ? scheme : Scheme::kNone;
    return p;
  }

  ParamSpec build(const ParamRule& rule) const {
    const Shape& s0 = rule.shapes[0];
    switch (rule.layout) {
      case Layout::kReplicated: {
        ParamSpec p = start(rule, s0);
        p.slices.push_back({rule.sources[0], Region::whole(s0), zeros(s0.size())});
        return p;
      }
      case Layout::kColumn: {
        const int64_t rows = s0[0] / tp;
        Shape shape = s0;
        shape[0] = rows;
        ParamSpec p = start(rule, shape);
        p.slices.push_back({rule.sources[0], rows_of(s0, r * rows, rows), zeros(s0.size())});
        return p;
      }
      case Layout::kRow: {
        const int64_t cols = s0[1] / tp;
        ParamSpec p = start(rule, {s0[0], cols});
        p.slices.push_back({rule.sources[0], cols_of(s0, r * cols, cols), {0, 0}});
        return p;
      }
      case Layout::kMergedColumn: {
        // Each part (a source, or a section of the one source) split over TP, one after another.
        struct Part {
          size_t source;
          int64_t first_row, rows;
        };
        std::vector<Part> parts;
        int64_t first = 0;
        for (int64_t s : rule.sections) {
          parts.push_back({0, first, s});
          first += s;
        }
        if (parts.empty()) {
          for (size_t i = 0; i < rule.sources.size(); ++i) parts.push_back({i, 0, rule.shapes[i][0]});
        }
        Shape shape = s0;
        shape[0] = 0;
        for (const Part& part : parts) shape[0] += part.rows / tp;
        ParamSpec p = start(rule, shape);
        int64_t row = 0;
        for (const Part& part : parts) {
          const int64_t rows = part.rows / tp;
          p.slices.push_back({rule.sources[part.source], rows_of(rule.shapes[part.source], part.first_row + r * rows, rows),
                              at_row(s0.size(), row)});
          // Per-shard scales are for matrices: a rank-3 merged tensor (a conv1d's [channels, 1, kernel])
          // has no rows of its own to split them by.
          if (s0.size() <= 2) p.shard_rows.push_back(rows);
          row += rows;
        }
        return p;
      }
      case Layout::kQkv: {
        const int64_t hd = rule.head_dim, kv = rule.num_kv_heads;
        const int64_t qr = rule.num_heads / tp * hd;
        const int64_t kv_local = kv >= tp ? kv / tp : 1;
        const int64_t kv_head0 = kv >= tp ? r * kv_local : r / (tp / kv);
        const int64_t kr = kv_local * hd;
        Shape shape = s0;
        shape[0] = qr + 2 * kr;
        ParamSpec p = start(rule, shape);
        p.shard_rows = {qr, kr, kr};
        p.slices.push_back({rule.sources[0], rows_of(rule.shapes[0], r * qr, qr), at_row(s0.size(), 0)});
        p.slices.push_back({rule.sources[1], rows_of(rule.shapes[1], kv_head0 * hd, kr), at_row(s0.size(), qr)});
        p.slices.push_back({rule.sources[2], rows_of(rule.shapes[2], kv_head0 * hd, kr), at_row(s0.size(), qr + kr)});
        return p;
      }
      case Layout::kVocabParallel: {
        const int64_t per = vocab_shard_rows(rule, tp);
        const int64_t v = s0[0];
        const int64_t row0 = std::min<int64_t>(v, r * per);
        const int64_t rows = std::min<int64_t>(v, row0 + per) - row0;
        Shape shape = s0;
        shape[0] = per;
        ParamSpec p = start(rule, shape);
        if (rows > 0) p.slices.push_back({rule.sources[0], rows_of(s0, row0, rows), zeros(s0.size())});
        return p;
      }
      case Layout::kExperts:
        return build_experts(rule);
    }
    return {};
  }

  ParamSpec build_experts(const ParamRule& rule) const {
    const int mtp = tp / ep;
    const int ep_rank = r / mtp, sub = r % mtp;
    const int64_t local = rule.num_experts / ep;
    const int64_t cols = rule.shapes[0][1];
    const bool split_rows = rule.expert_split == Layout::kColumn, split_cols = rule.expert_split == Layout::kRow;
    int64_t rows_total = 0;
    for (const Shape& s : rule.shapes) rows_total += split_rows ? s[0] / mtp : s[0];
    ParamSpec p = start(rule, {local, rows_total, split_cols ? cols / mtp : cols});
    if (!rule.stacked.empty()) {
      // Whole boxes of this rank's experts: one slice for all sources when nothing splits them
      // (the stacked tensor's rows are the parameter's), else one per source.
      const Shape full = stacked_shape(rule);
      if (mtp == 1 || (!split_rows && !split_cols)) {
        p.slices.push_back({rule.stacked, Region{{ep_rank * local, 0, 0}, {local, full[1], cols}}, {0, 0, 0}});
      } else {
        int64_t row = 0, src_row = 0;
        for (const Shape& s : rule.shapes) {
          const int64_t rows = split_rows ? s[0] / mtp : s[0];
          const Region src{{ep_rank * local, src_row + (split_rows ? sub * rows : 0), split_cols ? sub * (cols / mtp) : 0},
                           {local, rows, split_cols ? cols / mtp : cols}};
          p.slices.push_back({rule.stacked, src, {0, row, 0}});
          row += rows;
          src_row += s[0];
        }
      }
    }
    for (int64_t e = 0; rule.stacked.empty() && e < local; ++e) {
      const int64_t expert = ep_rank * local + e;
      int64_t row = 0;
      for (size_t i = 0; i < rule.sources.size(); ++i) {
        const Shape& s = rule.shapes[i];
        Region src = Region::whole(s);
        if (split_rows) src = rows_of(s, sub * (s[0] / mtp), s[0] / mtp);
        if (split_cols) src = cols_of(s, sub * (cols / mtp), cols / mtp);
        p.slices.push_back({expert_name(rule.sources[i], expert), src, {e, row, 0}});
        row += src.size[0];
      }
    }
    if (rule.sources.size() > 1) {
      for (const Shape& s : rule.shapes) p.shard_rows.push_back(split_rows ? s[0] / mtp : s[0]);
    }
    return p;
  }
};

}  // namespace

std::string_view layout_name(Layout layout) {
  for (const auto& [l, n] : kLayoutNames) {
    if (l == layout) return n;
  }
  return "unknown";
}

Result<Layout> parse_layout(std::string_view name) {
  for (const auto& [l, n] : kLayoutNames) {
    if (n == name) return l;
  }
  return Status::invalid_argument(fmt::format("unknown layout '{}'", name));
}

std::string expert_name(std::string_view tmpl, int64_t e) {
  std::string out(tmpl);
  const std::string num = std::to_string(e);
  for (size_t at = out.find("{E}"); at != std::string::npos; at = out.find("{E}", at + num.size())) {
    out.replace(at, 3, num);
  }
  return out;
}

Shape stacked_shape(const ParamRule& rule) {
  int64_t rows = 0;
  for (const Shape& s : rule.shapes) rows += s[0];
  return {rule.num_experts, rows, rule.shapes.empty() || rule.shapes[0].size() < 2 ? 0 : rule.shapes[0][1]};
}

Status stack_experts(ModelDesc& model) {
  for (ParamRule& r : model.params) {
    if (r.layout != Layout::kExperts || !r.stacked.empty()) continue;
    const size_t at = r.sources.empty() ? std::string::npos : r.sources[0].find("{E}");
    const bool gate_up = r.expert_split == Layout::kColumn && r.sources.size() == 2;
    const bool down = r.expert_split == Layout::kRow && r.sources.size() == 1;
    if (at == std::string::npos || (!gate_up && !down)) {
      return bad(r, fmt::format("stacked experts are named for a column-split pair of {{E}} sources (gate, up) or a "
                                "row-split one (down); this rule has {} source(s), split {}: name its stacked "
                                "tensor in a mapping file's \"stacked\"",
                                r.sources.size(), layout_name(r.expert_split)));
    }
    r.stacked = r.sources[0].substr(0, at) + (gate_up ? "gate_up_proj" : "down_proj");
  }
  return ok_status();
}

Manifest model_manifest(const ModelDesc& model) {
  Manifest m;
  std::set<std::string> seen;
  auto add = [&](std::string name, DType dt, const Shape& s) {
    if (seen.insert(name).second) m.push_back({std::move(name), dt, s});
  };
  for (const ParamRule& r : model.params) {
    if (r.layout == Layout::kExperts && !r.stacked.empty()) {
      add(r.stacked, r.dtype, stacked_shape(r));
      continue;
    }
    if (r.layout == Layout::kExperts) {
      for (int64_t e = 0; e < r.num_experts; ++e) {
        for (size_t i = 0; i < r.sources.size(); ++i) add(expert_name(r.sources[i], e), r.dtype, r.shapes[i]);
      }
      continue;
    }
    for (size_t i = 0; i < r.sources.size() && i < r.shapes.size(); ++i) add(r.sources[i], r.dtype, r.shapes[i]);
  }
  return m;
}

int64_t model_numel(const ModelDesc& model) {
  int64_t n = 0;
  for (const SourceTensor& t : model_manifest(model)) n += shape_numel(t.shape);
  return n;
}

Status validate_model(const ModelDesc& model, int tp_size, int ep_size) {
  if (tp_size <= 0) return Status::invalid_argument("tp size must be positive");
  if (ep_size <= 0 || tp_size % ep_size) {
    return Status::invalid_argument(fmt::format("expert parallel size {} does not divide TP {}", ep_size, tp_size));
  }
  std::set<std::string> params;
  std::map<std::string, std::pair<Shape, DType>> sources;
  for (const ParamRule& r : model.params) {
    if (!params.insert(r.param).second) return bad(r, "parameter defined twice");
    FERRY_RETURN_IF_ERROR(validate_rule(r, tp_size, ep_size));
    if (!r.stacked.empty() && !sources.emplace(r.stacked, std::make_pair(stacked_shape(r), r.dtype)).second) {
      return bad(r, "stacked tensor " + r.stacked + " is used twice");
    }
    for (size_t i = 0; i < r.sources.size(); ++i) {
      auto [it, fresh] = sources.emplace(r.sources[i], std::make_pair(r.shapes[i], r.dtype));
      if (!fresh && (it->second.first != r.shapes[i] || it->second.second != r.dtype)) {
        return bad(r, fmt::format("source {} is used with shapes {} and {}", r.sources[i], shape_to_string(it->second.first),
                                  shape_to_string(r.shapes[i])));
      }
    }
  }
  return ok_status();
}

Result<RankSpec> model_rank_spec(const ModelDesc& model, int tp_rank, int tp_size, int ep_size,
                                 Scheme linear_scheme, int replica) {
  FERRY_RETURN_IF_ERROR(validate_model(model, tp_size, ep_size));
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return Status::invalid_argument(fmt::format("tp rank {} outside TP size {}", tp_rank, tp_size));
  }
  RankSpec spec;
  spec.replica = replica;
  spec.tp_rank = tp_rank;
  spec.tp_size = tp_size;
  spec.ep_size = ep_size;
  const RankBuilder b{tp_rank, tp_size, ep_size, linear_scheme};
  std::set<std::string> expected;
  for (const ParamRule& rule : model.params) {
    ParamSpec p = b.build(rule);
    FERRY_RETURN_IF_ERROR(check_scheme_shape(p));
    for (size_t i = 0; i < rule.sources.size(); ++i) {
      if (rule.layout != Layout::kExperts) {
        if (expected.insert(rule.sources[i]).second) spec.expects.push_back({rule.sources[i], rule.dtype, rule.shapes[i]});
      }
    }
    if (rule.layout == Layout::kExperts && !rule.stacked.empty()) {
      if (expected.insert(rule.stacked).second) spec.expects.push_back({rule.stacked, rule.dtype, stacked_shape(rule)});
    } else if (rule.layout == Layout::kExperts) {
      // Slices run expert-major, one per source, so slice k comes from source k % sources.
      for (size_t k = 0; k < p.slices.size(); ++k) {
        const std::string& name = p.slices[k].source;
        if (expected.insert(name).second) spec.expects.push_back({name, rule.dtype, rule.shapes[k % rule.sources.size()]});
      }
    }
    spec.params.push_back(std::move(p));
  }
  return spec;
}

Result<std::vector<RankSpec>> model_rank_specs(const ModelDesc& model, int replicas, int tp_size, int ep_size,
                                               Scheme linear_scheme) {
  if (replicas <= 0) return Status::invalid_argument("replicas must be positive");
  std::vector<RankSpec> one;
  for (int r = 0; r < tp_size; ++r) {
    FERRY_ASSIGN_OR_RETURN(RankSpec spec, model_rank_spec(model, r, tp_size, ep_size, linear_scheme));
    one.push_back(std::move(spec));
  }
  std::vector<RankSpec> all;
  all.reserve(static_cast<size_t>(replicas) * one.size());
  for (int rep = 0; rep < replicas; ++rep) {
    for (const RankSpec& s : one) {
      all.push_back(s);
      all.back().replica = rep;
    }
  }
  return all;
}

}  // namespace ferry::sharding
