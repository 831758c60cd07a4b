// What crosses between Python and ferry: Status as ferry.Error, dtypes by name, and tensors by
// DLPack in both directions without copies.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"
#include "core/tensor.h"
#include "python/dlpack.h"

namespace ferry::python {

namespace py = pybind11;

// ferry.Error(RuntimeError) with .code ("InvalidArgument", ...) and .message. Needs the GIL.
void init_errors(py::module_& m);
[[noreturn]] void raise_status(const Status& status);
inline void check(const Status& status) {
  if (!status.ok()) raise_status(status);
}
template <typename T>
T take(Result<T> result) {
  if (!result.ok()) raise_status(result.status());
  return std::move(result).value();
}
// The pending Python exception as a Status: a ferry.Error keeps its code, anything else becomes
// `fallback`. Needs the GIL.
Status status_from_python(const py::error_already_set& e, StatusCode fallback, std::string_view context);

// "bf16", "f32", ..., or a numpy / torch dtype ("float32", torch.bfloat16).
Result<DType> dtype_from_python(py::handle h);

// A tensor borrowed from a DLPack producer; the producer's memory lives until this is destroyed.
struct ImportedTensor {
  TensorView view;
  DLManagedTensor* managed = nullptr;
  ImportedTensor() = default;
  ImportedTensor(const ImportedTensor&) = delete;
  ImportedTensor& operator=(const ImportedTensor&) = delete;
  ~ImportedTensor();  // calls the producer's deleter, taking the GIL
};
using Imported = std::shared_ptr<ImportedTensor>;

// Borrows `obj` (anything with __dlpack__, or a "dltensor" capsule) without a copy. It must be
// contiguous, on the CPU or a CUDA device, of a dtype ferry knows. CUDA producers are not asked to
// synchronize: the caller's kernels writing `obj` must have completed. Needs the GIL.
// With `relabel`, the tensor's bytes are taken as that dtype whatever DLPack calls them (same
// element width; u8 for packed int4, whose last dimension doubles): numpy has no bf16 or f8.
Result<Imported> import_tensor(py::handle obj, std::string_view what, std::optional<DType> relabel = std::nullopt);

// ferry.Tensor: a view of memory that `owner` keeps alive, exported by DLPack. f8 storage is
// exported as u8 of the same shape and packed int4 as u8 with the last dimension halved, since
// few consumers take those dtypes; `dtype` keeps ferry's name.
struct ExportedTensor {
  TensorView view;
  py::object owner;
};
void init_tensor(py::module_& m);

}  // namespace ferry::python
