// The ferry module: `import ferry` (the package in python/ferry re-exports this extension).
#include "core/version.h"
#include "python/bindings.h"

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "ferry: move fresh weights from an RL trainer into live rollout engines.";
  m.attr("__version__") = ferry::kVersion;
  ferry::python::init_errors(m);
  ferry::python::init_log(m);  // before init_update: see its atexit hook
  ferry::python::init_tensor(m);
  ferry::python::init_model(m);
  ferry::python::init_storage(m);
  ferry::python::init_update(m);
  ferry::python::init_settings(m);
}
