"""A trainer (this process) and a TP-2 replica of two rollout processes, over real sockets. Every
rank's storage is compared bit for bit with an independent numpy reference of fp8_per_tensor."""

import numpy as np
import pytest

import children
import ferry
import reference

CONFIG = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=200, num_layers=2,
              dtype="f32", vocab_pad_multiple=64)
REF_CONFIG = dict(hidden=64, heads=4, kv_heads=2, inter=128, vocab=200, layers=2, pad=64)
TP = 2
TIMEOUT_S = 120


def Rank(address, rank, out, *extra):  # noqa: N802 (a rank process of the replica)
    return children.rollout_rank(address, rank, TP, CONFIG, out, TIMEOUT_S, *extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    trainer = ferry.Trainer()
    ranks = [Rank(trainer.coordinator_address, r, out) for r in range(TP)]
    try:
        for r in ranks:
            r.expect("ready")
        trainer.wait_for_ranks(TP, timeout_ms=TIMEOUT_S * 1000)
        yield trainer, ranks, out
    finally:
        trainer.close()
        for r in ranks:
            r.wait()


def make_weights(manifest, seed):
    rng = np.random.default_rng(seed)
    weights = {}
    for t in manifest:
        x = rng.standard_normal(t.shape).astype(np.float32)
        if "layernorm" in t.name or "norm." in t.name:
            x = 1.0 + 0.1 * x
        weights[t.name] = x
    # Exercise the edges of the encoding: a tie, a subnormal, negative zero, the saturation point.
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    q[0, :4] = [0.0, -0.0, 1e-6, -2e-5]
    return weights


def check_rank_storage(out, version, rank, weights):
    want = reference.expected_storage(REF_CONFIG, weights, rank, TP)
    children.check_saved_storage(out / f"v{version}_rank{rank}.npz", want, f"v{version} rank {rank}")


def test_updates_land_bit_exact(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    registered = sum(len(ferry.storage_tensors(ferry.llama_rank_spec(ferry.LlamaConfig(**CONFIG), r, TP,
                                                                     "fp8_per_tensor"), none_dtype="f32"))
                     for r in range(TP))
    for version in (1, 2, 3):
        weights = make_weights(manifest, seed=version)
        mode = "wait" if version == 2 else "abort"
        trainer.start_weight_update(version, manifest, pause_mode=mode)
        if version == 1:
            trainer.update_weights(weights)  # a mapping: pulled in plan order
        elif version == 2:
            trainer.update_weights(reversed(list(weights.items())))  # pairs, as they come
        else:
            for name, tensor in weights.items():
                trainer.send(name, tensor)
        report = trainer.finish_weight_update()
        assert report.version == version
        assert report.ranks == TP
        assert report.moved == 0
        assert report.registered == registered
        assert report.bytes >= sum(w.nbytes for w in weights.values())
        assert report.seconds > 0 and report.gbps > 0
        assert report.as_dict()["moved"] == 0
        for r, rank in enumerate(ranks):
            rank.expect("paused", version, mode, True)
            rank.expect("resumed", version)
            check_rank_storage(out, version, r, weights)


def test_bad_manifest_fails_before_a_byte_moves(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    bad = [(t.name, t.dtype, [t.shape[0] + 1] + t.shape[1:]) if t.name == "model.norm.weight" else t for t in manifest]
    with pytest.raises(ferry.Error) as e:
        trainer.start_weight_update(10, bad)
    assert e.value.code == "InvalidArgument"
    assert "model.norm.weight" in e.value.message
    # No pause reached the ranks: a rank prints its events in order, so after a good update the
    # first line of each is that update's pause, not one for version 10 (an empty queue would
    # prove nothing about a line still on its way).
    weights = make_weights(manifest, seed=4)
    trainer.start_weight_update(4, manifest, pause_mode="abort")
    trainer.update_weights(weights)
    assert trainer.finish_weight_update().version == 4
    for r, rank in enumerate(ranks):
        rank.expect("paused", 4, "abort", True)
        rank.expect("resumed", 4)
        check_rank_storage(out, 4, r, weights)


def wait_resumed(rank, version):
    """Skips the lines of failed updates up to the resume at `version`."""
    while True:
        words = rank.lines.get(timeout=TIMEOUT_S)
        assert words[0] != "eof"
        if words == ["resumed", str(version)]:
            return


def test_send_errors_abort_the_update_and_the_next_one_lands(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    weights = make_weights(manifest, seed=5)
    with pytest.raises(ferry.Error) as e:
        trainer.send("model.norm.weight", [1.0, 2.0])  # not a tensor: refused before ferry sees it
    assert e.value.code == "InvalidArgument"

    trainer.start_weight_update(5, manifest)
    with pytest.raises(ferry.Error) as e:
        trainer.send("model.norm.weight", weights["model.norm.weight"][:-1])
    assert e.value.code == "InvalidArgument" and "model.norm.weight" in e.value.message
    with pytest.raises(ferry.Error):
        trainer.finish_weight_update()

    trainer.start_weight_update(6, manifest)
    with pytest.raises(ferry.Error) as e:
        trainer.update_weights({})  # a mapping without the plan's tensors
    assert e.value.code == "NotFound"
    with pytest.raises(ferry.Error):
        trainer.finish_weight_update()

    trainer.start_weight_update(7, manifest)
    trainer.update_weights(weights)
    assert trainer.finish_weight_update().version == 7
    for r, rank in enumerate(ranks):
        wait_resumed(rank, 7)
        check_rank_storage(out, 7, r, weights)


def test_pause_hook_exception_fails_the_update_and_the_next_one_lands(cluster):
    trainer, ranks, out = cluster
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    with pytest.raises(ferry.Error) as e:
        trainer.start_weight_update(99, manifest)
        trainer.update_weights(make_weights(manifest, seed=99))
        trainer.finish_weight_update()
    assert "engine refuses version 99" in str(e.value)
    weights = make_weights(manifest, seed=100)
    trainer.start_weight_update(100, manifest)
    trainer.update_weights(weights)
    report = trainer.finish_weight_update()
    assert report.version == 100 and report.moved == 0
    for r, rank in enumerate(ranks):
        wait_resumed(rank, 100)
        check_rank_storage(out, 100, r, weights)
