"""Engine layouts of stacked experts: a Qwen3-MoE-shaped model described from its config.json (layer 0
routed experts, layer 1 a dense MLP), one replica per (layout, scheme) ferry accepts for fused experts,
updated by one trainer at TP 1, 2 and 4 over real sockets. Every byte of every rank (experts, router,
attention, dense MLP) must match the numpy references of engine_reference.py, written from vLLM's and
SGLang's fused-MoE methods, laid out as reference.qwen3_moe_rank_params. The combinations an engine
does not define for fused experts are refused, naming the parameter."""

import json

import numpy as np
import pytest

import engine_reference
import ferry
import reference
from engine_cluster import Replica, normal_weights, serve_replicas, updates_land_bit_exact

# Sizes every scheme takes at TP 1 and 2 (SMALL) and at TP 4 (LARGE): Marlin's 64-output and
# 128-input tiles (w2, o_proj and down_proj keep 128 inputs per rank at the largest TP: one group,
# the single-group scale permutation), and fp8_block's rule that each half of w13 covers whole
# 128-row blocks. Layer 0 has routed experts, layer 1 a dense MLP (mlp_only_layers).
SMALL = dict(model_type="qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
             intermediate_size=256, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
             decoder_sparse_step=1, mlp_only_layers=[1], vocab_size=300, num_hidden_layers=2, torch_dtype="float32")
LARGE = dict(SMALL, hidden_size=512, num_attention_heads=8, intermediate_size=512, moe_intermediate_size=512)


def ref_config(hf):
    return dict(hidden=hf["hidden_size"], heads=hf["num_attention_heads"], kv_heads=hf["num_key_value_heads"],
                head_dim=hf["head_dim"], inter=hf["intermediate_size"], moe_inter=hf["moe_intermediate_size"],
                experts=hf["num_experts"], layers=hf["num_hidden_layers"], mlp_only=set(hf["mlp_only_layers"]),
                vocab=hf["vocab_size"], pad=64)


def describe(hf):
    return ferry.describe_model(ferry.parse_hf_config(json.dumps(hf)))


SIZES = {1: SMALL, 2: SMALL, 4: LARGE}
MODEL = describe(LARGE)
# (layout, scheme) of every replica: the experts' scheme, and the dense layers' where it differs.
# SGLang quantizes fused experts per tensor (Fp8MoEMethod) but dense layers per channel, which is
# what its online fp8 gives a bf16 checkpoint: that replica's dense layers take fp8_per_channel.
COMBOS = [("vllm", "none", None), ("vllm", "fp8_per_tensor", None), ("vllm", "fp8_block", None),
          ("vllm", "int4_group", None), ("sglang", "none", None), ("sglang", "fp8_per_tensor", "fp8_per_channel"),
          ("sglang", "fp8_block", None), ("sglang", "int8_per_channel", None), ("sglang", "int4_group", None)]
# What ferry refuses for fused experts, by design (docs/engines.md: "not defined here yet").
REFUSED = [("vllm", "fp8_per_channel"), ("vllm", "int8_per_channel"), ("sglang", "fp8_per_channel")]


def rank_spec(model, rank, tp, layout, scheme, dense_scheme=None, replica=0):
    if dense_scheme is None:
        return model.rank_spec(rank, tp, scheme, replica=replica, layout=layout)
    spec = model.rank_spec(rank, tp, dense_scheme, replica=replica)
    params = spec.params
    for p in params:
        if ".experts." in p.name:
            p.scheme = scheme
    spec.params = params
    spec.layout = layout
    return spec


def moe_replica(hf, model, tp, layout, scheme, dense_scheme, stacked):
    """A maker of one replica; expectations from reference.qwen3_moe_rank_params and the engine
    references (fused experts: stacked_engine_storage, one expert at a time)."""

    def expected(weights, rank):
        if stacked:
            weights = per_expert_weights(weights)
        out = {}
        for name, (x, _, quantized) in reference.qwen3_moe_rank_params(ref_config(hf), weights, rank, tp).items():
            base = name[:-len("weight")]
            if not quantized or scheme == "none":
                out[name] = reference.bf16_bits(x)
            elif x.ndim == 3:
                for suffix, array in engine_reference.stacked_engine_storage(layout, scheme, x,
                                                                             w13=name.endswith("w13_weight")).items():
                    out[base + suffix] = array
            else:
                for suffix, array in engine_reference.engine_storage(layout, dense_scheme or scheme, x).items():
                    out[base + suffix] = array
        return out

    def make(address, replica):
        specs = [rank_spec(model, r, tp, layout, scheme, dense_scheme, replica) for r in range(tp)]
        assert all(s.layout == layout for s in specs)
        return Replica(address, specs, expected, f"{layout} {scheme}" + (" stacked" if stacked else ""))

    return make


def per_expert_weights(weights):
    """The per-expert checkpoint of a trainer's fused experts (transformers' Qwen3MoeExperts:
    gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I])."""
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        p = name[:-len("gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(p + "down_proj")
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{p}{e}.gate_proj.weight"] = gate_up[e, :half]
            out[f"{p}{e}.up_proj.weight"] = gate_up[e, half:]
            out[f"{p}{e}.down_proj.weight"] = down[e]
    return out


def make_weights(manifest, seed):
    weights = normal_weights(manifest, seed)
    stacked = "model.layers.0.mlp.experts.gate_up_proj" in weights
    e = "model.layers.0.mlp.experts."
    i = weights[e + "down_proj"].shape[2] if stacked else weights[e + "0.down_proj.weight"].shape[1]

    def expert(j, proj):  # a view of one expert's matrix, per expert or fused
        if not stacked:
            return weights[f"{e}{j}.{proj}.weight"]
        if proj == "down_proj":
            return weights[e + "down_proj"][j]
        return weights[e + "gate_up_proj"][j, :i] if proj == "gate_proj" else weights[e + "gate_up_proj"][j, i:]

    expert(1, "gate_proj")[:] = 0.0  # expert 1's w13 all zero: per-tensor scale 0, every code +448
    expert(1, "up_proj")[:] = 0.0
    expert(0, "down_proj")[3, :] = 0.0  # a zero row: int8 scale 1, a zero int4 group
    expert(0, "gate_proj")[5, :4] = [1e-6, -2e-5, 0.0, -0.0]
    expert(2, "gate_proj")[7, :] *= 1e4  # one row far above the rest: the others' per-tensor codes go subnormal
    expert(3, "up_proj")[:, :128] = 0.0  # zero 128x128 blocks: amax floored at 1e-4
    return weights


# A trainer holding transformers' fused experts (gate_up_proj, down_proj) instead of one tensor per
# expert: a few of the replicas, at TP 2.
FUSED_TRAINER_COMBOS = [("vllm", "fp8_per_tensor", None), ("sglang", "fp8_block", None), ("vllm", "int4_group", None)]


@pytest.fixture(scope="module", params=[(1, False), (2, False), (4, False), (2, True)],
                ids=["tp1", "tp2", "tp4", "tp2-fused-trainer"])
def cluster(request):
    tp, stacked = request.param
    hf = SIZES[tp]
    model = describe(hf).stacked_experts() if stacked else describe(hf)
    combos = FUSED_TRAINER_COMBOS if stacked else COMBOS
    makers = [moe_replica(hf, model, tp, lay, sch, dense, stacked) for lay, sch, dense in combos]
    for trainer, replicas in serve_replicas(makers):
        yield trainer, replicas, model


def test_stacked_experts_land_in_every_engine_layout_bit_exact(cluster):
    trainer, replicas, model = cluster
    updates_land_bit_exact(trainer, replicas, model.manifest(), make_weights)


def test_stacked_expert_names_and_shapes():
    def names(spec):
        return {t.name[len("model.layers.0.mlp.experts."):]: (t.dtype, list(t.shape))
                for t in ferry.storage_tensors(spec) if t.name.startswith("model.layers.0.mlp.experts.")}

    # vLLM Fp8PerTensorOnlineMoEMethod: one scale per expert over the merged w13.
    assert names(MODEL.rank_spec(0, 2, "fp8_per_tensor", layout="vllm")) == {
        "w13_weight": ("f8_e4m3fn", [4, 512, 512]), "w13_weight_scale": ("f32", [4]),
        "w2_weight": ("f8_e4m3fn", [4, 512, 256]), "w2_weight_scale": ("f32", [4])}
    assert names(MODEL.rank_spec(0, 4, "fp8_block", layout="sglang")) == {
        "w13_weight": ("f8_e4m3fn", [4, 256, 512]), "w13_weight_scale_inv": ("f32", [4, 2, 4]),
        "w2_weight": ("f8_e4m3fn", [4, 512, 128]), "w2_weight_scale_inv": ("f32", [4, 4, 1])}
    assert names(MODEL.rank_spec(0, 2, "int8_per_channel", layout="sglang")) == {
        "w13_weight": ("i8", [4, 512, 512]), "w13_weight_scale": ("f32", [4, 512, 1]),
        "w2_weight": ("i8", [4, 512, 256]), "w2_weight_scale": ("f32", [4, 512, 1])}
    # Marlin MoE: [E, K/16, 2N] and [E, K/128, N].
    assert names(MODEL.rank_spec(0, 4, "int4_group", layout="vllm")) == {
        "w13_weight_packed": ("i32", [4, 32, 512]), "w13_weight_scale": ("bf16", [4, 4, 256]),
        "w2_weight_packed": ("i32", [4, 8, 1024]), "w2_weight_scale": ("bf16", [4, 1, 512])}


@pytest.mark.parametrize("layout,scheme", REFUSED, ids=[f"{a}-{b}" for a, b in REFUSED])
def test_fused_expert_schemes_an_engine_does_not_define_are_refused_naming_the_parameter(layout, scheme):
    with pytest.raises(ferry.Error) as e:
        MODEL.rank_spec(0, 2, scheme, layout=layout)
    assert "model.layers.0.mlp.experts.w13_weight" in str(e.value)
    assert "fused experts are not defined" in str(e.value)


def test_gptq_int4_of_stacked_experts_is_refused_naming_the_parameter():
    for layout in ("vllm", "sglang"):
        with pytest.raises(ferry.Error) as e:
            MODEL.rank_spec(0, 1, "gptq_int4", layout=layout)
        assert "model.layers.0.mlp.experts.w13_weight" in str(e.value) and "[N, K]" in str(e.value)


def test_fp8_block_experts_whose_halves_split_a_block_are_refused_naming_the_parameter():
    # vLLM pads each half of w13 to whole 128-row blocks (maybe_roundup_sizes); ferry does not pad.
    model = describe(dict(SMALL, moe_intermediate_size=192))
    with pytest.raises(ferry.Error) as e:
        model.rank_spec(0, 1, "fp8_block", layout="vllm")
    assert "model.layers.0.mlp.experts.w13_weight" in str(e.value) and "multiple of 128 rows" in str(e.value)
