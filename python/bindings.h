// The pieces of the ferry Python module, one init function per file.
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "python/external_storage.h"
#include "python/interop.h"
#include "reload/model_storage.h"
#include "sharding/model_spec.h"

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

void init_model(py::module_& m);    // specs, configs, presets, manifests
void init_storage(py::module_& m);  // ModelStorage, storage_tensors
void init_update(py::module_& m);   // Trainer, RolloutWorker, UpdateReport, PauseRequest

}  // namespace ferry::python
