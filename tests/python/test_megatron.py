"""Megatron-Core trainer ranks from Python: two trainer ranks (TP 2), each holding its fused local
tensors as Megatron-Core lays them out, built here with numpy from Megatron's definitions
(megatron/core/transformer/attention.py: linear_qkv's rows per query group, the group's query heads,
then its key head, then its value head; mlp.py: linear_fc1 [gate; up] of the rank's rows;
linear_proj / linear_fc2 row-parallel by columns; the vocabulary padded to a multiple of 128 x tp,
then split by rows), send them under their own names with ferry.megatron_layout into a TP-2 replica
of two rollout processes. Every rank's storage is compared bit for bit with the numpy reference of
fp8_per_tensor, as for a trainer holding every tensor whole."""

import threading

import numpy as np
import pytest

import children
import ferry
from test_update import CONFIG, TIMEOUT_S, TP, check_rank_storage, make_weights


def megatron_tensors(w, tp_rank, tp):
    h, heads, kv, inter, vocab, layers = 64, 4, 2, 128, 200, 2
    hd, per_group, fc = h // heads, heads // kv, inter // tp
    padded = -(-vocab // (128 * tp)) * 128 * tp
    per = padded // tp

    def vocab_rows(x):
        out = np.zeros((per, h), np.float32)
        first, last = min(vocab, per * tp_rank), min(vocab, per * (tp_rank + 1))
        out[: last - first] = x[first:last]
        return out

    out = {"embedding.word_embeddings.weight": vocab_rows(w["model.embed_tokens.weight"])}
    for l in range(layers):
        src, dst = f"model.layers.{l}.", f"decoder.layers.{l}."
        q, k, v = (w[src + f"self_attn.{p}_proj.weight"] for p in "qkv")
        groups = range(tp_rank * kv // tp, (tp_rank + 1) * kv // tp)
        out[dst + "self_attention.linear_qkv.weight"] = np.concatenate(
            [part for g in groups
             for part in (q[g * per_group * hd:(g + 1) * per_group * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd])])
        cols = heads * hd // tp
        out[dst + "self_attention.linear_proj.weight"] = w[src + "self_attn.o_proj.weight"][:, tp_rank * cols:(tp_rank + 1) * cols]
        rows = slice(tp_rank * fc, (tp_rank + 1) * fc)
        out[dst + "mlp.linear_fc1.weight"] = np.concatenate([w[src + "mlp.gate_proj.weight"][rows], w[src + "mlp.up_proj.weight"][rows]])
        out[dst + "mlp.linear_fc2.weight"] = w[src + "mlp.down_proj.weight"][:, rows]
        out[dst + "self_attention.linear_qkv.layer_norm_weight"] = w[src + "input_layernorm.weight"]
        out[dst + "mlp.linear_fc1.layer_norm_weight"] = w[src + "post_attention_layernorm.weight"]
    out["decoder.final_layernorm.weight"] = w["model.norm.weight"]
    out["output_layer.weight"] = vocab_rows(w["lm_head.weight"])
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def test_megatron_trainer_ranks_update_a_replica(tmp_path):
    cfg = ferry.LlamaConfig(**CONFIG)
    manifest = ferry.llama_manifest(cfg)
    layouts = [ferry.megatron_layout(cfg, r, 2, tp=2) for r in range(2)]
    assert all(len(lay) > 0 for lay in layouts)
    assert ("model.layers.0.self_attn.k_proj.weight", [16, 0], [16, 64],
            "decoder.layers.0.self_attention.linear_qkv.weight", 32) in layouts[1].boxes
    first = ferry.Trainer(trainer_rank=0, trainer_ranks=2)
    second = ferry.Trainer(coordinator=first.coordinator_address, trainer_rank=1, trainer_ranks=2)
    trainers = [first, second]
    ranks = [children.rollout_rank(first.coordinator_address, r, TP, CONFIG, tmp_path, TIMEOUT_S) for r in range(TP)]
    try:
        for r in ranks:
            r.expect("ready")
        first.wait_for_ranks(TP, timeout_ms=TIMEOUT_S * 1000)
        for version in (1, 2):
            weights = make_weights(manifest, seed=10 + version)
            errors = []

            def run(t):
                try:
                    trainers[t].start_weight_update(version, manifest, source_layout=layouts[t])
                    trainers[t].update_weights(megatron_tensors(weights, t, 2))
                    trainers[t].finish_weight_update()
                except Exception as e:  # noqa: BLE001 (reported below)
                    errors.append((t, e))

            threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert not errors, errors
            for r, rank in enumerate(ranks):
                rank.expect("paused", version, "abort", True)
                rank.expect("resumed", version)
                check_rank_storage(tmp_path, version, r, weights)
    finally:
        second.close()
        first.close()
        for r in ranks:
            r.wait()


def test_megatron_layout_refuses_what_does_not_split():
    cfg = ferry.LlamaConfig(**CONFIG)
    with pytest.raises(ferry.Error) as e:
        ferry.megatron_layout(cfg, 0, 3, tp=2)
    assert e.value.code == "InvalidArgument"
    with pytest.raises(ferry.Error) as e:
        ferry.megatron_layout(cfg, 0, 4, tp=2, ep=2)  # no routed experts
    assert "no routed experts" in e.value.message
