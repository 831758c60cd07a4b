// Settings as Python keyword arguments: every FERRY_* variable by its keyword (its name lower-cased
// without FERRY_: bucket_bytes, timeout_ms, transport, ...), beating the environment.
#include <fmt/format.h>

#include <variant>

#include "core/settings.h"
#include "python/bindings.h"

namespace ferry::python {
namespace {

std::string keyword_list() {
  std::string out;
  for (const SettingInfo& s : all_settings()) out += (out.empty() ? "" : ", ") + setting_keyword(s);
  return out;
}

}  // namespace

Settings settings_from_keywords(const py::kwargs& keywords, std::string_view who) {
  SettingOverrides overrides;
  for (auto [k, v] : keywords) {
    const auto key = k.cast<std::string>();
    const auto settings = all_settings();
    if (std::none_of(settings.begin(), settings.end(), [&](const SettingInfo& s) { return setting_keyword(s) == key; })) {
      throw py::type_error(
          fmt::format("{}() got an unexpected keyword argument '{}'; the settings are: {}", who, key, keyword_list()));
    }
    if (v.is_none()) continue;  // as if not given
    if (py::isinstance<py::bool_>(v)) {
      overrides[key] = v.cast<bool>() ? "1" : "0";
    } else if (py::isinstance<py::int_>(v) || py::isinstance<py::str>(v)) {
      overrides[key] = py::str(v).cast<std::string>();
    } else {
      throw py::type_error(fmt::format("{}() keyword '{}' takes a str, int or bool, not {}", who, key,
                                       py::type::of(v).attr("__name__").cast<std::string>()));
    }
  }
  return take(load_settings(overrides));
}

py::dict settings_to_python(const Settings& s) {
  py::dict out;
  for (const SettingInfo& info : all_settings()) {
    py::object value = std::visit([&](auto field) { return py::cast(s.*field); }, info.field);
    if (info.name == "FERRY_TOKEN" && !s.token.empty()) value = py::str("(set)");
    out[py::str(setting_keyword(info))] = py::make_tuple(value, std::string(source_name(s.source(info.name))));
  }
  return out;
}

void init_settings(py::module_& m) {
  m.def(
      "settings", [](const py::kwargs& keywords) { return settings_to_python(settings_from_keywords(keywords, "settings")); },
      "Every setting as a Trainer or RolloutWorker given these keywords would take it: {keyword: (value, source)}, "
      "source 'keyword', 'environment' (FERRY_<KEYWORD>) or 'default'. Keywords are the FERRY_* names lower-cased "
      "without FERRY_ (bucket_bytes='64M', timeout_ms=5000, transport='tcp', verify=True).");
}

}  // namespace ferry::python
