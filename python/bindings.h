// The pieces of the ferry Python module, one init function per file.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/settings.h"
#include "python/external_storage.h"
#include "python/interop.h"
#include "reload/model_storage.h"
#include "sharding/model_spec.h"

// ferry::Dims (a region's offsets or sizes) as a Python list of ints, and any sequence of ints back.
namespace pybind11::detail {
template <>
struct type_caster<ferry::Dims> {
  PYBIND11_TYPE_CASTER(ferry::Dims, const_name("list[int]"));
  bool load(handle src, bool convert) {
    make_caster<std::vector<int64_t>> values;
    if (!values.load(src, convert)) return false;
    const auto& v = cast_op<const std::vector<int64_t>&>(values);
    value = ferry::Dims(v.begin(), v.end());
    return true;
  }
  static handle cast(const ferry::Dims& d, return_value_policy policy, handle parent) {
    return make_caster<std::vector<int64_t>>::cast(std::vector<int64_t>(d.begin(), d.end()), policy, parent);
  }
};

}  // namespace pybind11::detail

namespace ferry::python {

// A rank's storage and everything keeping its memory alive. Members are destroyed bottom up: the
// storage, then the allocator it borrowed through, then the engine's tensors.
struct PyStorage {
  std::vector<Imported> borrowed;
  std::unique_ptr<BorrowedAllocator> allocator;
  std::unique_ptr<reload::ModelStorage> storage;
};

// (name, dtype, shape) tuples or SourceTensor objects.
sharding::Manifest manifest_from_python(py::handle obj);

void init_log(py::module_& m);      // forward_logs, flush_logs: ferry's log to Python's logging
void init_model(py::module_& m);    // specs, configs, presets, manifests
void init_storage(py::module_& m);  // ModelStorage, storage_tensors
void init_update(py::module_& m);   // Trainer, RolloutWorker, UpdateReport, PauseRequest
void init_settings(py::module_& m); // ferry.settings(**keywords)

// The settings snapshot of keyword arguments (TypeError naming an unknown keyword; ferry.Error for a
// malformed value) over the environment, for `who` ("Trainer").
Settings settings_from_keywords(const py::kwargs& keywords, std::string_view who);
// {keyword: (value, source)} for every setting (the token shown as "(set)").
py::dict settings_to_python(const Settings& s);

}  // namespace ferry::python
