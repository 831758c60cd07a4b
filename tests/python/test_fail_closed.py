"""Fail closed from Python: a raising resume hook fails the update and reaches the trainer; an open
update can be aborted; enumerated options are checked; f32 storage wrapped from numpy is updated as
f32. Trainer and a TP-2 replica in one process, over real sockets."""

import numpy as np
import pytest

import ferry

CFG = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128, num_layers=1)


def manifest_and_weights(seed):
    cfg = ferry.LlamaConfig(**CFG)
    manifest = ferry.llama_manifest(cfg)
    rng = np.random.default_rng(seed)
    weights = {}
    for t in manifest:
        f = rng.normal(0, 0.1, size=tuple(t.shape)).astype(np.float32)
        weights[t.name] = (f.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits, truncated
    return manifest, {name: ferry.view_as(w, "bf16") for name, w in weights.items()}, weights


class Replica:
    """A trainer and the two ranks of one replica; rank 1's resume hook raises while `fail` is set."""

    def __init__(self, scheme="fp8_per_tensor", none_dtype="bf16"):
        self.trainer = ferry.Trainer()
        self.fail = False
        self.arrays, self.workers = [], []
        cfg = ferry.LlamaConfig(**CFG)
        for rank in range(2):
            spec = ferry.llama_rank_spec(cfg, rank, 2, scheme)
            np_dtype = {"f32": np.float32, "bf16": np.uint16, "f8_e4m3fn": np.uint8}
            arrays = {t.name: np.zeros(t.shape, np_dtype[t.dtype])
                      for t in ferry.storage_tensors(spec, none_dtype=none_dtype)}
            storage = ferry.ModelStorage.wrap(spec, {n: ferry.view_as(a, t.dtype) for (n, a), t in
                                                     zip(arrays.items(), ferry.storage_tensors(spec, none_dtype=none_dtype))},
                                              none_dtype=none_dtype)
            self.arrays.append(arrays)
            self.workers.append(ferry.RolloutWorker(spec, storage, resume=self.hook(rank),
                                                    coordinator=self.trainer.coordinator_address))
        self.trainer.wait_for_ranks(2, 20000)

    def hook(self, rank):
        def resume(version):
            if rank == 1 and self.fail:
                raise RuntimeError("the engine's scheduler did not restart")
        return resume

    def update(self, version, **options):
        manifest, views, _ = manifest_and_weights(version)
        self.trainer.start_weight_update(version, manifest, **options)
        self.trainer.update_weights(views)
        return self.trainer.finish_weight_update()

    def close(self):
        for w in self.workers:
            w.close()
        self.trainer.close()


@pytest.fixture
def replica():
    r = Replica()
    yield r
    r.close()


def test_resume_hook_exception_fails_the_update_and_names_the_rank(replica):
    replica.update(1)
    replica.fail = True
    with pytest.raises(ferry.Error) as e:
        replica.update(2)
    assert "replica 0 rank 1" in str(e.value)
    assert "the engine's scheduler did not restart" in str(e.value)
    rank1 = replica.workers[1]
    assert rank1.weight_version == 2 and rank1.consistent and rank1.paused
    assert not replica.workers[0].paused
    with pytest.raises(ferry.Error):
        rank1.resume()  # still failing
    replica.fail = False
    rank1.resume()
    assert not rank1.paused
    assert replica.update(3).version == 3


def test_abort_weight_update_ends_an_open_update(replica):
    manifest, views, _ = manifest_and_weights(1)
    replica.trainer.start_weight_update(1, manifest)
    with pytest.raises(ferry.Error):
        replica.trainer.send(manifest[0].name, np.zeros(3, np.float32))  # wrong shape and dtype
    replica.trainer.abort_weight_update("bad tensor from the optimizer")
    with pytest.raises(ferry.Error):
        replica.trainer.abort_weight_update()  # nothing open any more
    assert all(not w.consistent and w.paused for w in replica.workers)
    assert replica.update(2).version == 2
    assert all(w.consistent and not w.paused for w in replica.workers)


def test_unknown_pause_mode_is_refused(replica):
    with pytest.raises(ferry.Error, match="pause mode 'bogus' is not one of abort, wait, keep"):
        replica.update(1, pause_mode="bogus")
    assert replica.update(1).version == 1


def test_f32_storage_wrapped_from_numpy_is_updated_as_f32():
    r = Replica(scheme="none", none_dtype="f32")
    try:
        report = r.update(1)
        assert report.moved == 0
        _, _, bits = manifest_and_weights(1)
        # An independent reference: bf16 bits widened to f32 (exact), then TP-sharded by rows or columns.
        norm = (bits["model.norm.weight"].astype(np.uint32) << 16).view(np.float32)
        for arrays in r.arrays:
            assert arrays["model.norm.weight"].dtype == np.float32
            np.testing.assert_array_equal(arrays["model.norm.weight"], norm)
        down = (bits["model.layers.0.mlp.down_proj.weight"].astype(np.uint32) << 16).view(np.float32)
        half = down.shape[1] // 2
        for rank, arrays in enumerate(r.arrays):
            np.testing.assert_array_equal(arrays["model.layers.0.mlp.down_proj.weight"],
                                          down[:, rank * half:(rank + 1) * half])
    finally:
        r.close()
