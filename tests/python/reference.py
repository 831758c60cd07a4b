"""Independent numpy references for the Python tests: the e4m3fn encoding, fp8_per_tensor, and the
Llama and Qwen3-MoE tensor-parallel layouts, written from their definitions and not from ferry's
code."""

import numpy as np

E4M3_MAX = 448.0


def _e4m3fn_positive_values():
    """Value of every positive finite e4m3fn code 0x00..0x7E (bias 7, 3 mantissa bits, no inf)."""
    values = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        if exp == 0:
            values.append(man / 8.0 * 2.0**-6)
        else:
            values.append((1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return np.array(values, dtype=np.float64)


_VALUES = _e4m3fn_positive_values()


def e4m3fn_encode(x):
    """Nearest e4m3fn code of float64 `x`, ties to the even code, saturating at 448, sign kept."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_VALUES, mag, side="left"), 1, 0x7E)
    lo = hi - 1
    d_lo = mag - _VALUES[lo]
    d_hi = _VALUES[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)


def fp8_per_tensor(x, shard_rows=None):
    """(codes uint8, scales float32[S]): one scale per logical shard of rows, scale = amax / 448 in
    f32 (1 when that is not > 0), q = e4m3fn(x / scale), the code chosen in float64.

    The quotient is an IEEE f32 division, as kernels/quantize.h defines it (and GPUs compute it):
    rounding it to f32 first can land on an e4m3 tie that the exact quotient is not on, e.g.
    -1.4237362 / 0.00847462 = -168.0000053 exactly (-> -176) but -168.0 in f32 (tie -> -160)."""
    x = np.asarray(x, dtype=np.float32)
    rows = x.shape[0]
    shard_rows = list(shard_rows) if shard_rows else [rows]
    assert sum(shard_rows) == rows
    codes = np.empty(x.shape, dtype=np.uint8)
    scales = np.empty(len(shard_rows), dtype=np.float32)
    start = 0
    for s, n in enumerate(shard_rows):
        part = x[start:start + n].astype(np.float64)
        finite = part[np.isfinite(part)]
        amax = float(np.max(np.abs(finite))) if finite.size else 0.0
        scale = np.float32(amax / E4M3_MAX)
        if not scale > 0:
            scale = np.float32(1.0)
        scales[s] = scale
        quotient = x[start:start + n] / scale  # f32 / f32, correctly rounded to f32
        codes[start:start + n] = e4m3fn_encode(quotient.astype(np.float64))
        start += n
    return codes, scales


def vocab_rows(w, cfg, tp_rank, tp_size):
    """A rank's rows of a vocabulary tensor as vLLM's VocabParallelEmbedding cuts it:
    divide(pad_vocab_size(vocab, pad), tp), rows past the vocabulary zero."""
    per = -(-cfg["vocab"] // cfg["pad"]) * cfg["pad"] // tp_size
    shard = np.zeros((per, w.shape[1]), dtype=np.float32)
    rows = w[tp_rank * per:(tp_rank + 1) * per]
    shard[:rows.shape[0]] = rows
    return shard


def llama_rank_params(cfg, weights, tp_rank, tp_size):
    """{engine parameter name: (full-precision shard, logical shard rows or None, quantized?)} of one
    TP rank, from the checkpoint tensors `weights`. cfg: dict with hidden, heads, kv_heads, inter,
    vocab, layers, pad (vocab shard padding multiple). Assumes kv_heads >= tp_size."""
    h, hd = cfg["hidden"], cfg["hidden"] // cfg["heads"]
    q_rows = cfg["heads"] // tp_size * hd
    kv_rows = cfg["kv_heads"] // tp_size * hd
    ir = cfg["inter"] // tp_size
    r = tp_rank
    out = {}

    def vocab_shard(src):
        return vocab_rows(weights[src], cfg, tp_rank, tp_size)

    out["model.embed_tokens.weight"] = (vocab_shard("model.embed_tokens.weight"), None, False)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        w = lambda n: weights[p + n]  # noqa: E731
        out[p + "input_layernorm.weight"] = (w("input_layernorm.weight"), None, False)
        qkv = np.concatenate([w("self_attn.q_proj.weight")[r * q_rows:(r + 1) * q_rows],
                              w("self_attn.k_proj.weight")[r * kv_rows:(r + 1) * kv_rows],
                              w("self_attn.v_proj.weight")[r * kv_rows:(r + 1) * kv_rows]])
        out[p + "self_attn.qkv_proj.weight"] = (qkv, [q_rows, kv_rows, kv_rows], True)
        cols = w("self_attn.o_proj.weight").shape[1] // tp_size
        out[p + "self_attn.o_proj.weight"] = (w("self_attn.o_proj.weight")[:, r * cols:(r + 1) * cols], None, True)
        out[p + "post_attention_layernorm.weight"] = (w("post_attention_layernorm.weight"), None, False)
        gate_up = np.concatenate([w("mlp.gate_proj.weight")[r * ir:(r + 1) * ir],
                                  w("mlp.up_proj.weight")[r * ir:(r + 1) * ir]])
        out[p + "mlp.gate_up_proj.weight"] = (gate_up, [ir, ir], True)
        out[p + "mlp.down_proj.weight"] = (w("mlp.down_proj.weight")[:, r * ir:(r + 1) * ir], None, True)
    out["model.norm.weight"] = (weights["model.norm.weight"], None, False)
    out["lm_head.weight"] = (vocab_shard("lm_head.weight"), None, False)
    return out


def qwen3_moe_rank_params(cfg, weights, tp_rank, tp_size):
    """{engine parameter name: (full-precision shard, None, quantized?)} of one TP rank (EP 1) of a
    Qwen3-MoE model, as vLLM's Qwen3MoeForCausalLM (model_executor/models/qwen3_moe.py) lays it out:
    QKVParallelLinear qkv_proj (q, k, v heads of head_dim, sharded by heads), q_norm / k_norm
    [head_dim] replicated, RowParallelLinear o_proj, the router mlp.gate a ReplicatedLinear left in
    full precision, and FusedMoE experts: w13_weight [E, 2I/tp, H] (each expert's gate rows of this
    rank, then its up rows: shard w1 before w3), w2_weight [E, H, I/tp]. Layers in mlp_only have a
    dense Qwen3MoeMLP (gate_up_proj, down_proj). cfg: dict with hidden, heads, kv_heads, head_dim,
    inter, moe_inter, experts, layers, mlp_only, vocab, pad. Assumes kv_heads >= tp_size."""
    h, hd, r = cfg["hidden"], cfg["head_dim"], tp_rank
    q_rows, kv_rows = cfg["heads"] // tp_size * hd, cfg["kv_heads"] // tp_size * hd
    out = {}

    def vocab_shard(src):
        return vocab_rows(weights[src], cfg, tp_rank, tp_size)

    def rows(x, n):
        return x[r * n:(r + 1) * n]

    def cols(x, n):
        return x[:, r * n:(r + 1) * n]

    out["model.embed_tokens.weight"] = (vocab_shard("model.embed_tokens.weight"), None, False)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        w = lambda n: weights[p + n]  # noqa: E731
        out[p + "input_layernorm.weight"] = (w("input_layernorm.weight"), None, False)
        qkv = np.concatenate([rows(w("self_attn.q_proj.weight"), q_rows), rows(w("self_attn.k_proj.weight"), kv_rows),
                              rows(w("self_attn.v_proj.weight"), kv_rows)])
        out[p + "self_attn.qkv_proj.weight"] = (qkv, None, True)
        out[p + "self_attn.q_norm.weight"] = (w("self_attn.q_norm.weight"), None, False)
        out[p + "self_attn.k_norm.weight"] = (w("self_attn.k_norm.weight"), None, False)
        out[p + "self_attn.o_proj.weight"] = (cols(w("self_attn.o_proj.weight"), q_rows), None, True)
        out[p + "post_attention_layernorm.weight"] = (w("post_attention_layernorm.weight"), None, False)
        if i in cfg["mlp_only"]:
            ir = cfg["inter"] // tp_size
            gate_up = np.concatenate([rows(w("mlp.gate_proj.weight"), ir), rows(w("mlp.up_proj.weight"), ir)])
            out[p + "mlp.gate_up_proj.weight"] = (gate_up, None, True)
            out[p + "mlp.down_proj.weight"] = (cols(w("mlp.down_proj.weight"), ir), None, True)
            continue
        ir = cfg["moe_inter"] // tp_size
        out[p + "mlp.gate.weight"] = (w("mlp.gate.weight"), None, False)
        e = range(cfg["experts"])
        w13 = np.stack([np.concatenate([rows(w(f"mlp.experts.{j}.gate_proj.weight"), ir),
                                        rows(w(f"mlp.experts.{j}.up_proj.weight"), ir)]) for j in e])
        out[p + "mlp.experts.w13_weight"] = (w13, None, True)
        w2 = np.stack([cols(w(f"mlp.experts.{j}.down_proj.weight"), ir) for j in e])
        out[p + "mlp.experts.w2_weight"] = (w2, None, True)
    out["model.norm.weight"] = (weights["model.norm.weight"], None, False)
    out["lm_head.weight"] = (vocab_shard("lm_head.weight"), None, False)
    return out


def bf16_bits(x):
    """uint16 bits of f32 `x` rounded to bf16, nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def expected_storage(cfg, weights, tp_rank, tp_size):
    """{storage name: expected array} of one rank under fp8_per_tensor; unquantized parameters in
    bf16 (as uint16 bits)."""
    out = {}
    for name, (x, shards, quantized) in llama_rank_params(cfg, weights, tp_rank, tp_size).items():
        if quantized:
            codes, scales = fp8_per_tensor(x, shards)
            out[name] = codes
            out[name[:-len("weight")] + "weight_scale"] = scales
        else:
            out[name] = bf16_bits(x)
    return out
