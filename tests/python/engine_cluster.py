"""The harness of the engine-layout tests: replicas whose ranks are RolloutWorkers over numpy arrays,
serving on threads, one trainer that updates them all over real sockets, and the comparison of every
byte of every rank's storage with what the references expect. The ranks wrap numpy arrays, so a
reallocation would leave them unchanged and fail the comparison."""

import threading

import numpy as np

import ferry

NUMPY_DTYPES = {"bf16": np.uint16, "f8_e4m3fn": np.uint8, "f32": np.float32, "i8": np.int8, "i32": np.int32}
TIMEOUT_MS = 120_000


class Replica:
    """The ranks of one replica, one RankSpec each, serving on threads. `expected(weights, rank)` gives
    {storage name: array} of a rank from the references alone."""

    def __init__(self, address, specs, expected, label):
        self.label, self.expected, self.tp = label, expected, len(specs)
        self.arrays, self.workers, self.threads, self.errors = [], [], [], []
        for spec in specs:
            tensors = ferry.storage_tensors(spec)
            arrays = {t.name: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for t in tensors}
            storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(arrays[t.name], t.dtype) for t in tensors})
            worker = ferry.RolloutWorker(spec, storage, coordinator=address)
            thread = threading.Thread(target=self._serve, args=(worker,), daemon=True)
            thread.start()
            self.arrays.append(arrays)
            self.workers.append(worker)
            self.threads.append(thread)

    def _serve(self, worker):
        try:
            worker.serve()
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.errors.append(e)


def serve_replicas(makers):
    """A trainer and one replica per maker(address, replica index) -> Replica, closed on exit."""
    trainer = ferry.Trainer()
    replicas = []
    try:
        for i, make in enumerate(makers):
            replicas.append(make(trainer.coordinator_address, i))
        trainer.wait_for_ranks(sum(rep.tp for rep in replicas), timeout_ms=TIMEOUT_MS)
        yield trainer, replicas
    finally:
        trainer.close()
        for rep in replicas:
            for w in rep.workers:
                w.close()
            for t in rep.threads:
                t.join(timeout=TIMEOUT_MS / 1000)


def normal_weights(manifest, seed):
    """{name: f32 array} of the manifest: N(0, 0.05), norms around 1."""
    rng = np.random.default_rng(seed)
    weights = {}
    for t in manifest:
        x = rng.standard_normal(t.shape).astype(np.float32) * np.float32(0.05)
        if "norm" in t.name:
            x = 1.0 + x
        weights[t.name] = x
    return weights


def updates_land_bit_exact(trainer, replicas, manifest, make_weights, versions=(1, 2)):
    """Each version: the trainer sends make_weights(manifest, seed) to every replica; every rank must
    then hold exactly the expected names, shapes and bytes, with a census of 0."""
    for version in versions:
        weights = make_weights(manifest, seed=10 + version)
        trainer.start_weight_update(version, manifest)
        trainer.update_weights(weights)
        report = trainer.finish_weight_update()
        assert report.version == version
        assert report.moved == 0
        for rep in replicas:
            assert not rep.errors, rep.errors
            for rank, arrays in enumerate(rep.arrays):
                want = rep.expected(weights, rank)
                assert sorted(arrays) == sorted(want), rep.label
                for name, w in want.items():
                    g = arrays[name]
                    where = f"v{version} {rep.label} tp{rep.tp} rank {rank} {name}"
                    assert g.shape == w.shape, f"{where}: shape {g.shape}, engine's {w.shape}"
                    assert g.dtype.itemsize == w.dtype.itemsize, f"{where}: {g.dtype}, engine's {w.dtype}"
                    diff = np.flatnonzero(g.view(np.uint8) != np.ascontiguousarray(w).view(np.uint8))
                    assert diff.size == 0, f"{where}: {diff.size} bytes differ, first at {diff[:5]}"
