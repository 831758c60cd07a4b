// Models and specs: what the trainer sends (manifest) and what a rollout rank holds (RankSpec),
// from a Llama config, a Hugging Face config.json, a preset or a mapping file.
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include "core/scheme.h"
#include "kernels/quantize.h"
#include "python/bindings.h"
#include "reload/model_storage.h"
#include "sharding/layout.h"
#include "sharding/llama.h"
#include "sharding/model_config.h"
#include "sharding/presets.h"
#include "sharding/source_layout.h"

namespace ferry::python {
namespace {

using sharding::ModelConfig;
using sharding::ModelDesc;
using sharding::ParamSpec;
using sharding::RankSpec;
using sharding::SourceSlice;
using sharding::SourceTensor;

template <typename C, typename T>
void dtype_property(py::class_<C>& cls, const char* name, T C::*member) {
  cls.def_property(
      name, [member](const C& c) { return std::string(dtype_name(c.*member)); },
      [member](C& c, py::handle v) { c.*member = take(dtype_from_python(v)); });
}

// A Scheme member as its name (core/scheme.h); an unknown name raises ferry.Error (InvalidArgument).
template <typename C>
void scheme_property(py::class_<C>& cls, const char* name, Scheme C::*member) {
  cls.def_property(
      name, [member](const C& c) { return std::string(scheme_name(c.*member)); },
      [member](C& c, const std::string& v) { c.*member = take(parse_scheme(v)); });
}

// Sets a spec's engine layout after checking that every parameter has one in it: a scheme the
// engine's layout does not define fails here, naming the parameter, not when storage is allocated.
void set_layout(RankSpec& s, const std::string& name) {
  const EngineLayout layout = take(parse_engine_layout(name));
  for (const auto& p : s.params) {
    auto t = kernels::storage_layout(p.scheme, layout, p.shape, p.shard_rows, DType::kBF16);
    if (!t.ok()) check(t.status().with_context(p.name));
  }
  RankSpec with = s;
  with.layout = layout;
  check(reload::check_engine_layout(with));
  s.layout = layout;
}

// Keyword construction for plain structs: Config(hidden_size=64, ...).
template <typename C>
void kwargs_init(py::class_<C>& cls) {
  cls.def(py::init([](py::kwargs kw) {
    py::object self = py::cast(C{});
    for (auto [k, v] : kw) {
      if (!py::hasattr(self, k)) throw py::type_error(fmt::format("unknown field {}", std::string(py::str(k))));
      self.attr(k) = v;
    }
    return self.cast<C>();
  }));
}

std::string source_repr(const SourceTensor& t) {
  return fmt::format("SourceTensor('{}', '{}', [{}])", t.name, dtype_name(t.dtype), fmt::join(t.shape, ", "));
}

}  // namespace

sharding::Manifest manifest_from_python(py::handle obj) {
  sharding::Manifest out;
  for (py::handle item : obj) {
    if (py::isinstance<SourceTensor>(item)) {
      out.push_back(item.cast<SourceTensor>());
      continue;
    }
    auto t = item.cast<py::sequence>();
    if (t.size() != 3) throw py::value_error("a manifest entry is (name, dtype, shape)");
    out.push_back({t[0].cast<std::string>(), take(dtype_from_python(t[1])), t[2].cast<Shape>()});
  }
  return out;
}

void init_model(py::module_& m) {
  py::class_<SourceTensor> st(m, "SourceTensor", "One tensor of a manifest, in checkpoint format.");
  st.def(py::init([](std::string name, py::handle dtype, Shape shape) {
           return SourceTensor{std::move(name), take(dtype_from_python(dtype)), std::move(shape)};
         }),
         py::arg("name"), py::arg("dtype"), py::arg("shape"))
      .def_readwrite("name", &SourceTensor::name)
      .def_readwrite("shape", &SourceTensor::shape)
      .def(py::self == py::self)
      .def("__repr__", &source_repr);
  dtype_property(st, "dtype", &SourceTensor::dtype);

  py::class_<Region>(m, "Region")
      .def_readwrite("offset", &Region::offset)
      .def_readwrite("size", &Region::size)
      .def("__repr__", &Region::to_string);

  py::class_<SourceSlice>(m, "SourceSlice", "A region of a source tensor landing at dst_offset in a parameter.")
      .def_readwrite("source", &SourceSlice::source)
      .def_readwrite("src", &SourceSlice::src)
      .def_readwrite("dst_offset", &SourceSlice::dst_offset);

  py::class_<ParamSpec> ps(m, "ParamSpec", "One full-precision parameter of a rank and its scheme.");
  ps.def_readwrite("name", &ParamSpec::name)
      .def_readwrite("layer", &ParamSpec::layer)
      .def_readwrite("shape", &ParamSpec::shape)
      .def_readwrite("shard_rows", &ParamSpec::shard_rows)
      .def_readwrite("slices", &ParamSpec::slices)
      .def("__repr__", [](const ParamSpec& p) {
        return fmt::format("ParamSpec('{}', [{}], {})", p.name, fmt::join(p.shape, ", "), scheme_name(p.scheme));
      });
  dtype_property(ps, "source_dtype", &ParamSpec::source_dtype);
  scheme_property(ps, "scheme", &ParamSpec::scheme);

  py::class_<RankSpec>(m, "RankSpec", "One rank of one replica: its parameters and the sources it takes.")
      .def_property(
          "layout", [](const RankSpec& s) { return std::string(engine_layout_name(s.layout)); },
          [](RankSpec& s, const std::string& v) { set_layout(s, v); },
          "Whose kernels read the storage: 'ferry', 'vllm' or 'sglang' (names, shapes and arithmetic).")
      .def_readwrite("replica", &RankSpec::replica)
      .def_readwrite("tp_rank", &RankSpec::tp_rank)
      .def_readwrite("tp_size", &RankSpec::tp_size)
      .def_readwrite("ep_size", &RankSpec::ep_size)
      // A spec's tensors and parameters may be shared with its copies (core/cow_vector.h): Python
      // reads this spec's own, so that writing an element changes this spec only.
      .def_property(
          "expects", [](RankSpec& s) -> std::vector<sharding::SourceTensor>& { return s.expects.edit(); },
          [](RankSpec& s, std::vector<sharding::SourceTensor> v) { s.expects = std::move(v); },
          py::return_value_policy::reference_internal)
      .def_property(
          "params", [](RankSpec& s) -> std::vector<sharding::ParamSpec>& { return s.params.edit(); },
          [](RankSpec& s, std::vector<sharding::ParamSpec> v) { s.params = std::move(v); },
          py::return_value_policy::reference_internal)
      .def("validate", [](const RankSpec& s, py::handle manifest) {
        check(sharding::validate_rank_spec(s, manifest_from_python(manifest)));
      })
      .def("__repr__", [](const RankSpec& s) {
        return fmt::format("RankSpec(replica={}, tp_rank={}/{}, {} params)", s.replica, s.tp_rank, s.tp_size,
                           s.params.size());
      });

  // One class: a parsed config.json, or a Llama-family model set by keywords (LlamaConfig is the
  // same class, as sharding::LlamaConfig is ModelConfig).
  py::class_<ModelConfig> mc(m, "ModelConfig", "A model's shape: a parsed config.json, or a Llama-family model.");
  kwargs_init(mc);
  mc.def_readwrite("family", &ModelConfig::family)
      .def_readwrite("hidden_size", &ModelConfig::hidden_size)
      .def_readwrite("num_heads", &ModelConfig::num_heads)
      .def_readwrite("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_readwrite("head_dim", &ModelConfig::head_dim)
      .def_readwrite("intermediate_size", &ModelConfig::intermediate_size)
      .def_readwrite("vocab_size", &ModelConfig::vocab_size)
      .def_readwrite("num_layers", &ModelConfig::num_layers)
      .def_readwrite("tie_word_embeddings", &ModelConfig::tie_word_embeddings)
      .def_readwrite("qkv_bias", &ModelConfig::qkv_bias)
      .def_readwrite("qk_norm", &ModelConfig::qk_norm)
      .def_readwrite("vocab_pad_multiple", &ModelConfig::vocab_pad_multiple)
      .def_readwrite("num_experts", &ModelConfig::num_experts)
      .def_readwrite("moe_intermediate_size", &ModelConfig::moe_intermediate_size)
      .def_readwrite("decoder_sparse_step", &ModelConfig::decoder_sparse_step)
      .def_readwrite("mlp_only_layers", &ModelConfig::mlp_only_layers)
      .def("validate", [](const ModelConfig& c, int tp_size) { check(c.validate(tp_size)); });
  dtype_property(mc, "dtype", &ModelConfig::dtype);
  m.attr("LlamaConfig") = m.attr("ModelConfig");

  py::class_<ModelDesc>(m, "ModelDesc", "A model as rules, from a preset, a config.json or a mapping file.")
      .def_readonly("name", &ModelDesc::name)
      .def("manifest", [](const ModelDesc& d) { return sharding::model_manifest(d); })
      .def("rank_spec",
           [](const ModelDesc& d, int tp_rank, int tp_size, const std::string& scheme, int ep_size, int replica,
              const std::string& layout) {
             RankSpec s =
                 take(sharding::model_rank_spec(d, tp_rank, tp_size, ep_size, take(parse_scheme(scheme)), replica));
             set_layout(s, layout);
             return s;
           },
           py::arg("tp_rank"), py::arg("tp_size"), py::arg("scheme") = "none", py::arg("ep_size") = 1,
           py::arg("replica") = 0, py::arg("layout") = "ferry")
      .def(
          "stacked_experts",
          [](ModelDesc d) {
            check(sharding::stack_experts(d));
            return d;
          },
          "The same model with each layer's routed experts held stacked by the trainer, as transformers' fused "
          "experts hold them (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; mlp.experts.down_proj [E, H, I]): "
          "its manifest names those tensors, and the plan cuts whole boxes of experts from them.");

  m.def("llama_manifest", &sharding::llama_manifest, "Every tensor a trainer sends for this model.");
  py::class_<sharding::SourceLayout>(
      m, "SourceLayout",
      "Where a trainer rank's boxes of the checkpoint tensors lie in its own fused local "
      "tensors: pass it to Trainer.start_weight_update(source_layout=...) and send the "
      "local tensors under their own names.")
      .def("__len__", [](const sharding::SourceLayout& l) { return l.boxes.size(); })
      .def_property_readonly(
          "boxes",
          [](const sharding::SourceLayout& l) {
            py::list out;
            for (const auto& b : l.boxes) {
              const Region& r = b.box.region;
              out.append(py::make_tuple(b.box.name, std::vector<int64_t>(r.offset.begin(), r.offset.end()),
                                        std::vector<int64_t>(r.size.begin(), r.size.end()), b.local, b.row));
            }
            return out;
          },
          "(checkpoint tensor, box offset, box size, local tensor, the box's first row there), one per box");
  m.def(
      "megatron_layout",
      [](const sharding::ModelConfig& c, int rank, int ranks, int tp, int pp, int ep, std::optional<int> etp) {
        return take(sharding::megatron_rank_layout(c, rank, ranks, tp, pp, ep, etp.value_or(0)));
      },
      py::arg("config"), py::arg("rank"), py::arg("ranks"), py::kw_only(), py::arg("tp") = 1, py::arg("pp") = 1,
      py::arg("ep") = 1, py::arg("etp") = py::none(),
      "Megatron-Core's fused tensors of trainer rank `rank` of `ranks` (its default order tp-cp-ep-dp-pp; TP tp, "
      "pp pipeline stages, EP ep, expert TP etp, tp when None): linear_qkv per query group, [gate; up] "
      "linear_fc1, row-parallel linear_proj / linear_fc2, grouped experts' linear_fc1.weight{i} / "
      "linear_fc2.weight{i}, the vocabulary padded as Megatron pads it.");
  m.def(
      "llama_rank_spec",
      [](const sharding::LlamaConfig& c, int tp_rank, int tp_size, const std::string& scheme, int replica,
         const std::string& layout) {
        RankSpec s = take(sharding::llama_rank_spec(c, tp_rank, tp_size, take(parse_scheme(scheme))));
        s.replica = replica;
        set_layout(s, layout);
        return s;
      },
      py::arg("config"), py::arg("tp_rank"), py::arg("tp_size"), py::arg("scheme") = "none", py::arg("replica") = 0,
      py::arg("layout") = "ferry");
  m.def("parse_hf_config", [](const std::string& text) { return take(sharding::parse_hf_config(text)); });
  m.def("load_hf_config", [](const std::string& path) { return take(sharding::load_hf_config(path)); });
  m.def("to_llama_config", [](const ModelConfig& c) { return take(sharding::to_llama_config(c)); });
  m.def("describe_model", [](const ModelConfig& c) { return take(sharding::describe_model(c)); });
  m.def("preset_names", &sharding::preset_names);
  m.def("preset_model", [](const std::string& name) { return take(sharding::preset_model(name)); });
  m.def("model_from_json", [](const std::string& text) { return take(sharding::model_from_json(text)); });
  m.def("model_from_file", [](const std::string& path) { return take(sharding::model_from_file(path)); });
  m.def("schemes", [] {
    std::vector<std::string> out;
    for (auto s : kAllSchemes) out.emplace_back(scheme_name(s));
    return out;
  });
}

}  // namespace ferry::python
