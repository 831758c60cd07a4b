// ModelStorage from Python: allocated by ferry, or wrapping the engine's own tensors by DLPack.
#include <pybind11/stl.h>

#include <fmt/format.h>

#include "python/bindings.h"
#include "reload/checkpoint_loader.h"
#include "reload/engine.h"

namespace ferry::python {
namespace {

Result<Device> device_from_python(py::handle h) {
  const std::string s = py::str(h);
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      return Device::cuda(std::stoi(s.substr(5)));
    } catch (const std::exception&) {
    }
  }
  return Status::invalid_argument("device must be cpu, cuda or cuda:N, not " + s);
}

std::shared_ptr<PyStorage> wrap(const sharding::RankSpec& spec, py::handle tensors, py::handle none_dtype, bool strict) {
  auto out = std::make_shared<PyStorage>();
  std::map<std::string, TensorView> views;
  py::object items = py::hasattr(tensors, "items") ? tensors.attr("items")() : py::reinterpret_borrow<py::object>(tensors);
  for (py::handle item : items) {
    auto pair = item.cast<py::sequence>();
    if (pair.size() != 2) throw py::value_error("storage tensors are (name, tensor) pairs");
    const auto name = pair[0].cast<std::string>();
    Imported t = take(import_tensor(pair[1], name));
    views[name] = t->view;
    out->borrowed.push_back(std::move(t));
  }
  const DType nd = take(dtype_from_python(none_dtype));
  auto r = [&] {
    py::gil_scoped_release nogil;
    return wrap_storage(spec, nd, views, strict, out->allocator);
  }();
  out->storage = take(std::move(r));
  return out;
}

}  // namespace

void init_storage(py::module_& m) {
  py::class_<StorageEntry>(m, "StorageTensor", "One tensor of a rank's storage under its parameter's scheme.")
      .def_readonly("name", &StorageEntry::name)
      .def_readonly("param", &StorageEntry::param)
      .def_readonly("suffix", &StorageEntry::suffix)
      .def_property_readonly("dtype", [](const StorageEntry& e) { return std::string(dtype_name(e.dtype)); })
      .def_readonly("shape", &StorageEntry::shape)
      .def_readonly("runtime", &StorageEntry::runtime)
      .def_property_readonly("nbytes", [](const StorageEntry& e) { return dtype_bytes(e.dtype, shape_numel(e.shape)); })
      .def("__repr__", [](const StorageEntry& e) {
        return fmt::format("StorageTensor('{}', {}[{}]{})", e.name, dtype_name(e.dtype), fmt::join(e.shape, ", "),
                           e.runtime ? ", runtime" : "");
      });

  m.def(
      "storage_tensors",
      [](const sharding::RankSpec& spec, py::handle none_dtype) {
        return take(storage_entries(spec, take(dtype_from_python(none_dtype))));
      },
      py::arg("spec"), py::arg("none_dtype") = "bf16",
      "Every tensor the rank's storage holds (weights, scales, runtime tensors), in registration order.");

  m.def(
      "load_checkpoint",
      [](const sharding::RankSpec& spec, PyStorage& storage, py::handle tensors, uint64_t version) {
        reload::Checkpoint checkpoint;
        std::vector<Imported> held;  // the caller's memory, borrowed for the call
        for (auto item : tensors.cast<py::dict>()) {
          const auto name = item.first.cast<std::string>();
          Imported imp = take(import_tensor(item.second, name));
          checkpoint.emplace(name, imp->view);
          held.push_back(std::move(imp));
        }
        auto report = [&]() -> Result<reload::EngineReport> {
          py::gil_scoped_release nogil;
          reload::EngineOptions options;
          options.none_dtype = storage.storage->none_dtype();  // f32 or f16 storage is written as such
          FERRY_ASSIGN_OR_RETURN(auto engine, reload::ReloadEngine::create(spec, *storage.storage, options));
          return reload::load_checkpoint(*engine, checkpoint, version);
        }();
        const reload::EngineReport r = take(std::move(report));
        py::dict out;
        out["bytes"] = r.bytes;
        out["layers"] = r.layers;
        out["moved"] = r.census.moved;
        out["registered"] = r.census.registered;
        return out;
      },
      py::arg("spec"), py::arg("storage"), py::arg("tensors"), py::arg("version") = 1,
      "Loads a checkpoint held in host memory (name -> tensor) into the rank's storage in place, as an update "
      "would, without a trainer: a first load, or a quantized checkpoint (gptq_int4, whose inputs are named "
      "after the engine parameter with their suffix: '...qkv_proj.qweight', '.scales', '.g_idx'). Returns "
      "{'bytes', 'layers', 'moved', 'registered'}; moved is the census (0: no registered tensor moved). A load "
      "that fails (a tensor missing, a bad g_idx) may leave the layers before it, and rows of the one it stopped in, "
      "written; never load into "
      "storage a RolloutWorker is serving.");

  py::class_<PyStorage, std::shared_ptr<PyStorage>>(m, "ModelStorage",
                                                    "The tensors a rank's kernels read; their addresses never change.")
      .def_static(
          "allocate",
          [](const sharding::RankSpec& spec, py::handle device, py::handle none_dtype) {
            auto out = std::make_shared<PyStorage>();
            const Device dev = take(device_from_python(device));
            const DType nd = take(dtype_from_python(none_dtype));
            auto r = [&] {
              py::gil_scoped_release nogil;
              return reload::ModelStorage::allocate(spec, dev, nd);
            }();
            out->storage = std::make_unique<reload::ModelStorage>(take(std::move(r)));
            return out;
          },
          py::arg("spec"), py::arg("device") = "cpu", py::arg("none_dtype") = "bf16",
          "Zeroed storage allocated by ferry; hand its tensors() to the engine by DLPack.")
      .def_static("wrap", &wrap, py::arg("spec"), py::arg("tensors"), py::arg("none_dtype") = "bf16",
                  py::arg("strict") = true,
                  "Storage over the engine's own tensors (a mapping or (name, tensor) pairs, by storage name), "
                  "without copies. Every storage tensor of the spec must be given; f8 and packed int4 storage "
                  "may be given as u8 of the same bytes. With strict=False, other names are ignored.")
      .def(
          "tensors",
          [](py::object self) {
            auto& s = self.cast<PyStorage&>();
            py::dict out;
            for (const auto& [name, v] : s.storage->tensors()) out[py::str(name)] = py::cast(ExportedTensor{v, self});
            return out;
          },
          "name -> ferry.Tensor (DLPack) of every registered tensor.")
      .def(
          "get",
          [](py::object self, const std::string& name) {
            return ExportedTensor{take(self.cast<PyStorage&>().storage->get(name)), self};
          },
          py::arg("name"))
      .def_property_readonly("device", [](const PyStorage& s) { return s.storage->device().to_string(); })
      .def_property_readonly("bytes", [](const PyStorage& s) { return s.storage->bytes(); })
      .def("__len__", [](const PyStorage& s) { return s.storage->tensors().size(); })
      .def("__repr__", [](const PyStorage& s) {
        return fmt::format("ferry.ModelStorage({} tensors, {} bytes, {}{})", s.storage->tensors().size(),
                           s.storage->bytes(), s.storage->device().to_string(), s.borrowed.empty() ? "" : ", wrapped");
      });
}

}  // namespace ferry::python
