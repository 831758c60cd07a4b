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
