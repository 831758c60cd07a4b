#include "python/interop.h"

#include <fmt/format.h>

#include <array>
#include <utility>
#include <vector>

namespace ferry::python {
namespace {

// Borrowed for the life of the process: a static py::object would be released after the
// interpreter is gone.
PyObject* g_error = nullptr;

StatusCode code_from_name(const std::string& name, StatusCode fallback) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    if (status_code_name(static_cast<StatusCode>(c)) == name) return static_cast<StatusCode>(c);
  }
  return fallback;
}

Result<DType> dtype_from_dl(DLDataType t) {
  if (t.lanes != 1) return Status::invalid_argument(fmt::format("DLPack dtype with {} lanes", t.lanes));
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::kF32;
      if (t.bits == 16) return DType::kF16;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBF16;
      break;
    case kDLInt:
      if (t.bits == 8) return DType::kI8;
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 64) return DType::kI64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::kU8;
      break;
    case kDLFloat8_e4m3fn:
      if (t.bits == 8) return DType::kF8E4M3FN;
      break;
    case kDLFloat8_e5m2:
      if (t.bits == 8) return DType::kF8E5M2;
      break;
    default:
      break;
  }
  return Status::invalid_argument(fmt::format("DLPack dtype code {} bits {} has no ferry dtype", t.code, t.bits));
}

// The dtype and shape a DLPack consumer sees for a ferry view (see ExportedTensor).
std::pair<DLDataType, Shape> dl_export_type(const TensorView& v) {
  switch (v.dtype()) {
    case DType::kF32: return {{kDLFloat, 32, 1}, v.shape()};
    case DType::kF16: return {{kDLFloat, 16, 1}, v.shape()};
    case DType::kBF16: return {{kDLBfloat, 16, 1}, v.shape()};
    case DType::kI8: return {{kDLInt, 8, 1}, v.shape()};
    case DType::kI32: return {{kDLInt, 32, 1}, v.shape()};
    case DType::kI64: return {{kDLInt, 64, 1}, v.shape()};
    case DType::kU8:
    case DType::kF8E4M3FN:
    case DType::kF8E5M2: return {{kDLUInt, 8, 1}, v.shape()};
    case DType::kI4Packed: {
      Shape s = v.shape();
      if (!s.empty() && s.back() % 2 == 0) {
        s.back() /= 2;
      } else {
        s = {static_cast<int64_t>(v.nbytes())};
      }
      return {{kDLUInt, 8, 1}, s};
    }
  }
  return {{kDLUInt, 8, 1}, {static_cast<int64_t>(v.nbytes())}};
}

struct ExportContext {
  DLManagedTensor managed{};
  Shape shape;
  PyObject* owner = nullptr;
};

void export_deleter(DLManagedTensor* m) {
  auto* ctx = static_cast<ExportContext*>(m->manager_ctx);
  // Consumers may free their tensor on any thread, with or without the GIL.
  PyGILState_STATE s = PyGILState_Ensure();
  Py_XDECREF(ctx->owner);
  PyGILState_Release(s);
  delete ctx;
}

void capsule_destructor(PyObject* capsule) {
  // Never consumed: the capsule still owns the tensor.
  if (PyCapsule_IsValid(capsule, kDLTensorCapsule)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kDLTensorCapsule));
    if (m && m->deleter) m->deleter(m);
  }
}

py::capsule to_capsule(const ExportedTensor& t) {
  auto* ctx = new ExportContext;
  auto [dl_dtype, shape] = dl_export_type(t.view);
  ctx->shape = std::move(shape);
  ctx->owner = t.owner.ptr();
  Py_XINCREF(ctx->owner);
  DLTensor& d = ctx->managed.dl_tensor;
  d.data = t.view.data();
  d.device = t.view.device().is_cuda() ? DLDevice{kDLCUDA, t.view.device().index} : DLDevice{kDLCPU, 0};
  d.ndim = static_cast<int32_t>(ctx->shape.size());
  d.dtype = dl_dtype;
  d.shape = ctx->shape.data();
  d.strides = nullptr;
  d.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = export_deleter;
  PyObject* cap = PyCapsule_New(&ctx->managed, kDLTensorCapsule, capsule_destructor);
  if (cap == nullptr) {
    export_deleter(&ctx->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

bool is_compact(const DLTensor& d) {
  if (d.strides == nullptr) return true;
  int64_t expected = 1;
  for (int i = d.ndim - 1; i >= 0; --i) {
    if (d.shape[i] != 1 && d.strides[i] != expected) return false;
    expected *= d.shape[i];
  }
  return true;
}

}  // namespace

void init_errors(py::module_& m) {
  g_error = PyErr_NewExceptionWithDoc("ferry.Error",
                                      "A ferry Status: .code is its canonical code name, .message its text.",
                                      PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_error);
}

void raise_status(const Status& status) {
  py::object err = py::reinterpret_borrow<py::object>(g_error)(status.to_string());
  err.attr("code") = std::string(status_code_name(status.code()));
  err.attr("message") = status.message();
  PyErr_SetObject(g_error, err.ptr());
  throw py::error_already_set();
}

Status status_from_python(const py::error_already_set& e, StatusCode fallback, std::string_view context) {
  StatusCode code = fallback;
  std::string text = e.what();
  if (e.matches(g_error)) {
    py::object v = e.value();
    if (py::hasattr(v, "code")) code = code_from_name(py::str(v.attr("code")), fallback);
    if (py::hasattr(v, "message")) text = py::str(v.attr("message"));
  }
  return Status(code, fmt::format("{}: {}", context, text));
}

Result<DType> dtype_from_python(py::handle h) {
  std::string s = py::str(h);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  static const std::array<std::pair<std::string_view, DType>, 11> kAliases = {{
      {"float32", DType::kF32},
      {"float", DType::kF32},
      {"float16", DType::kF16},
      {"half", DType::kF16},
      {"bfloat16", DType::kBF16},
      {"int8", DType::kI8},
      {"uint8", DType::kU8},
      {"int32", DType::kI32},
      {"int64", DType::kI64},
      {"float8_e4m3fn", DType::kF8E4M3FN},
      {"float8_e5m2", DType::kF8E5M2},
  }};
  for (const auto& [name, dt] : kAliases) {
    if (s == name) return dt;
  }
  return parse_dtype(s);
}

ImportedTensor::~ImportedTensor() {
  if (managed == nullptr || managed->deleter == nullptr) return;
  py::gil_scoped_acquire gil;
  managed->deleter(managed);
}

Result<Imported> import_tensor(py::handle obj, std::string_view what, std::optional<DType> relabel) {
  py::object capsule;
  try {
    if (PyCapsule_CheckExact(obj.ptr())) {
      capsule = py::reinterpret_borrow<py::object>(obj);
    } else if (py::hasattr(obj, "__dlpack__")) {
      py::object src = py::reinterpret_borrow<py::object>(obj);
      // torch refuses to export a tensor that requires grad; detach() shares its storage.
      if (py::hasattr(src, "requires_grad") && src.attr("requires_grad").cast<bool>() && py::hasattr(src, "detach")) {
        src = src.attr("detach")();
      }
      capsule = src.attr("__dlpack__")();
    } else {
      return Status::invalid_argument(
          fmt::format("{}: a {} is not a DLPack tensor (no __dlpack__)", what, std::string(py::str(obj.get_type()))));
    }
  } catch (const py::error_already_set& e) {
    return status_from_python(e, StatusCode::kInvalidArgument, fmt::format("{}: __dlpack__", what));
  }
  if (!PyCapsule_IsValid(capsule.ptr(), kDLTensorCapsule)) {
    PyErr_Clear();
    return Status::invalid_argument(fmt::format("{}: not an unconsumed \"dltensor\" capsule", what));
  }
  auto out = std::make_shared<ImportedTensor>();
  out->managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kDLTensorCapsule));
  // From here the capsule is ours: the producer's memory lives until `out` calls the deleter.
  if (PyCapsule_SetName(capsule.ptr(), kUsedDLTensorCapsule) != 0) {
    out->managed = nullptr;
    PyErr_Clear();
    return Status::internal(fmt::format("{}: cannot mark the DLPack capsule used", what));
  }
  const DLTensor& d = out->managed->dl_tensor;
  Device device;
  if (d.device.device_type == kDLCPU || d.device.device_type == kDLCUDAHost) {
    device = Device::cpu();
  } else if (d.device.device_type == kDLCUDA || d.device.device_type == kDLCUDAManaged) {
    device = Device::cuda(d.device.device_id);
  } else {
    return Status::invalid_argument(fmt::format("{}: DLPack device type {} is neither CPU nor CUDA", what, d.device.device_type));
  }
  if (!is_compact(d)) {
    return Status::invalid_argument(fmt::format("{}: tensor is not contiguous (make it contiguous first)", what));
  }
  Shape shape(d.shape, d.shape + d.ndim);
  Result<DType> dtype = relabel ? Result<DType>(*relabel) : dtype_from_dl(d.dtype);
  if (!dtype.ok()) return dtype.status().with_context(what);
  if (relabel) {
    const int given_bits = d.dtype.bits * d.dtype.lanes;
    const bool packed = *relabel == DType::kI4Packed;
    if (given_bits != (packed ? 8 : dtype_bits(*relabel)) || (packed && shape.empty())) {
      return Status::invalid_argument(fmt::format("{}: {}-bit elements cannot be viewed as {}", what, given_bits,
                                                  dtype_name(*relabel)));
    }
    if (packed) shape.back() *= 2;
  }
  char* data = static_cast<char*>(d.data) + d.byte_offset;
  out->view = TensorView(data, *dtype, std::move(shape), device);
  return out;
}

namespace {
// Keeps a borrowed tensor alive for the ferry.Tensor views made of it.
struct Borrowed {
  Imported tensor;
};
}  // namespace

void init_tensor(py::module_& m) {
  py::class_<Borrowed>(m, "_Borrowed");
  m.def(
      "view_as",
      [](py::handle obj, py::handle dtype) {
        Imported t = take(import_tensor(obj, "view_as", take(dtype_from_python(dtype))));
        const TensorView v = t->view;
        return ExportedTensor{v, py::cast(Borrowed{std::move(t)})};
      },
      py::arg("tensor"), py::arg("dtype"),
      "The same memory as a ferry.Tensor of `dtype` (same element width): e.g. a numpy uint16 array as bf16, "
      "or uint8 as f8_e4m3fn. No copy.");
  py::class_<ExportedTensor>(m, "Tensor",
                             "A view of memory ferry registered or allocated; exported by DLPack without a copy.")
      .def("__dlpack__", [](const ExportedTensor& t, py::kwargs) { return to_capsule(t); })
      .def("__dlpack_device__",
           [](const ExportedTensor& t) {
             return t.view.device().is_cuda() ? py::make_tuple(static_cast<int>(kDLCUDA), t.view.device().index)
                                              : py::make_tuple(static_cast<int>(kDLCPU), 0);
           })
      .def_property_readonly("dtype", [](const ExportedTensor& t) { return std::string(dtype_name(t.view.dtype())); })
      .def_property_readonly("shape", [](const ExportedTensor& t) { return py::tuple(py::cast(t.view.shape())); })
      .def_property_readonly("device", [](const ExportedTensor& t) { return t.view.device().to_string(); })
      .def_property_readonly("data_ptr", [](const ExportedTensor& t) { return reinterpret_cast<uintptr_t>(t.view.data()); })
      .def_property_readonly("nbytes", [](const ExportedTensor& t) { return t.view.nbytes(); })
      .def(
          "raw", [](const ExportedTensor& t) {
            return ExportedTensor{TensorView(t.view.data(), DType::kU8, {static_cast<int64_t>(t.view.nbytes())}, t.view.device()),
                                  t.owner};
          },
          "The bytes as a 1-D u8 tensor (for consumers without bf16, e.g. numpy).")
      .def("__repr__", [](const ExportedTensor& t) { return "ferry.Tensor(" + t.view.describe() + ")"; });
}

}  // namespace ferry::python
