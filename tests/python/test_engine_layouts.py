"""Engine layouts: replicas whose ranks name vLLM's or SGLang's layout get every quantized parameter
under the engine's names and shapes, filled with the engine's arithmetic, bit for bit against the
independent references of engine_reference.py, at TP 1, 2 and 4, over real sockets. One trainer
updates every (layout, scheme) replica at once; the ranks wrap numpy arrays, so a reallocation
would leave them unchanged and fail the comparison (engine_cluster.py). Stacked experts:
test_engine_layouts_moe.py; gptq_int4: test_engine_layouts_gptq.py."""

import threading

import numpy as np
import pytest

import engine_reference
import ferry
import reference
from engine_cluster import TIMEOUT_MS, Replica, normal_weights, serve_replicas, updates_land_bit_exact

CONFIG = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=384, vocab_size=300, num_layers=2,
              dtype="f32", vocab_pad_multiple=64)
REF_CONFIG = dict(hidden=256, heads=4, kv_heads=2, inter=384, vocab=300, layers=2, pad=64)
COMBOS = [("vllm", "fp8_per_tensor"), ("vllm", "fp8_per_channel"), ("vllm", "fp8_block"), ("vllm", "int8_per_channel"),
          ("sglang", "fp8_per_channel"), ("sglang", "fp8_block"), ("sglang", "int8_per_channel")]
# Marlin's int4 (both engines): dimensions it tiles at TP 1 and 2 (outputs a multiple of 64, inputs
# of 128); o_proj at TP 2 has one group, which takes Marlin's single-group scale permutation.
INT4_CONFIG = dict(CONFIG, intermediate_size=512)
INT4_REF_CONFIG = dict(REF_CONFIG, inter=512)
INT4_COMBOS = [("vllm", "int4_group"), ("sglang", "int4_group")]
# TP 4, every scheme: 4 kv heads (one per rank), and a hidden and intermediate size of 512, so that
# o_proj and down_proj keep 128 inputs per rank (one Marlin group, one fp8 block column) and the
# fused qkv 256 outputs.
TP4_CONFIG = dict(CONFIG, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=512)
TP4_REF_CONFIG = dict(REF_CONFIG, hidden=512, heads=8, kv_heads=4, inter=512)
# tp -> (ferry config, reference config), for COMBOS and for INT4_COMBOS.
SIZES = {1: (CONFIG, REF_CONFIG), 2: (CONFIG, REF_CONFIG), 4: (TP4_CONFIG, TP4_REF_CONFIG)}
INT4_SIZES = {1: (INT4_CONFIG, INT4_REF_CONFIG), 2: (INT4_CONFIG, INT4_REF_CONFIG), 4: (TP4_CONFIG, TP4_REF_CONFIG)}


def config(cfg=None):
    return ferry.LlamaConfig(**(cfg or CONFIG))


def llama_replica(tp, layout, scheme, cfg, ref_cfg):
    """A maker of one Llama replica under (layout, scheme), its expectations from the references."""

    def expected(weights, rank):
        out = {}
        for name, (x, _shards, quantized) in reference.llama_rank_params(ref_cfg, weights, rank, tp).items():
            if not quantized:
                out[name] = reference.bf16_bits(x)
                continue
            base = name[:-len("weight")]
            for suffix, array in engine_reference.engine_storage(layout, scheme, x).items():
                out[base + suffix] = array
        return out

    def make(address, replica):
        specs = [ferry.llama_rank_spec(config(cfg), r, tp, scheme, replica=replica, layout=layout) for r in range(tp)]
        assert all(s.layout == layout for s in specs)
        return Replica(address, specs, expected, f"{layout} {scheme}")

    return make


def serve_combos(tp, combos, sizes):
    cfg, ref_cfg = sizes[tp]
    for trainer, replicas in serve_replicas([llama_replica(tp, lay, sch, cfg, ref_cfg) for lay, sch in combos]):
        yield trainer, replicas, cfg


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["tp1", "tp2", "tp4"])
def cluster(request):
    yield from serve_combos(request.param, COMBOS, SIZES)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["tp1", "tp2", "tp4"])
def int4_cluster(request):
    yield from serve_combos(request.param, INT4_COMBOS, INT4_SIZES)


def make_weights(manifest, seed):
    weights = normal_weights(manifest, seed)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    q[0, :] = 0.0  # a zero row: a zero per-channel scale (SGLang multiplies by 0, vLLM floors the scale)
    q[1, :4] = [1e-6, -2e-5, 0.0, -0.0]
    q[2, :] *= 1e4  # one row far above the rest: per-tensor codes of the others go subnormal
    weights["model.layers.1.self_attn.o_proj.weight"][:] = 0.0  # a zero tensor: vLLM's scale 0, codes 448
    weights["model.layers.0.self_attn.k_proj.weight"][:, :128] = 0.0  # zero blocks: amax floored at 1e-4
    return weights


def test_every_layout_and_scheme_lands_bit_exact(cluster):
    trainer, replicas, cfg = cluster
    updates_land_bit_exact(trainer, replicas, ferry.llama_manifest(config(cfg)), make_weights)


def test_int4_lands_in_marlins_layout_bit_exact(int4_cluster):
    trainer, replicas, cfg = int4_cluster
    updates_land_bit_exact(trainer, replicas, ferry.llama_manifest(config(cfg)), make_weights)


def test_engine_names_and_shapes():
    spec = ferry.llama_rank_spec(config(), 0, 2, "fp8_block", layout="vllm")
    names = {t.name: (t.dtype, list(t.shape)) for t in ferry.storage_tensors(spec)}
    assert names["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ("f32", [2, 2])
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" not in names
    spec = ferry.llama_rank_spec(config(), 0, 2, "fp8_per_tensor", layout="vllm")
    names = {t.name: (t.dtype, list(t.shape)) for t in ferry.storage_tensors(spec)}
    assert names["model.layers.0.self_attn.qkv_proj.weight_scale"] == ("f32", [1])  # one for q, k and v
    spec = ferry.llama_rank_spec(config(), 0, 2, "fp8_per_tensor")
    names = {t.name: (t.dtype, list(t.shape)) for t in ferry.storage_tensors(spec)}
    assert names["model.layers.0.self_attn.qkv_proj.weight_scale"] == ("f32", [3])  # ferry's: one per shard
    spec = ferry.llama_rank_spec(config(), 1, 2, "fp8_per_channel", layout="sglang")
    names = {t.name: (t.dtype, list(t.shape)) for t in ferry.storage_tensors(spec)}
    assert names["model.layers.1.mlp.gate_up_proj.weight_scale"] == ("f32", [1, 384])


def test_layouts_an_engine_does_not_define_are_refused_naming_the_parameter():
    with pytest.raises(ferry.Error) as e:
        ferry.llama_rank_spec(config(), 0, 1, "fp8_per_tensor", layout="sglang")
    assert "model.layers.0.self_attn.qkv_proj.weight" in str(e.value)
    assert "per channel" in str(e.value)
    # 16 heads of 16 and one kv head: a fused qkv of 288 rows, which Marlin's 64-output tiles do not divide.
    narrow_heads = dict(CONFIG, num_heads=16, num_kv_heads=1)
    ferry.llama_rank_spec(config(narrow_heads), 0, 1, "int4_group")  # ferry's own layout takes it
    with pytest.raises(ferry.Error) as e:
        ferry.llama_rank_spec(config(narrow_heads), 0, 1, "int4_group", layout="vllm")
    assert "model.layers.0.self_attn.qkv_proj.weight" in str(e.value)
    assert "Marlin" in str(e.value) and "multiple of 64" in str(e.value)
    with pytest.raises(ferry.Error) as e:
        ferry.llama_rank_spec(config(), 0, 1, "none", layout="trtllm")
    assert "'trtllm'" in str(e.value) and "vllm" in str(e.value)
    spec = ferry.llama_rank_spec(config(), 0, 1, "fp8_per_tensor")
    with pytest.raises(ferry.Error):
        spec.layout = "sglang"
    assert spec.layout == "ferry"  # a refused layout leaves the spec as it was


class _EngineModule:
    """Parameters by name, as a torch module's named_parameters() gives them."""

    def __init__(self, params):
        self.params = params

    def named_buffers(self):
        return iter(())

    def named_parameters(self):
        return iter(self.params.items())


def test_a_vllm_style_module_is_updated_through_its_transposed_weights():
    """vLLM keeps a quantized weight as qweight.t(), a transposed view of the [N, K] buffer its
    kernels read; wrap_module takes such a view through its transpose and ferry writes in place."""
    torch = pytest.importorskip("torch")
    dtypes = {"bf16": torch.bfloat16, "f8_e4m3fn": torch.float8_e4m3fn, "f32": torch.float32}
    spec = ferry.llama_rank_spec(config(), 0, 1, "fp8_per_tensor", layout="vllm")
    buffers, params = {}, {}
    for t in ferry.storage_tensors(spec):
        buffers[t.name] = torch.zeros(t.shape, dtype=dtypes[t.dtype])
        view = buffers[t.name].t() if t.dtype == "f8_e4m3fn" else buffers[t.name]
        params[t.name] = torch.nn.Parameter(view, requires_grad=False)
    assert not params["model.layers.0.self_attn.qkv_proj.weight"].is_contiguous()
    storage = ferry.wrap_module(spec, _EngineModule(params))
    manifest = ferry.llama_manifest(config())
    weights = make_weights(manifest, seed=3)
    with ferry.Trainer() as trainer:
        with ferry.RolloutWorker(spec, storage, coordinator=trainer.coordinator_address) as worker:
            thread = threading.Thread(target=worker.serve, daemon=True)
            thread.start()
            trainer.wait_for_ranks(1, timeout_ms=TIMEOUT_MS)
            trainer.start_weight_update(1, manifest)
            trainer.update_weights(weights)
            assert trainer.finish_weight_update().moved == 0
    thread.join(timeout=TIMEOUT_MS / 1000)
    qkv = "model.layers.0.self_attn.qkv_proj."
    x, _, _ = reference.llama_rank_params(REF_CONFIG, weights, 0, 1)[qkv + "weight"]
    want = engine_reference.vllm_fp8_per_tensor(x)
    got = params[qkv + "weight"].t().contiguous().view(torch.uint8).numpy()
    assert np.array_equal(got, want["weight"])
    assert np.array_equal(params[qkv + "weight_scale"].numpy(), want["weight_scale"])


def test_vllm_refuses_an_int4_layer_with_a_bias_that_it_would_permute():
    # Qwen2's qkv has a bias; vLLM's Marlin kernel permutes it, SGLang's reads it as it is.
    qwen2 = ferry.describe_model(ferry.parse_hf_config(
        '{"model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"intermediate_size": 512, "vocab_size": 320, "num_hidden_layers": 1, "torch_dtype": "bfloat16"}'))
    spec = qwen2.rank_spec(0, 1, "int4_group", layout="sglang")
    assert "model.layers.0.self_attn.qkv_proj.bias" in [p.name for p in spec.params]
    for scheme in ("int4_group", "gptq_int4"):
        with pytest.raises(ferry.Error) as e:
            qwen2.rank_spec(0, 1, scheme, layout="vllm")
        assert "model.layers.0.self_attn.qkv_proj.bias" in str(e.value) and "marlin_permute_bias" in str(e.value)
