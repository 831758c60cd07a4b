"""gptq_int4 under the vllm and sglang layouts: an act-order GPTQ checkpoint (qweight, scales, g_idx;
qzeros unread) as GPTQMarlinLinearMethod keeps it after loading (engine_reference.gptq_marlin).

ferry's Python API has no way to hand a rank a GPTQ checkpoint: a trainer's manifest carries the
full-precision weights a gptq_int4 spec lists as its sources, and its pieces land on the qweight input
(the checkpoint loader that feeds qweight, scales and g_idx is C++ only: reload/checkpoint_loader.h).
So the bytes are not compared here (the C++ tests compare them: tests/kernels/gptq_marlin_test.cc);
what is checked is every name, dtype and shape ferry registers against the engine's, and that an
update from a trainer is refused at its start."""

import numpy as np
import pytest

import engine_reference
import ferry
from engine_cluster import Replica, serve_replicas

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


@pytest.mark.xfail(strict=True, reason=(
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
