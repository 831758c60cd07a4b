// Trainer and RolloutWorker from Python. Transfers and processing run with the GIL released; the
// pause and resume hooks, which ferry calls on its own threads, take it.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <optional>
#include <set>
#include <type_traits>

#include "coordinator/rollout_worker.h"
#include "coordinator/trainer.h"
#include "python/bindings.h"

namespace ferry::python {
namespace {

using coordinator::PauseRequest;
using coordinator::RolloutWorker;
using coordinator::Trainer;
using coordinator::UpdateReport;

// Runs `f` without the GIL and raises its Status, if any, with the GIL back.
template <typename F>
auto nogil(F&& f) {
  auto r = [&] {
    py::gil_scoped_release release;
    return f();
  }();
  if constexpr (std::is_same_v<decltype(r), Status>) {
    check(r);
  } else {
    return take(std::move(r));
  }
}

// A torch DTensor (FSDP2's sharded parameters) crosses as its local tensor: the box of the global
// tensor this rank holds (holdings), never gathered. Anything else crosses as it is.
py::object local_of(py::handle t) {
  if (py::hasattr(t, "to_local") && py::hasattr(t, "placements") && py::hasattr(t, "device_mesh")) {
    return t.attr("to_local")();
  }
  return py::reinterpret_borrow<py::object>(t);
}

// holdings: {name: None (held whole) | (offset, size) | Region}, the box of each global tensor this
// trainer rank holds; names left out are not held. None: every tensor whole.
sharding::SenderInfo holdings_from_python(py::handle obj) {
  sharding::SenderInfo out;
  if (obj.is_none()) return out;
  if (!py::isinstance<py::dict>(obj) && !(py::hasattr(obj, "items") && py::hasattr(obj, "keys"))) {
    throw py::type_error("holdings: a mapping {name: None | (offset, size) | Region}");
  }
  for (py::handle item : obj.attr("items")()) {
    auto pair = item.cast<py::tuple>();
    const auto name = pair[0].cast<std::string>();
    py::handle box = pair[1];
    if (box.is_none()) {
      out.owns.push_back(name);
      continue;
    }
    Region r;
    try {
      if (py::hasattr(box, "offset") && py::hasattr(box, "size") && !py::isinstance<py::sequence>(box)) {
        r.offset = box.attr("offset").cast<Shape>();
        r.size = box.attr("size").cast<Shape>();
      } else {
        auto seq = box.cast<py::sequence>();
        if (seq.size() != 2) throw py::cast_error();
        r.offset = seq[0].cast<Shape>();
        r.size = seq[1].cast<Shape>();
      }
    } catch (const py::cast_error&) {
      throw py::value_error("holdings[" + name + "]: None (whole), (offset, size) or a Region");
    }
    if (r.offset.size() != r.size.size()) {
      throw py::value_error(fmt::format("holdings[{}]: {} offsets for {} sizes", name, r.offset.size(), r.size.size()));
    }
    out.holds.push_back(sharding::Holding{name, std::move(r)});
  }
  // Empty would mean "every tensor whole", the opposite of a mapping that names nothing.
  if (out.owns.empty() && out.holds.empty()) {
    throw py::value_error("holdings name no tensor; pass None when this trainer rank holds every tensor whole");
  }
  return out;
}

struct PyTrainer {
  std::unique_ptr<Trainer> trainer;
  Settings settings;  // what it was made with
  // Tensors of the update in flight: in-place transports read them until finish returns.
  std::vector<Imported> held;

  ~PyTrainer() { close(); }
  Trainer& get() {
    if (!trainer) raise_status(Status::failed_precondition("the trainer is closed"));
    return *trainer;
  }
  void close() {
    py::gil_scoped_release release;
    trainer.reset();
  }
};

// Looks tensors up by name in a Python mapping, in the order the plan asks for them.
class MappingSource final : public coordinator::WeightSource {
 public:
  MappingSource(py::object mapping, std::vector<Imported>& held) : mapping_(std::move(mapping)), held_(held) {}
  Result<TensorView> get(const std::string& name) override {
    py::gil_scoped_acquire gil;
    try {
      py::object t = local_of(mapping_[py::str(name)]);
      FERRY_ASSIGN_OR_RETURN(Imported imp, import_tensor(t, name));
      held_.push_back(imp);
      return imp->view;
    } catch (const py::error_already_set& e) {
      return status_from_python(e, e.matches(PyExc_KeyError) ? StatusCode::kNotFound : StatusCode::kInvalidArgument,
                                "weights[" + name + "]");
    }
  }

 private:
  py::object mapping_;
  std::vector<Imported>& held_;
};

// A Python callable, released under the GIL whenever the C++ side lets go of it.
struct PyHook {
  py::object fn;
  explicit PyHook(py::object f) : fn(std::move(f)) {}
  ~PyHook() {
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
  template <typename... A>
  Status call(const char* what, A&&... args) {
    py::gil_scoped_acquire gil;
    try {
      fn(std::forward<A>(args)...);
      return ok_status();
    } catch (const py::error_already_set& e) {
      return status_from_python(e, StatusCode::kAborted, std::string(what) + " hook raised");
    }
  }
};

struct PyWorker;
std::set<PyWorker*>& live_workers() {
  static std::set<PyWorker*> s;
  return s;
}

struct PyWorker {
  std::shared_ptr<PyStorage> storage;
  std::unique_ptr<RolloutWorker> worker;
  Settings settings;  // what it was made with

  PyWorker() { live_workers().insert(this); }
  ~PyWorker() {
    live_workers().erase(this);
    close();
  }
  RolloutWorker& get() {
    if (!worker) raise_status(Status::failed_precondition("the rollout worker is closed"));
    return *worker;
  }
  // The worker's threads may be inside a hook waiting for the GIL: let go of it while they stop.
  void close() {
    py::gil_scoped_release release;
    worker.reset();
  }
};

std::unique_ptr<PyWorker> make_worker(const sharding::RankSpec& spec, std::shared_ptr<PyStorage> storage,
                                      py::object pause, py::object resume, const py::kwargs& settings) {
  auto out = std::make_unique<PyWorker>();
  out->storage = std::move(storage);
  out->settings = settings_from_keywords(settings, "RolloutWorker");
  coordinator::RolloutOptions o;
  o.settings = out->settings;  // its coordinator= is FERRY_COORDINATOR's keyword
  o.spec = spec;
  o.storage = out->storage->storage.get();
  if (!pause.is_none()) {
    auto hook = std::make_shared<PyHook>(std::move(pause));
    o.pause = [hook](const PauseRequest& r) { return hook->call("pause", r); };
  }
  if (!resume.is_none()) {
    auto hook = std::make_shared<PyHook>(std::move(resume));
    o.resume = [hook](uint64_t version) { return hook->call("resume", version); };
  }
  out->worker = nogil([&] { return RolloutWorker::create(std::move(o)); });
  return out;
}

// Blocks until the coordinator closes, waking to let Python handle signals (Ctrl-C).
void serve(PyWorker& w, std::optional<int64_t> timeout_ms) {
  RolloutWorker& r = w.get();
  if (timeout_ms) return nogil([&] { return r.wait_closed(*timeout_ms); });
  for (;;) {
    Status s = [&] {
      py::gil_scoped_release release;
      return r.wait_closed(200);
    }();
    if (s.ok()) return;
    if (s.code() != StatusCode::kDeadlineExceeded) raise_status(s);
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace

void init_update(py::module_& m) {
  py::class_<UpdateReport>(m, "UpdateReport", "What finish_weight_update() measured.")
      .def_readonly("version", &UpdateReport::version)
      .def_readonly("ranks", &UpdateReport::ranks)
      .def_readonly("bytes", &UpdateReport::bytes)
      .def_readonly("moved", &UpdateReport::moved)
      .def_readonly("registered", &UpdateReport::registered)
      .def_readonly("peak_staging_bytes", &UpdateReport::peak_staging_bytes)
      .def_readonly("allocated_staging_bytes", &UpdateReport::allocated_staging_bytes,
                    "host staging and scratch the ranks allocated anew, summed (0 while updates keep their shape)")
      .def_readonly("seconds", &UpdateReport::seconds)
      .def_readonly("pause_seconds", &UpdateReport::pause_seconds)
      .def_readonly("plan_seconds", &UpdateReport::plan_seconds)
      .def_readonly("transfer_seconds", &UpdateReport::transfer_seconds)
      .def_readonly("process_seconds", &UpdateReport::process_seconds)
      .def_readonly("resume_seconds", &UpdateReport::resume_seconds)
      .def_readonly("pause_window_seconds", &UpdateReport::pause_window_seconds,
                    "the longest time a replica did not serve (staged: its apply)")
      .def_readonly("staged", &UpdateReport::staged)
      .def_readonly("apply_seconds", &UpdateReport::apply_seconds, "staged: the longest apply of a replica")
      .def_readonly("delta_copy_bytes", &UpdateReport::delta_copy_bytes,
                    "memory (host, or device: FERRY_DELTA_COPY) this trainer keeps to compute deltas against")
      .def_readonly("shadow_bytes", &UpdateReport::shadow_bytes,
                    "memory the ranks keep as delta shadows, host or device (FERRY_DELTA_SHADOW), summed")
      .def_readonly("compared_bytes", &UpdateReport::compared_bytes,
                    "bytes this trainer compared against its copies: each part once, however many replicas take it")
      .def_readonly("compare_seconds", &UpdateReport::compare_seconds,
                    "this trainer's time comparing and encoding deltas (each part once)")
      .def_readonly(
          "copy_seconds", &UpdateReport::copy_seconds,
          "this trainer's time keeping its copies of the tensors sent, which the next update compares against")
      .def_property_readonly("wire_bytes", &UpdateReport::wire_bytes, "payload bytes this trainer sent, over ranks")
      .def_property_readonly(
          "delta_bytes",
          [](const UpdateReport& r) {
            uint64_t b = 0;
            for (const auto& d : r.delta) b += d.delta_bytes;
            return b;
          },
          "of wire_bytes, the delta pieces' encodings")
      .def_property_readonly(
          "changed_fraction",
          [](const UpdateReport& r) {
            uint64_t c = 0, e = 0;
            for (const auto& d : r.delta) c += d.changed, e += d.elements;
            return e ? static_cast<double>(c) / static_cast<double>(e) : 0.0;
          },
          "of the elements compared against the version a rank held, the fraction that changed")
      .def_property_readonly("gbps", &UpdateReport::gbps)
      .def("as_dict",
           [](const UpdateReport& r) {
             py::dict d;
             for (const char* k : {"version",
                                   "ranks",
                                   "bytes",
                                   "moved",
                                   "registered",
                                   "peak_staging_bytes",
                                   "allocated_staging_bytes",
                                   "seconds",
                                   "pause_seconds",
                                   "plan_seconds",
                                   "transfer_seconds",
                                   "process_seconds",
                                   "resume_seconds",
                                   "pause_window_seconds",
                                   "staged",
                                   "apply_seconds",
                                   "wire_bytes",
                                   "delta_bytes",
                                   "changed_fraction",
                                   "gbps"}) {
               d[k] = py::cast(r).attr(k);
             }
             return d;
           })
      .def("__repr__", [](const UpdateReport& r) {
        return fmt::format("UpdateReport(version={}, ranks={}, bytes={}, seconds={:.4f}, gbps={:.2f}, moved={}/{})",
                           r.version, r.ranks, r.bytes, r.seconds, r.gbps(), r.moved, r.registered);
      });

  py::class_<PauseRequest>(m, "PauseRequest", "What the pause hook is told.")
      .def_readonly("version", &PauseRequest::version)
      .def_readonly("mode", &PauseRequest::mode)
      .def_readonly("clear_cache", &PauseRequest::clear_cache)
      .def("__repr__", [](const PauseRequest& r) {
        return fmt::format("PauseRequest(version={}, mode='{}', clear_cache={})", r.version, r.mode, r.clear_cache);
      });

  py::class_<PyTrainer>(m, "Trainer", "The trainer side: start_weight_update, send, finish_weight_update.")
      .def(py::init([](const std::string& coordinator, uint16_t port, const std::string& pause_mode, bool clear_cache,
                       int trainer_rank, int trainer_ranks, const py::kwargs& settings) {
             auto t = std::make_unique<PyTrainer>();
             t->settings = settings_from_keywords(settings, "Trainer");
             coordinator::TrainerOptions o;
             o.coordinator = coordinator;
             o.port = port;
             o.pause_mode = pause_mode;
             o.clear_cache = clear_cache;
             o.settings = t->settings;
             o.trainer_rank = trainer_rank;
             o.trainer_ranks = trainer_ranks;
             t->trainer = nogil([&] { return Trainer::create(o); });
             return t;
           }),
           py::arg("coordinator") = "", py::arg("port") = 0, py::arg("pause_mode") = "abort",
           py::arg("clear_cache") = true, py::arg("trainer_rank") = 0, py::arg("trainer_ranks") = 1,
           "Joins `coordinator` (host:port), or embeds one when it is empty (on listen_host and `port`). A "
           "sharded trainer is trainer_rank of trainer_ranks processes joining one coordinator (one of them may "
           "embed it; ferry.distributed_trainer() does that for a torch.distributed job); updates are then "
           "collective over them. Every "
           "other keyword is a setting, FERRY_* lower-cased without FERRY_ (bucket_bytes='64M', timeout_ms=5000, "
           "transport='tcp', ...), and beats the environment; .settings shows each value and its source.")
      .def_property_readonly("coordinator_address", [](PyTrainer& t) { return t.get().coordinator_address(); })
      .def_property_readonly(
          "settings", [](PyTrainer& t) { return settings_to_python(t.settings); },
          "{keyword: (value, source)}: the settings this trainer took, source 'keyword', 'environment' or 'default'.")
      .def(
          "wait_for_ranks",
          [](PyTrainer& t, int n, int64_t timeout_ms) {
            Trainer& tr = t.get();
            nogil([&] { return tr.wait_for_ranks(n, timeout_ms); });
          },
          py::arg("n"), py::arg("timeout_ms") = 30000)
      .def(
          "start_weight_update",
          [](PyTrainer& t, uint64_t version, py::handle manifest, std::optional<std::string> pause_mode,
             std::optional<bool> clear_cache, std::optional<std::vector<int>> replicas, py::object holdings, bool stage,
             py::object source_layout) {
            Trainer& tr = t.get();
            const sharding::Manifest mf = manifest_from_python(manifest);
            // A manifest from manifest_from_state_dict() of DTensors carries this rank's holdings.
            if (holdings.is_none()) holdings = py::getattr(manifest, "holdings", py::none());
            sharding::SenderInfo held = holdings_from_python(holdings);
            t.held.clear();
            if (!pause_mode && !clear_cache && !replicas && holdings.is_none() && !stage && source_layout.is_none()) {
              return nogil([&] { return tr.start_weight_update(version, mf); });
            }
            coordinator::UpdateOptions o;
            if (pause_mode) o.pause_mode = *pause_mode;
            if (clear_cache) o.clear_cache = *clear_cache;
            if (replicas) o.replicas = *replicas;
            o.stage = stage;
            o.holdings = std::move(held);
            if (!source_layout.is_none()) o.source_layout = source_layout.cast<sharding::SourceLayout>();
            nogil([&] { return tr.start_weight_update(version, mf, o); });
          },
          py::arg("version"), py::arg("manifest"), py::arg("pause_mode") = py::none(),
          py::arg("clear_cache") = py::none(), py::arg("replicas") = py::none(), py::arg("holdings") = py::none(),
          py::arg("stage") = false, py::arg("source_layout") = py::none(),
          "Checks the manifest against every replica, pauses them and plans. Manifest: SourceTensor objects "
          "or (name, dtype, shape) tuples, global shapes. holdings: what this trainer rank holds, {name: None "
          "(whole) | (offset, size) box of the global tensor}, names left out not held (see "
          "ferry.holdings_from_state_dict); None: the manifest's .holdings if it has them, else every tensor "
          "whole. stage: the ranks receive the version while they serve and pause only to apply it (or "
          "FERRY_STAGE=on). source_layout: this rank's tensors are fused ones (ferry.megatron_layout), sent under "
          "their own names. With several trainer ranks, every one starts the update (collective).")
      .def(
          "send",
          [](PyTrainer& t, const std::string& name, py::handle tensor) {
            Trainer& tr = t.get();
            Imported imp = take(import_tensor(local_of(tensor), name));
            t.held.push_back(imp);
            nogil([&] { return tr.send(name, imp->view); });
          },
          py::arg("name"), py::arg("tensor"),
          "Sends one tensor of the manifest (torch, numpy, any DLPack tensor): the held box of it, a DTensor's "
          "to_local().")
      .def(
          "update_weights",
          [](PyTrainer& t, py::object weights) {
            Trainer& tr = t.get();
            if (py::hasattr(weights, "keys") && py::hasattr(weights, "__getitem__")) {
              MappingSource source(weights, t.held);
              return nogil([&] { return tr.update_weights(source); });
            }
            for (py::handle item : weights) {
              auto pair = item.cast<py::sequence>();
              if (pair.size() != 2) throw py::value_error("weights are (name, tensor) pairs");
              const auto name = pair[0].cast<std::string>();
              Imported imp = take(import_tensor(local_of(pair[1]), name));
              t.held.push_back(imp);
              nogil([&] { return tr.send(name, imp->view); });
            }
          },
          py::arg("weights"),
          "Sends every tensor this trainer rank holds: a mapping is read in plan order, and asked only for "
          "held tensors; an iterable of (name, tensor) pairs (e.g. model.state_dict().items() or a generator) "
          "is sent as it comes. DTensor values send their to_local(), never a gathered full_tensor().")
      .def(
          "finish_weight_update",
          [](PyTrainer& t) {
            Trainer& tr = t.get();
            auto r = [&] {
              py::gil_scoped_release release;
              return tr.finish_weight_update();
            }();
            t.held.clear();
            return take(std::move(r));
          },
          "Waits until every rank holds the version, resumes them together, and returns the UpdateReport.")
      .def(
          "abort_weight_update",
          [](PyTrainer& t, const std::string& reason) {
            Trainer& tr = t.get();
            nogil([&] { return tr.abort_weight_update(reason); });
            t.held.clear();
          },
          py::arg("reason") = "aborted by the trainer",
          "Ends the open update without finishing it (after a failed send, say): the ranks stay paused and "
          "inconsistent, or roll back with FERRY_ROLLBACK=host. Raises when no update is open.")
      .def("close", &PyTrainer::close, "Stops the trainer (and its embedded coordinator); ranks see the job end.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyTrainer& t, py::args) { t.close(); });

  py::class_<PyWorker>(m, "RolloutWorker", "A rollout rank: registers its storage and serves updates.")
      .def(py::init(&make_worker), py::arg("spec"), py::arg("storage"), py::arg("pause") = py::none(),
           py::arg("resume") = py::none(),
           "Joins the coordinator (keyword coordinator='host:port', else FERRY_COORDINATOR) and serves updates on "
           "background threads. pause(request) runs before any byte of an update is written; resume(version) "
           "once every rank of the replica holds it. Both run on ferry's threads; an exception fails the update. "
           "Every other keyword is a setting too (timeout_ms=5000, verify=True, rollback='host', ...) and beats "
           "the environment; .settings shows each value and its source.")
      .def_property_readonly(
          "settings", [](PyWorker& w) { return settings_to_python(w.settings); },
          "{keyword: (value, source)}: the settings this rank took, source 'keyword', 'environment' or 'default'.")
      .def_property_readonly("weight_version", [](PyWorker& w) { return w.get().weight_version(); })
      .def_property_readonly("consistent", [](PyWorker& w) { return w.get().consistent(); })
      .def_property_readonly("paused", [](PyWorker& w) { return w.get().paused(); })
      .def_property_readonly("storage", [](PyWorker& w) { return w.storage; })
      .def(
          "wait_serving", [](PyWorker& w, int64_t timeout_ms) {
            RolloutWorker& r = w.get();
            nogil([&] { return r.wait_serving(timeout_ms); });
          },
          py::arg("timeout_ms") = 30000)
      .def(
          "wait_closed", [](PyWorker& w, int64_t timeout_ms) {
            RolloutWorker& r = w.get();
            nogil([&] { return r.wait_closed(timeout_ms); });
          },
          py::arg("timeout_ms"))
      .def("serve", &serve, py::arg("timeout_ms") = py::none(),
           "Serves updates until the coordinator ends the job (or timeout_ms passes: DeadlineExceeded). "
           "Raises when the coordinator was lost instead, saying the state it left this rank in.")
      .def(
          "resume", [](PyWorker& w) {
            RolloutWorker& r = w.get();
            nogil([&] { return r.resume(); });
          },
          "Runs the resume hook again after it failed at the end of an update; the replica serves again "
          "once it succeeds.")
      .def("close", &PyWorker::close)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyWorker& w, py::args) { w.close(); });

  // Workers still open at exit would call hooks into a finalizing interpreter.
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    for (PyWorker* w : std::set<PyWorker*>(live_workers())) w->close();
  }));
}

}  // namespace ferry::python
