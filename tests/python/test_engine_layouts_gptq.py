"""gptq_int4 under the vllm and sglang layouts: an act-order GPTQ checkpoint (qweight, scales, g_idx;
qzeros unread) as GPTQMarlinLinearMethod keeps it after loading (engine_reference.gptq_marlin).

A gptq_int4 rank loads a GPTQ checkpoint (ferry.load_checkpoint; a trainer cannot feed it, and is
refused at its start). Checked: every name, dtype and shape ferry registers against the engine's,
and every byte a loaded checkpoint leaves in them, at TP 1, 2 and 4."""

import numpy as np
import pytest

import engine_reference
import ferry
from engine_cluster import NUMPY_DTYPES, Replica, serve_replicas

LAYOUTS = ["vllm", "sglang"]
# Llama shapes Marlin tiles at TP 1, 2 and 4 (f32 sources; the scales take the storage's bf16).
CONFIG = dict(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=512, vocab_size=300, num_layers=1,
              dtype="f32", vocab_pad_multiple=64)
FERRY_DTYPES = {np.dtype(np.int32): "i32", np.dtype(np.uint16): "bf16"}


def linear_layers(tp):
    """{engine parameter: (N of the rank, K of the rank, K unsharded)} of layer 0, from the config."""
    h, hd, inter = CONFIG["hidden_size"], CONFIG["hidden_size"] // CONFIG["num_heads"], CONFIG["intermediate_size"]
    p = "model.layers.0."
    return {p + "self_attn.qkv_proj.weight": ((CONFIG["num_heads"] + 2 * CONFIG["num_kv_heads"]) // tp * hd, h, h),
            p + "self_attn.o_proj.weight": (h, h // tp, h),
            p + "mlp.gate_up_proj.weight": (2 * inter // tp, h, h),
            p + "mlp.down_proj.weight": (h, inter // tp, inter)}


def engine_storage(n, k, k_total, rank, tp, seed=0):
    """{suffix: (ferry dtype, shape)} of the engine's parameters after loading a checkpoint of the
    shapes GPTQMarlinLinearMethod.create_weights gives with desc_act (scales [k_total / 128, n] on
    every rank: marlin_repeat_scales_on_all_ranks), through the reference."""
    rng = np.random.default_rng(seed)
    qweight = rng.integers(-2**31, 2**31, size=(k // 8, n), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(0.004, 0.02, size=(k_total // 128, n)).astype(np.float16)
    g_idx = rng.permutation(np.arange(k_total) // 128).astype(np.int32)  # act order over the unsharded input
    row0 = rank * k if k != k_total else 0
    out = engine_reference.gptq_marlin(qweight, scales, g_idx[row0:row0 + k], size_k=k)
    return {suffix: (FERRY_DTYPES[a.dtype], list(a.shape)) for suffix, a in out.items()}


def ferry_storage(spec, param):
    return {t.suffix: (t.dtype, list(t.shape)) for t in ferry.storage_tensors(spec) if t.param == param}


def cases(row_parallel):
    out = []
    for layout in LAYOUTS:
        for tp in (1, 2, 4):
            for name, (n, k, k_total) in linear_layers(tp).items():
                if (k != k_total) == row_parallel:
                    out.append(pytest.param(layout, tp, name, id=f"{layout}-tp{tp}-{name.split('.')[-2]}"))
    return out


@pytest.mark.parametrize("layout,tp,name", cases(row_parallel=False))
def test_gptq_int4_storage_is_the_engines(layout, tp, name):
    n, k, k_total = linear_layers(tp)[name]
    for rank in range(tp):
        spec = ferry.llama_rank_spec(ferry.LlamaConfig(**CONFIG), rank, tp, "gptq_int4", layout=layout)
        assert ferry_storage(spec, name) == engine_storage(n, k, k_total, rank, tp)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "not supported: ferry's vllm/sglang gptq_int4 layout keeps scales [K_rank/128, N] on a row-parallel "
    "rank (the engines' layout without act order) and refuses a rank's g_idx whose groups do not hold 128 "
    "of its rows; with act order both engines' GPTQMarlinLinearMethod keep [K/128, N] of the unsharded K "
    "on every rank (marlin_repeat_scales_on_all_ranks), the rank's g_idx holding global groups"))
@pytest.mark.parametrize("layout,tp,name", cases(row_parallel=True))
def test_gptq_int4_row_parallel_storage_is_the_engines(layout, tp, name):
    n, k, k_total = linear_layers(tp)[name]
    spec = ferry.llama_rank_spec(ferry.LlamaConfig(**CONFIG), 0, tp, "gptq_int4", layout=layout)
    assert ferry_storage(spec, name) == engine_storage(n, k, k_total, 0, tp)


def test_gptq_marlin_reference_repacks_the_sorted_codes():
    """The reference against a hand-made case: codes equal to their input row's group, so that
    sorting g_idx must leave the Marlin tiles of sorted codes (group g in rows 128g..128g+127)."""
    k, n = 256, 64
    g_idx = np.arange(k, dtype=np.int32) % 2  # groups interleaved: rows 0, 2, 4, ... are group 0
    codes = np.repeat(g_idx[:, None] + 3, n, axis=1).astype(np.uint32)
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for j in range(8):
        qweight |= codes[j::8] << np.uint32(4 * j)
    out = engine_reference.gptq_marlin(qweight.view(np.int32), np.ones((2, n), np.float16), g_idx, size_k=k)
    assert np.array_equal(out["g_idx"], np.repeat([0, 1], 128))
    assert np.array_equal(out["g_idx_sort_indices"], np.concatenate([np.arange(0, k, 2), np.arange(1, k, 2)]))
    want = engine_reference.marlin_weights(np.repeat(np.repeat([[3], [4]], 128, axis=0), n, axis=1).astype(np.uint32))
    assert np.array_equal(out["qweight"], want)
    assert np.all(out["scales"] == 0x3F80)  # bf16 1.0


def test_a_trainer_cannot_feed_a_gptq_rank_and_is_refused_before_anything_pauses():
    """gptq_int4 loads a GPTQ checkpoint (reload/checkpoint_loader.h); a trainer's full-precision
    tensors would land on its packed codes. The update is refused at start, naming the checkpoint
    tensor and the scheme to use instead: the coordinator's check of the manifest against the ranks,
    made before it pauses anything (sharding::check_manifest)."""
    cfg = ferry.LlamaConfig(**dict(CONFIG, num_layers=1))

    def make(address, replica):
        spec = ferry.llama_rank_spec(cfg, 0, 1, "gptq_int4", replica=replica, layout="vllm")
        return Replica(address, [spec], None, "vllm gptq_int4")

    manifest = ferry.llama_manifest(cfg)
    for trainer, _ in serve_replicas([make]):
        with pytest.raises(ferry.Error) as e:
            trainer.start_weight_update(1, manifest)
        assert "model.layers.0.self_attn.q_proj.weight" in str(e.value)
        assert "GPTQ checkpoint" in str(e.value) and "int4_group" in str(e.value)


def gptq_checkpoint(spec, tp, manifest, rng):
    """A rank's checkpoint for ferry.load_checkpoint: the manifest's full-precision tensors for the
    parameters kept unquantized, and for every gptq_int4 parameter a GPTQ checkpoint of the rank's
    [N, K] (qweight, scales f16, g_idx) under the parameter's name with their suffixes. Act order (a
    permutation of the groups' rows) where the rank's K is the whole input; without it on a
    row-parallel shard at TP > 1, the only case of those the engines share with ferry (see above).
    Returns (checkpoint, {parameter: (qweight, scales, g_idx)})."""
    checkpoint = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in manifest}
    gptq = {}
    for p in spec.params:
        if p.scheme != "gptq_int4":
            continue
        n, k = p.shape
        row_parallel = "o_proj" in p.name or "down_proj" in p.name
        qweight = rng.integers(-2**31, 2**31, size=(k // 8, n), dtype=np.int64).astype(np.int32)
        scales = rng.uniform(0.004, 0.02, size=(k // 128, n)).astype(np.float16)
        groups = np.arange(k, dtype=np.int32) // 128
        g_idx = groups if row_parallel and tp > 1 else rng.permutation(groups).astype(np.int32)
        base = p.name[:-len("weight")]
        checkpoint.update({base + "qweight": qweight, base + "scales": scales, base + "g_idx": g_idx})
        gptq[p.name] = (qweight, scales, g_idx)
    return checkpoint, gptq


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_gptq_checkpoint_loads_as_the_engines_bit_exact(layout, tp):
    """Every rank loads its GPTQ checkpoint (ferry.load_checkpoint, into numpy arrays it wraps): every
    byte of qweight, scales, g_idx and g_idx_sort_indices of every gptq_int4 parameter equals
    engine_reference.gptq_marlin of the same checkpoint, and no registered tensor moved. (Without
    act order, on row-parallel shards at TP > 1, the engines keep g_idx and its sort indices empty;
    ferry writes the groups and the identity there, and qweight and scales are the engines'.)"""
    cfg = ferry.LlamaConfig(**CONFIG)
    manifest = ferry.llama_manifest(cfg)
    rng = np.random.default_rng(7 + tp)
    for rank in range(tp):
        spec = ferry.llama_rank_spec(cfg, rank, tp, "gptq_int4", layout=layout)
        tensors = ferry.storage_tensors(spec)
        arrays = {t.name: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for t in tensors}
        storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(arrays[t.name], t.dtype) for t in tensors})
        checkpoint, gptq = gptq_checkpoint(spec, tp, manifest, rng)
        report = ferry.load_checkpoint(spec, storage, checkpoint)
        assert report["moved"] == 0 and report["registered"] == len(tensors)
        assert gptq, "the spec has gptq_int4 parameters"
        for name, (qweight, scales, g_idx) in gptq.items():
            want = engine_reference.gptq_marlin(qweight, scales, g_idx, size_k=g_idx.size)
            base = name[:-len("weight")]
            for suffix, w in want.items():
                got = arrays[base + suffix]
                where = f"{layout} tp{tp} rank {rank} {base + suffix}"
                assert got.shape == w.shape, f"{where}: shape {got.shape}, engine's {w.shape}"
                diff = np.flatnonzero(got.view(np.uint8) != np.ascontiguousarray(w).view(np.uint8))
                assert diff.size == 0, f"{where}: {diff.size} bytes differ, first at {diff[:5]}"


def test_an_act_order_checkpoint_of_a_row_parallel_shard_is_refused_when_it_loads():
    """Act order on a row-parallel layer at TP > 1 is not supported: the rank's g_idx holds global
    groups, which do not each hold 128 of its rows. The load fails with ferry.Error naming g_idx."""
    cfg = ferry.LlamaConfig(**CONFIG)
    manifest = ferry.llama_manifest(cfg)
    rng = np.random.default_rng(3)
    spec = ferry.llama_rank_spec(cfg, 0, 2, "gptq_int4", layout="vllm")
    storage = ferry.ModelStorage.allocate(spec)
    checkpoint, _ = gptq_checkpoint(spec, 2, manifest, rng)
    o_proj = "model.layers.0.self_attn.o_proj."
    k = checkpoint[o_proj + "g_idx"].size
    # The rank's half of an act-order g_idx over the whole input: global groups, 128 rows each overall.
    checkpoint[o_proj + "g_idx"] = rng.permutation(np.arange(2 * k, dtype=np.int32) // 128)[:k].astype(np.int32)
    with pytest.raises(ferry.Error) as e:
        ferry.load_checkpoint(spec, storage, checkpoint)
    assert "g_idx" in str(e.value)


def test_a_load_writes_unquantized_parameters_in_the_storages_dtype():
    """Storage allocated with f16 for unquantized parameters (and Marlin's scales) takes them as f16,
    the checkpoint's f32 values rounded to nearest even, as numpy rounds them (the load uses the
    storage's dtype, as a RolloutWorker does; it used to assume bf16 and refuse)."""
    cfg = ferry.LlamaConfig(**CONFIG)
    spec = ferry.llama_rank_spec(cfg, 0, 1, "gptq_int4", layout="sglang")
    storage = ferry.ModelStorage.allocate(spec, "cpu", "f16")
    checkpoint, _ = gptq_checkpoint(spec, 1, ferry.llama_manifest(cfg), np.random.default_rng(4))
    assert ferry.load_checkpoint(spec, storage, checkpoint)["moved"] == 0
    norm = "model.layers.0.input_layernorm.weight"
    assert np.array_equal(np.from_dlpack(storage.get(norm)), checkpoint[norm].astype(np.float16))
