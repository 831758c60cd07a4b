"""The binding in one process: DLPack both ways without copies, storage wrapping, specs, errors."""

import ctypes
import gc
import weakref

import numpy as np
import pytest

import ferry

CFG = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128, num_layers=1,
           dtype="f32")


def spec(scheme="fp8_per_tensor", rank=0, tp=2, **cfg):
    return ferry.llama_rank_spec(ferry.LlamaConfig(**dict(CFG, **cfg)), rank, tp, scheme)


def writable(t):
    """A writable numpy view of a ferry.Tensor's bytes (numpy < 2 imports DLPack read-only)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * t.nbytes).from_address(t.data_ptr))


def engine_arrays(s, none_dtype="f32"):
    np_dtype = {"f32": np.float32, "f8_e4m3fn": np.uint8, "bf16": np.uint16, "i8": np.int8, "i4x2": np.uint8,
                "f16": np.float16}
    out = {}
    for t in ferry.storage_tensors(s, none_dtype=none_dtype):
        shape = list(t.shape)
        if t.dtype == "i4x2":
            shape[-1] //= 2
        out[t.name] = np.zeros(shape, np_dtype[t.dtype])
    return out


def test_allocated_storage_is_shared_with_numpy():
    storage = ferry.ModelStorage.allocate(spec(), "cpu", none_dtype="f32")
    views = storage.tensors()
    assert len(views) == len(storage) == len(ferry.storage_tensors(spec(), none_dtype="f32"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert views[name].dtype == "f8_e4m3fn"
    a = np.from_dlpack(views[name])  # f8 is exported as u8 of the same shape
    assert a.dtype == np.uint8 and list(a.shape) == list(views[name].shape)
    assert a.ctypes.data == views[name].data_ptr
    writable(views[name])[1 * 64 + 2] = 0x42
    b = np.from_dlpack(storage.get(name))
    assert a[1, 2] == 0x42 and b[1, 2] == 0x42 and b.ctypes.data == a.ctypes.data
    norm = np.from_dlpack(storage.get("model.norm.weight"))
    assert norm.dtype == np.float32 and norm.shape == (64,) and not norm.any()
    # The exported arrays keep the storage alive, and only they: once they go, it goes.
    alive = weakref.ref(storage)
    del storage, views
    gc.collect()
    assert alive() is not None
    assert np.from_dlpack(alive().get(name)).ctypes.data == a.ctypes.data
    del a, b, norm
    gc.collect()
    assert alive() is None


def test_bf16_storage_exports_raw_bytes():
    storage = ferry.ModelStorage.allocate(spec("none"), "cpu")
    t = storage.get("model.norm.weight")
    assert t.dtype == "bf16" and t.nbytes == 128
    raw = np.from_dlpack(t.raw())
    assert raw.dtype == np.uint8 and raw.shape == (128,) and raw.ctypes.data == t.data_ptr


def test_wrap_uses_the_engine_arrays():
    s = spec("int4_group", tp=1, hidden_size=128, intermediate_size=256)
    arrays = engine_arrays(s)
    addresses = {k: v.ctypes.data for k, v in arrays.items()}
    storage = ferry.ModelStorage.wrap(s, arrays, none_dtype="f32")
    assert "wrapped" in repr(storage)
    for name, t in storage.tensors().items():
        assert t.data_ptr == addresses[name], name
    packed = storage.get("model.layers.0.mlp.down_proj.weight")
    assert packed.dtype == "i4x2" and packed.shape == (128, 256)
    assert np.from_dlpack(packed).shape == (128, 128)


def test_wrapped_arrays_live_as_long_as_the_storage():
    s = spec()
    arrays = engine_arrays(s)
    alive = {name: weakref.ref(a) for name, a in arrays.items()}
    storage = ferry.ModelStorage.wrap(s, arrays, none_dtype="f32")
    del arrays  # the storage holds the only references now
    gc.collect()
    for name, t in storage.tensors().items():
        a = alive[name]()
        assert a is not None, name
        writable(t)[:] = 7  # written through ferry's view, read through the engine's array
        assert (a.view(np.uint8) == 7).all(), name
        del a
    del storage, t
    gc.collect()
    assert [name for name, ref in alive.items() if ref() is not None] == []


def test_wrap_errors_name_the_tensor():
    s = spec()
    arrays = engine_arrays(s)
    missing = dict(arrays)
    del missing["model.norm.weight"]
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, missing, none_dtype="f32")
    assert e.value.code == "NotFound" and "model.norm.weight" in e.value.message

    wrong = dict(arrays, **{"model.norm.weight": np.zeros(65, np.float32)})
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, wrong, none_dtype="f32")
    assert e.value.code == "InvalidArgument" and "model.norm.weight" in e.value.message

    wrong_dtype = dict(arrays, **{"model.norm.weight": np.zeros(64, np.float64)})
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, wrong_dtype, none_dtype="f32")
    assert e.value.code == "InvalidArgument"

    strided = dict(arrays, **{"model.norm.weight": np.zeros(128, np.float32)[::2]})
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, strided, none_dtype="f32")
    assert "contiguous" in e.value.message

    extra = dict(arrays, **{"rotary.inv_freq": np.zeros(8, np.float32)})
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, extra, none_dtype="f32")
    assert "rotary.inv_freq" in e.value.message
    assert len(ferry.ModelStorage.wrap(s, extra, none_dtype="f32", strict=False)) == len(arrays)

    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.wrap(s, dict(arrays, **{"model.norm.weight": object()}), none_dtype="f32")
    assert e.value.code == "InvalidArgument"


def test_errors_carry_the_code():
    assert issubclass(ferry.Error, RuntimeError)
    with pytest.raises(ferry.Error) as e:
        ferry.llama_rank_spec(ferry.LlamaConfig(**CFG), 0, 3, "fp8_per_tensor")
    assert e.value.code == "InvalidArgument"
    with pytest.raises(ferry.Error) as e:
        ferry.storage_tensors(spec("fp9"))
    assert e.value.code == "InvalidArgument"
    with pytest.raises(ferry.Error) as e:
        ferry.ModelStorage.allocate(spec(), "cpu").get("nope")
    assert e.value.code == "NotFound"
    with ferry.Trainer() as trainer:
        with pytest.raises(ferry.Error) as e:
            trainer.wait_for_ranks(1, timeout_ms=50)
        assert e.value.code == "DeadlineExceeded"
    with pytest.raises(ferry.Error) as e:
        trainer.wait_for_ranks(1)
    assert e.value.code == "FailedPrecondition"


def test_holdings_are_checked_before_an_update_starts():
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CFG))
    with ferry.Trainer(trainer_rank=0, trainer_ranks=1) as trainer:
        with pytest.raises(ValueError, match="pass None"):
            trainer.start_weight_update(1, manifest, holdings={})
        with pytest.raises(ValueError, match="model.norm.weight"):
            trainer.start_weight_update(1, manifest, holdings={"model.norm.weight": ([0], [1], [2])})
        with pytest.raises(ValueError, match="1 offsets for 2 sizes"):
            trainer.start_weight_update(1, manifest, holdings={"model.norm.weight": ([0], [1, 2])})
        with pytest.raises(TypeError, match="holdings"):
            trainer.start_weight_update(1, manifest, holdings=[("model.norm.weight", None)])
        # A manifest's own holdings (manifest_from_state_dict of DTensors) count as given.
        carried = ferry.Manifest(manifest)
        carried.holdings = {}
        with pytest.raises(ValueError, match="pass None"):
            trainer.start_weight_update(1, carried)


def test_view_as_relabels_without_a_copy():
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    t = ferry.view_as(bits, "bf16")
    assert t.dtype == "bf16" and t.shape == (2, 3) and t.data_ptr == bits.ctypes.data
    alive = weakref.ref(bits)
    del bits
    gc.collect()
    assert alive() is not None  # the view keeps the array, not just its address
    assert list(np.from_dlpack(t.raw()).view(np.uint16)) == list(range(6))
    del t
    gc.collect()
    assert alive() is None
    with pytest.raises(ferry.Error) as e:
        ferry.view_as(np.zeros(4, np.float32), "bf16")
    assert e.value.code == "InvalidArgument"
    assert ferry.view_as(np.zeros((2, 4), np.uint8), "i4x2").shape == (2, 8)


def test_specs_and_models():
    s = spec()
    assert (s.tp_rank, s.tp_size) == (0, 2)
    qkv = next(p for p in s.params if p.name.endswith("qkv_proj.weight"))
    assert qkv.shard_rows == [32, 16, 16] and qkv.scheme == "fp8_per_tensor" and qkv.shape == [64, 64]
    assert [sl.source for sl in qkv.slices] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CFG))
    s.validate(manifest)
    assert manifest[0] == ferry.SourceTensor("model.embed_tokens.weight", "float32", [128, 64])
    assert "fp8_block" in ferry.schemes()
    names = ferry.preset_names()
    assert names
    model = ferry.preset_model(names[0])
    assert model.manifest()
    hf = ferry.parse_hf_config('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, '
                               '"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128, '
                               '"num_hidden_layers": 1, "torch_dtype": "float32"}')
    assert hf.family == "llama"
    assert ferry.llama_manifest(ferry.to_llama_config(hf)) == manifest  # the same model as CFG
    assert len(ferry.describe_model(hf).rank_spec(1, 2, "fp8_block").params) == len(s.params)
