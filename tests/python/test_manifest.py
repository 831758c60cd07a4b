"""ferry.manifest_from_state_dict: a state dict's names, dtypes and shapes, in its order."""

import numpy as np
import pytest

import ferry


def test_numpy_state_dict():
    sd = {
        "model.embed_tokens.weight": np.zeros((100, 64), np.float32),
        "model.layers.0.input_layernorm.weight": np.zeros(64, np.float16),
        "model.layers.0.mlp.gate.e_score_correction_bias": np.zeros(4, np.float32),
        "model.layers.0.self_attn.q_proj.weight": np.zeros((128, 64), np.int8),
    }
    m = ferry.manifest_from_state_dict(sd)
    assert [t.name for t in m] == list(sd)
    assert [t.dtype for t in m] == ["f32", "f16", "f32", "i8"]
    assert [list(t.shape) for t in m] == [[100, 64], [64], [4], [128, 64]]
    assert m[0] == ferry.SourceTensor("model.embed_tokens.weight", "f32", [100, 64])


def test_matches_a_models_manifest():
    # The manifest ferry derives for a model equals the one read off that model's tensors.
    cfg = ferry.LlamaConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128,
                            num_layers=1, dtype="f32")
    want = ferry.llama_manifest(cfg)
    sd = {t.name: np.zeros(list(t.shape), np.float32) for t in want}
    assert ferry.manifest_from_state_dict(sd) == want


def test_torch_state_dict():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=True)).to(torch.bfloat16)
    m = ferry.manifest_from_state_dict(model.state_dict())
    assert [(t.name, t.dtype, list(t.shape)) for t in m] == [("0.weight", "bf16", [4, 8]), ("0.bias", "bf16", [4])]


def test_refusals_name_the_tensor():
    with pytest.raises(ferry.Error) as e:
        ferry.manifest_from_state_dict({"w.weight": np.zeros(3, np.complex64)})
    assert e.value.code == "InvalidArgument" and "w.weight" in e.value.message
    with pytest.raises(TypeError, match="w.weight"):
        ferry.manifest_from_state_dict({"w.weight": [1.0, 2.0]})


def test_stacked_experts_manifest_matches_a_fused_experts_state_dict():
    # A trainer holding transformers' fused experts (Qwen3MoeExperts: gate_up_proj [E, 2I, H] with the
    # gate rows first, down_proj [E, H, I]) sends one tensor per layer and projection; its state
    # dict's manifest is the stacked model's, and a rank's experts come from whole boxes of them.
    per_expert = ferry.preset_model("qwen3-30b-a3b")
    stacked = per_expert.stacked_experts()
    m = stacked.manifest()
    names = {t.name: list(t.shape) for t in m}
    assert len(m) == 531 and len(per_expert.manifest()) == 18867
    assert names["model.layers.0.mlp.experts.gate_up_proj"] == [128, 1536, 2048]
    assert names["model.layers.47.mlp.experts.down_proj"] == [128, 2048, 768]
    assert not any(".experts.0." in n for n in names)
    sd = {t.name: np.zeros(0, np.float32) for t in m}  # the order a fused-experts model lists them in
    assert [t.name for t in ferry.manifest_from_state_dict(sd)] == [t.name for t in m]
    # TP 2: each rank takes its gate rows and its up rows of every expert, one slice each.
    spec = stacked.rank_spec(1, 2, "fp8_block")
    w13 = next(p for p in spec.params if p.name == "model.layers.0.mlp.experts.w13_weight")
    assert list(w13.shape) == [128, 768, 2048]
    assert [(s.source, list(s.src.offset), list(s.src.size)) for s in w13.slices] == [
        ("model.layers.0.mlp.experts.gate_up_proj", [0, 384, 0], [128, 384, 2048]),
        ("model.layers.0.mlp.experts.gate_up_proj", [0, 1152, 0], [128, 384, 2048]),
    ]
