"""bench/gpu/torch_baseline.py --selftest: the quantizers against their float64 checks (and the
checks catching wrong codes and scales), the tiny dense and MoE rollouts, and the packing plans, on
the CPU."""
import math

import torch

from torch_baseline import ALIGN, plan_chunks
from torch_models import (DEFAULT_SCHEMES, FP8_MAX, INT4_GROUP, LLAMA3_8B, QWEN3_30B_A3B, SCHEMES, TINY, TINY_MOE,
                          layout, make_weights, trainer_shapes)
from torch_quant import (block_grid, check_fp8, check_fp8_block, check_int4, quant_fp8_blocks, quant_fp8_rows,
                         quant_fp8_tensor, quant_int4_groups, unpack_int4)
from torch_rollout import Rollout

def selftest():
    torch.manual_seed(0)
    failures = []

    def expect_true(cond, what):
        print(f"{'ok  ' if cond else 'FAIL'} {what}")
        if not cond:
            failures.append(what)

    r, c = 96, 512
    w = (torch.randn(r, c) * 0.02).to(torch.bfloat16)
    w[3] = 0  # zero row: scale 1
    w[5, :INT4_GROUP] = 0  # zero int4 group
    w[7, 0] = 3.0  # outlier
    w[9, 1] = -5e-4  # small values next to a large one
    # int4 ties: amax 1.75 gives scale 0.25 exactly, so 0.375 and 0.125 divide to 1.5 and 0.5
    w[11, INT4_GROUP:2 * INT4_GROUP] = 0.125
    w[11, INT4_GROUP] = 1.75
    w[11, INT4_GROUP + 1] = 0.375

    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    s = torch.empty(r)
    quant_fp8_rows(w, q, s)
    res = check_fp8(w, q, s, per_tensor=False)
    expect_true(res["ok"], f"fp8_per_channel matches float64 reference {res}")
    expect_true(s[3].item() == 1.0 and bool((q[3].float() == 0).all()), "fp8_per_channel zero row: scale 1, codes 0")
    expect_true(q[7, 0].float().item() == FP8_MAX, "fp8_per_channel row amax maps to 448")
    bad = q.clone()
    bad.view(torch.uint8)[10, 10] ^= 1
    expect_true(not check_fp8(w, bad, s, per_tensor=False)["ok"], "fp8_per_channel check catches a flipped code")
    bad_s = s.clone()
    bad_s[10] *= 1.0001
    expect_true(not check_fp8(w, q, bad_s, per_tensor=False)["ok"], "fp8_per_channel check catches a wrong scale")

    st = torch.empty(1)
    quant_fp8_tensor(w, q, st)
    res = check_fp8(w, q, st, per_tensor=True)
    expect_true(res["ok"] and res["mismatches"] == 0, f"fp8_per_tensor matches float64 reference {res}")
    expect_true(abs(st.item() - 3.0 / FP8_MAX) <= 3.0 / FP8_MAX * 2 ** -22, "fp8_per_tensor scale = amax / 448")

    p = torch.empty(r, c // 2, dtype=torch.uint8)
    s16 = torch.empty(r, c // INT4_GROUP, dtype=torch.float16)
    quant_int4_groups(w, p, s16)
    res = check_int4(w, p, s16)
    expect_true(res["ok"] and res["mismatches"] == 0, f"int4_group matches float64 reference {res}")
    expect_true(s16[5, 0].item() == 1.0, "int4_group zero group: scale 1")
    codes = unpack_int4(p)
    expect_true(s16[11, 1].item() == 0.25 and codes[11, INT4_GROUP].item() == 7, "int4_group scale amax/7, code 7")
    expect_true(codes[11, INT4_GROUP + 1].item() == 2 and codes[11, INT4_GROUP + 2].item() == 0,
                "int4_group ties round to even (1.5 -> 2, 0.5 -> 0)")
    expect_true(bool((codes >= -8).all() and (codes <= 7).all()), "int4_group codes within [-8, 7]")
    ref = torch.round(w.float().view(r, -1, INT4_GROUP) / s16.float()[..., None]).clamp(-8, 7).view(r, c)
    lo, hi = (p & 0xF).to(torch.int16), (p >> 4).to(torch.int16)
    expect_true(bool(torch.equal(((ref[:, 0::2].to(torch.int16)) & 0xF), lo)) and
                bool(torch.equal(((ref[:, 1::2].to(torch.int16)) & 0xF), hi)),
                "int4_group packing: even column in the low nibble")
    bad = p.clone()
    bad[20, 3] ^= 0x10
    expect_true(not check_int4(w, bad, s16)["ok"], "int4_group check catches a flipped nibble")

    # fp8_block: 96 x 520 is a partial row band and a partial column tile; the zero row, the
    # outlier and the small values above fall in different tiles.
    wb = torch.nn.functional.pad(w.float(), (0, 8)).to(torch.bfloat16)
    wb[:, 512:] = 0.5
    qb = torch.empty(r, c + 8, dtype=torch.float8_e4m3fn)
    sb = torch.empty(block_grid(r, c + 8))
    quant_fp8_blocks(wb, qb, sb)
    res = check_fp8_block(wb, qb, sb)
    expect_true(res["ok"] and sb.shape == (1, 5), f"fp8_block matches float64 reference {res}")
    expect_true(sb[0, 0].item() == torch.tensor(3.0 / FP8_MAX).item() and sb[0, 4].item() == torch.tensor(
        0.5 / FP8_MAX).item(), "fp8_block scale = the tile's amax / 448")
    bad = qb.clone()
    bad.view(torch.uint8)[40, 515] ^= 1
    expect_true(not check_fp8_block(wb, bad, sb)["ok"], "fp8_block check catches a flipped code in a partial tile")
    bad_s = sb.clone()
    bad_s[0, 2] *= 1.0001
    expect_true(not check_fp8_block(wb, qb, bad_s)["ok"], "fp8_block check catches a wrong scale")

    # Writes land in existing storage: fused rollout of a tiny model (and of a tiny MoE, its
    # experts stacked), data_ptr stable.
    moe_schemes = DEFAULT_SCHEMES["qwen3-30b-a3b"]
    for base, schemes in ((TINY, SCHEMES), (TINY_MOE, moe_schemes), (dict(TINY_MOE, stacked=True), moe_schemes)):
        cfg = dict(base, layers=1)
        for scheme in schemes:
            ro = Rollout(cfg, scheme, torch.device("cpu"))
            ws = make_weights(cfg, torch.device("cpu"), 1)
            for name, t in ws:
                ro.write(name, t)
            results = {n: ro.check(n, t) for n, t in ws}
            expect_true(all(x["ok"] for x in results.values()) and ro.ptrs_unchanged(),
                        f"{scheme}{' (experts' + (', stacked)' if cfg.get('stacked') else ')') if 'experts' in cfg else ''}"
                        ": tiny fused rollout matches every "
                        "tensor, data_ptr unchanged")
    moe = dict(QWEN3_30B_A3B)
    mshapes = trainer_shapes(moe)
    _, mspecs = layout(moe)
    mparams = sum(math.prod(sh) for _, sh in mshapes)
    expect_true(len(mshapes) == 18867 and abs(mparams - 30.53e9) < 0.01e9 and
                mspecs["model.layers.0.mlp.experts.w13_weight"][1] == (128, 1536, 2048),
                f"Qwen3-30B-A3B: {len(mshapes)} tensors, {mparams} params, experts stacked")

    # Packing plans on the real shapes, both slot counts: every byte of every tensor once.
    full = dict(LLAMA3_8B)
    shapes = trainer_shapes(full)
    targets, specs = layout(full)
    nparams = sum(math.prod(sh) for _, sh in shapes)
    expect_true(len(shapes) == 291 and abs(nparams - 8.03e9) < 0.01e9, f"Llama-3-8B: {len(shapes)} tensors, {nparams} params")
    for nslots in (1, 2):
        slot = (2 ** 30 // nslots) // ALIGN * ALIGN
        plan = plan_chunks(shapes, lambda n: True, slot, nslots)
        rows_seen = {}
        ok = True
        for k, chunk in enumerate(plan):
            base = (k % nslots) * slot
            end = base
            for name, shape, off, row0, rows in chunk:
                ok &= off >= end and off % ALIGN == 0
                end = off + math.prod(shape) * 2
                ok &= end <= base + slot
                rows_seen.setdefault(name, []).append((row0, rows))
        for name, shape in shapes:
            pieces = sorted(rows_seen.get(name, []))
            ok &= sum(rr for _, rr in pieces) == shape[0] and all(
                a[0] + a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        expect_true(ok, f"packing plan, {nslots} slot(s) of {slot} bytes: {len(plan)} chunks cover every row once")
    try:
        plan_chunks(shapes, lambda n: targets[n].kind == "copy", 2 ** 20, 2)
        expect_true(False, "a per-tensor-scaled weight larger than a slot is refused")
    except ValueError:
        expect_true(True, "a per-tensor-scaled weight larger than a slot is refused")
    spec = specs["model.layers.0.self_attn.qkv_proj.weight"]
    expect_true(spec[1] == (6144, 4096) and spec[2] == [4096, 1024, 1024], "qkv_proj fused [6144, 4096], shards 4096/1024/1024")
    spec = specs["model.layers.0.mlp.gate_up_proj.weight"]
    expect_true(spec[1] == (28672, 4096) and spec[2] == [14336, 14336], "gate_up_proj fused [28672, 4096]")

    print(f"selftest: {len(failures)} failed")
    return 1 if failures else 0
