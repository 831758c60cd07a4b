#!/usr/bin/env python3
"""PyTorch baselines for a colocated weight update: a trainer process and a rollout process share
one GPU, and every update moves the trainer's bf16 weights into the rollout's existing quantized
parameters with plain PyTorch, the way RL stacks do it today without ferry.

Workload (--model): a Llama-3-8B-shaped model (HF parameter names, untied embeddings), or a
Qwen3-30B-A3B-shaped mixture of experts (qwen3-30b-a3b: 48 layers, 128 experts of 768 rows, q/k
norms; 18,867 tensors), with random bf16 weights in the trainer. The rollout holds vLLM-style fused
parameters (qkv_proj, gate_up_proj; the experts stacked per layer as w13 [E, 2I, H] and
w2 [E, H, I]) allocated once; linear weights are quantized under --scheme, norms, routers and
embeddings stay bf16. fp8_block: one f32 scale per 128 x 128 tile, amax / 448 (1 for a zero
tile), as ferry's fp8_block. --experts stacked: the trainer holds each layer's experts stacked too,
as transformers' fused experts do (mlp.experts.gate_up_proj [E, 2I, H], gate rows first, and
mlp.experts.down_proj [E, H, I]: 531 tensors); each is quantized in one go.

Baselines (--baseline):
  per_tensor  each update the trainer makes one CUDA IPC handle per tensor
              (torch.multiprocessing.reductions.reduce_tensor) and sends all of them over a Pipe;
              the rollout rebuilds each tensor, quantizes it with torch ops and copy_s it into its
              parameters, synchronizes and acks.
  packed      like vLLM's packed IPC weight transfer: one packed buffer (--buffer-mib, default
              1024) is allocated and shared once; it is split into --buffers slots (default 2:
              double buffering, two 512 MiB halves). Per update the trainer packs consecutive
              tensors into a free slot, synchronizes, sends the chunk's (name, shape, offset)
              list; the rollout unpacks views, quantizes, copy_s, synchronizes and acks the slot.
              A tensor larger than a slot is split at row boundaries (per-row schemes and bf16
              copies only).

Timing: the trainer changes its weights (add_, untimed), synchronizes, then measures wall time
until the rollout's ack that every parameter is written (the rollout synchronizes before it acks).
Median over --updates after --warmup updates. Floor: a device-to-device copy's bandwidth
(2 * bytes / time) and floor_seconds = floor_bytes / bandwidth, floor_bytes = 3 bytes per
parameter (fp8 schemes); under int4_group 2.5 bytes per linear-weight parameter and 3 per other.

After the timed updates the rollout checks one layer (--verify-layer) against a float64
reference computed from the trainer's current weights, the bf16 tensors bit for bit, and that no
rollout parameter's data_ptr() changed since allocation.

Output: one JSON line per (baseline, scheme) on stdout; progress on stderr. --selftest checks the
quantizers, the float64 checks and the packing plan on the CPU (no GPU needed); --device cpu
--tiny runs the whole two-process protocol on the CPU with small shapes.
"""
import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

SCHEMES = ("fp8_per_channel", "fp8_per_tensor", "int4_group", "fp8_block")
BLOCK = 128  # fp8_block tile side
BASELINES = ("per_tensor", "packed")
CASE_PREFIX = {"per_tensor": "torch_per_tensor_ipc", "packed": "torch_packed_ipc"}
FP8_MAX = 448.0
INT4_GROUP = 128
F16_MAX = 65504.0
ALIGN = 256  # byte alignment of tensors inside the packed buffer
REPLY_TIMEOUT_S = 900.0

LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
TINY = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1024)
QWEN3_30B_A3B = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=0, vocab=151936,
                     experts=128, moe_intermediate=768)
TINY_MOE = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=0, vocab=1024, experts=4,
                moe_intermediate=128)
MODELS = {"llama3-8b": (LLAMA3_8B, TINY), "qwen3-30b-a3b": (QWEN3_30B_A3B, TINY_MOE)}
# The schemes of --scheme all: the dense model's three (fp8_block on request); for the experts the
# per-channel and block schemes engines serve MoE checkpoints in.
DEFAULT_SCHEMES = {"llama3-8b": ("fp8_per_channel", "fp8_per_tensor", "int4_group"),
                   "qwen3-30b-a3b": ("fp8_per_channel", "fp8_block")}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Model layout: the trainer's HF tensors and the rollout's fused parameters.


@dataclass(frozen=True)
class Target:
    """Where one trainer tensor lands in the rollout."""

    kind: str  # "linear" (quantized), "stacked" (a whole stacked expert tensor, quantized) or "copy" (bf16)
    param: str  # rollout weight name
    row0: int = 0  # first row inside a fused parameter
    shard: int = 0  # logical shard (fp8_per_tensor scale index)
    rows: int = 0
    expert: int = -1  # the matrix of a stacked expert parameter, or -1


def trainer_shapes(cfg):
    """[(HF name, shape)] in checkpoint order."""
    h, q = cfg["hidden"], cfg["heads"] * cfg["head_dim"]
    kv, inter = cfg["kv_heads"] * cfg["head_dim"], cfg["intermediate"]
    experts, moe = cfg.get("experts", 0), cfg.get("moe_intermediate", 0)
    out = [("model.embed_tokens.weight", (cfg["vocab"], h))]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
        ]
        if experts:  # Qwen3-MoE: q/k norms, a router, per-expert projections
            out += [(p + "self_attn.q_norm.weight", (cfg["head_dim"],)),
                    (p + "self_attn.k_norm.weight", (cfg["head_dim"],)),
                    (p + "mlp.gate.weight", (experts, h))]
            if cfg.get("stacked"):
                out += [(p + "mlp.experts.gate_up_proj", (experts, 2 * moe, h)),
                        (p + "mlp.experts.down_proj", (experts, h, moe))]
            for e in range(0 if cfg.get("stacked") else experts):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", (moe, h)),
                        (p + f"mlp.experts.{e}.up_proj.weight", (moe, h)),
                        (p + f"mlp.experts.{e}.down_proj.weight", (h, moe))]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab"], h))]
    return out


def layout(cfg):
    """(targets: HF name -> Target, params: rollout weight name -> (kind, shape, shard_rows))."""
    shapes = dict(trainer_shapes(cfg))
    targets, params = {}, {}
    for name, shape in shapes.items():
        if len(shape) == 1 or "embed_tokens" in name or name == "lm_head.weight" or name.endswith("mlp.gate.weight"):
            targets[name] = Target("copy", name, rows=shape[0])
            params[name] = ("copy", shape, None)
    experts = cfg.get("experts", 0)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        fusions = [
            (p + "self_attn.qkv_proj.weight", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            (p + "self_attn.o_proj.weight", ("self_attn.o_proj",)),
        ]
        if experts and cfg.get("stacked"):
            for src, param in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
                e, rows, cols = shapes[p + "mlp.experts." + src]
                targets[p + "mlp.experts." + src] = Target("stacked", p + "mlp.experts." + param, rows=rows)
                params[p + "mlp.experts." + param] = ("linear", (e, rows, cols), [rows // 2] * 2 if param == "w13_weight"
                                                      else [rows])
        elif experts:
            for stacked, parts in ((p + "mlp.experts.w13_weight", ("gate_proj", "up_proj")),
                                   (p + "mlp.experts.w2_weight", ("down_proj",))):
                row0, shard_rows, cols = 0, [], None
                for s, part in enumerate(parts):
                    rows, cols = shapes[p + f"mlp.experts.0.{part}.weight"]
                    for e in range(experts):
                        targets[p + f"mlp.experts.{e}.{part}.weight"] = Target("linear", stacked, row0, s, rows, e)
                    shard_rows.append(rows)
                    row0 += rows
                params[stacked] = ("linear", (experts, row0, cols), shard_rows)
        else:
            fusions += [
                (p + "mlp.gate_up_proj.weight", ("mlp.gate_proj", "mlp.up_proj")),
                (p + "mlp.down_proj.weight", ("mlp.down_proj",)),
            ]
        for fused, parts in fusions:
            row0, shard_rows, cols = 0, [], None
            for s, part in enumerate(parts):
                rows, cols = shapes[p + part + ".weight"]
                targets[p + part + ".weight"] = Target("linear", fused, row0, s, rows)
                shard_rows.append(rows)
                row0 += rows
            params[fused] = ("linear", (row0, cols), shard_rows)
    return targets, params


def scale_name(weight_name):
    return weight_name[: -len("weight")] + "weight_scale"


# ---------------------------------------------------------------------------------------------
# Quantizers: plain torch ops writing into existing storage (views of the rollout's parameters).


def quant_fp8_rows(src, q_out, s_out):
    """fp8_per_channel. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [r]."""
    s = src.abs().amax(dim=1).float() / FP8_MAX
    s.masked_fill_(~(s > 0), 1.0)
    x = src / s[:, None]  # f32: both operands have dimensions, so bf16 / f32 promotes to f32
    x.clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)  # f32 -> e4m3fn, round to nearest even
    s_out.copy_(s)


def quant_fp8_tensor(src, q_out, s_out):
    """fp8_per_tensor, one shard. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [1]."""
    s = (src.abs().amax().float() / FP8_MAX).reshape(1, 1)  # 2-D, or bf16 / s would stay bf16
    s.masked_fill_(~(s > 0), 1.0)
    x = src / s
    x.clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)
    s_out.copy_(s.reshape(1))


def quant_int4_groups(src, q_out, s_out):
    """int4_group. src bf16 [r, c]; q_out uint8 [r, c/2] (column 2k in the low nibble);
    s_out f16 [r, c/128]."""
    r, c = src.shape
    g = c // INT4_GROUP
    v = src.view(r, g, INT4_GROUP)
    s = (v.abs().amax(dim=2).float() / 7.0).to(torch.float16)
    s.masked_fill_(s == 0, 1.0)
    s.clamp_(max=F16_MAX)  # an overflowed scale becomes the largest finite f16
    x = v / s.float()[..., None]  # f32
    x.round_().clamp_(-8, 7)  # round half to even
    codes = x.to(torch.int8).view(torch.uint8)  # two's complement bytes
    torch.bitwise_or(codes[..., 0::2] & 0x0F, codes[..., 1::2] << 4, out=q_out.view(r, g, INT4_GROUP // 2))
    s_out.copy_(s)


def block_grid(r, c):
    return -(-r // BLOCK), -(-c // BLOCK)


def quant_fp8_blocks(src, q_out, s_out):
    """fp8_block. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [ceil(r/128), ceil(c/128)]."""
    r, c = src.shape
    br, bc = block_grid(r, c)
    x = src.float()
    if r % BLOCK or c % BLOCK:
        x = torch.nn.functional.pad(x, (0, bc * BLOCK - c, 0, br * BLOCK - r))
    v = x.view(br, BLOCK, bc, BLOCK)
    s = v.abs().amax(dim=(1, 3)) / FP8_MAX
    s.masked_fill_(~(s > 0), 1.0)
    y = (v / s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(y.view(br * BLOCK, bc * BLOCK)[:r, :c])
    s_out.copy_(s)


def alloc_linear(scheme, shape, shard_rows, device):
    """The storage of one linear parameter: [rows, cols], or [experts, rows, cols] stacked."""
    lead, (rows, cols) = tuple(shape[:-2]), shape[-2:]
    if scheme == "fp8_per_channel":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(lead + (rows,), dtype=torch.float32, device=device))
    if scheme == "fp8_block":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(lead + block_grid(rows, cols), dtype=torch.float32, device=device))
    if lead:
        raise ValueError(f"{scheme}: stacked experts are measured under fp8_per_channel and fp8_block")
    if scheme == "fp8_per_tensor":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(len(shard_rows), dtype=torch.float32, device=device))
    if scheme == "int4_group":
        if cols % INT4_GROUP:
            raise ValueError(f"int4_group needs cols % {INT4_GROUP} == 0, got {shape}")
        return (torch.zeros((rows, cols // 2), dtype=torch.uint8, device=device),
                torch.ones((rows, cols // INT4_GROUP), dtype=torch.float16, device=device))
    raise ValueError(f"unknown scheme {scheme}")


# ---------------------------------------------------------------------------------------------
# Float64 checks of the rollout's storage against the trainer's weights.


def pow2(k):
    """2.0**k in float64, exactly, for an integer tensor k (normal range)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def e4m3_ulp(x):
    """Spacing of e4m3fn values around float64 x (|x| <= 448): 2^(max(E, -6) - 3)."""
    _, e = torch.frexp(x.abs())
    return pow2((e.to(torch.int64) - 1).clamp(min=-6) - 3)


def e4m3_round(x):
    """Nearest e4m3fn value (ties to even) of float64 x, |x| <= 448, in float64."""
    u = e4m3_ulp(x)
    return (torch.round(x / u) * u).clamp(-FP8_MAX, FP8_MAX)


# Bounds. Codes are checked against w / s in float64, s being the rollout's own scale (itself
# checked against the exact amax / 448 or amax / 7). The rollout rounds w / s to f32 first, so a
# code may differ from the float64 rounding only where w / s lies within f32 rounding (2^-24
# relative) of a tie, and then it is one of the two nearest codes: |q - w/s| is at most half a
# code step, plus that sliver. Such near-ties are not rare: the f32 scale is amax / 448 rounded,
# so a bf16 w whose exact ratio to amax hits a tie lands next to it, and the f32 quotient can round
# back onto it (about 1 code in 1000 on the CPU; none seen on an H200). They are counted
# (code_mismatches), not failed. The scale may be one f32 ulp off the exact quotient (torch may
# divide by a scalar through its reciprocal).
SCALE_REL_FP8 = 2.0 ** -22
CODE_ERR_BOUND = 1.0 + 2.0 ** -18  # |q - w/s| in units of half a code step


def check_fp8(w, q, s, per_tensor):
    """w bf16 [r, c]; q e4m3fn [r, c]; s f32 [r] or [1]. Returns a dict of measures and ok."""
    w64 = w.double()
    amax = w64.abs().amax().reshape(1, 1) if per_tensor else w64.abs().amax(dim=1, keepdim=True)
    s64 = s.double().reshape(-1, 1)
    return fp8_measures(w64, q, amax, s64, s64)


def check_fp8_block(w, q, s):
    """w bf16 [r, c]; q e4m3fn [r, c]; s f32 [ceil(r/128), ceil(c/128)]."""
    r, c = w.shape
    br, bc = block_grid(r, c)
    w64 = w.double()
    padded = torch.nn.functional.pad(w64, (0, bc * BLOCK - c, 0, br * BLOCK - r))
    amax = padded.view(br, BLOCK, bc, BLOCK).abs().amax(dim=(1, 3))
    s64 = s.double()
    per_element = s64.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
    return fp8_measures(w64, q, amax, s64, per_element)


def fp8_measures(w64, q, amax, s64, s_elem):
    """Codes q of w64 under the scales s64 (one per amax entry), s_elem broadcast to w64's shape."""
    s_ref = amax / FP8_MAX
    s_ref = torch.where(s_ref > 0, s_ref, torch.ones_like(s_ref))
    scale_rel = ((s64 - s_ref).abs() / s_ref).max().item()
    x = (w64 / s_elem).clamp(-FP8_MAX, FP8_MAX)
    qd = q.to(torch.float64)
    err = ((qd - x).abs() / (e4m3_ulp(x) / 2)).max().item()
    mismatches = (qd != e4m3_round(x)).sum().item()
    n = w64.numel()
    ok = scale_rel <= SCALE_REL_FP8 and err <= CODE_ERR_BOUND
    return dict(ok=ok, scale_rel=scale_rel, code_err=err, mismatches=mismatches, elements=n)


def unpack_int4(p):
    """uint8 [r, c/2] -> int16 [r, c], low nibble = even column, sign-extended."""
    lo = (p & 0x0F).to(torch.int16)
    hi = (p >> 4).to(torch.int16)
    return torch.stack(((lo ^ 8) - 8, (hi ^ 8) - 8), dim=-1).reshape(p.shape[0], -1)


def check_int4(w, packed, s16):
    """w bf16 [r, c]; packed uint8 [r, c/2]; s16 f16 [r, c/128]."""
    r, c = w.shape
    g = c // INT4_GROUP
    w64 = w.double().view(r, g, INT4_GROUP)
    s_exact = w64.abs().amax(dim=2) / 7.0
    s64 = s16.double()
    zero = s_exact == 0
    # f16 rounding of the f32 quotient: half an f16 ulp (2^-11 relative, 2^-25 for subnormals),
    # plus the f32 step before it.
    bound = s_exact * (2.0 ** -11) * (1 + 2.0 ** -9) + 2.0 ** -25
    dev = (s64 - s_exact).abs()
    scale_ok = bool(((dev <= bound) | zero).all().item()) and bool((s64[zero] == 1).all().item())
    scale_rel = (dev / torch.where(zero, torch.ones_like(s_exact), s_exact)).masked_fill(zero, 0).max().item()
    x = (w64 / s64[..., None]).clamp(-8, 7)
    codes = unpack_int4(packed).view(r, g, INT4_GROUP).double()
    err = ((codes - x).abs() / 0.5).max().item()
    mismatches = (codes != torch.round(x)).sum().item()
    n = w.numel()
    ok = scale_ok and err <= CODE_ERR_BOUND
    return dict(ok=ok, scale_rel=scale_rel, code_err=err, mismatches=mismatches, elements=n)


# ---------------------------------------------------------------------------------------------
# Rollout process.


class Rollout:
    def __init__(self, cfg, scheme, device):
        self.scheme, self.device = scheme, device
        self.targets, specs = layout(cfg)
        self.params = {}
        for name, (kind, shape, shard_rows) in specs.items():
            if kind == "copy":
                self.params[name] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
            else:
                self.params[name], self.params[scale_name(name)] = alloc_linear(scheme, shape, shard_rows, device)
        self.ptrs = {n: t.data_ptr() for n, t in self.params.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.params.values())

    def write(self, name, src, row0=0):
        """src: rows [row0, row0 + src.shape[0]) of the trainer tensor `name`."""
        t = self.targets[name]
        w = self.params[t.param]
        if t.kind == "copy":
            w[row0: row0 + src.shape[0]].copy_(src)
            return
        s = self.params[scale_name(t.param)]
        if t.kind == "stacked":  # experts [row0, row0 + n) of [E, R, C], as the rows of [E * R, C]
            w, s, src, row0 = w.view(-1, w.shape[-1]), s.view(-1, *s.shape[2:]), src.reshape(-1, src.shape[-1]), row0 * t.rows
            if self.scheme == "fp8_block" and t.rows % BLOCK:
                raise ValueError(f"{name}: fp8_block over stacked experts needs rows in whole tiles, got {t.rows}")
        r0 = t.row0 + row0
        r1 = r0 + src.shape[0]
        if t.expert >= 0:
            w, s = w[t.expert], s[t.expert]
        if self.scheme == "fp8_per_channel":
            quant_fp8_rows(src, w[r0:r1], s[r0:r1])
        elif self.scheme == "fp8_block":
            if r0 % BLOCK or (r1 % BLOCK and r1 != w.shape[0]):
                raise ValueError(f"{name}: rows {r0}..{r1} are not whole fp8_block tiles")
            quant_fp8_blocks(src, w[r0:r1], s[r0 // BLOCK: -(-r1 // BLOCK)])
        elif self.scheme == "fp8_per_tensor":
            if row0 != 0 or src.shape[0] != t.rows:
                raise ValueError(f"{name}: fp8_per_tensor needs the whole tensor at once")
            quant_fp8_tensor(src, w[r0:r1], s[t.shard: t.shard + 1])
        else:
            quant_int4_groups(src, w[r0:r1], s[r0:r1])

    def check(self, name, w):
        """Compares what the rollout holds for trainer tensor `name` with its current value w."""
        t = self.targets[name]
        p = self.params[t.param]
        if t.kind == "copy":
            ok = torch.equal(p, w)
            return dict(ok=ok, scale_rel=0.0, code_err=0.0, mismatches=0 if ok else -1, elements=w.numel())
        s = self.params[scale_name(t.param)]
        if t.expert >= 0:
            p, s = p[t.expert], s[t.expert]
        if t.kind == "stacked":
            p, s, w = p.view(-1, p.shape[-1]), s.view(-1, *s.shape[2:]), w.reshape(-1, w.shape[-1])
            t = Target("linear", t.param, rows=p.shape[0])
        q = p[t.row0: t.row0 + t.rows]
        if self.scheme == "fp8_block":
            return check_fp8_block(w, q, s[t.row0 // BLOCK: -(-(t.row0 + t.rows) // BLOCK)])
        if self.scheme == "fp8_per_channel":
            return check_fp8(w, q, s[t.row0: t.row0 + t.rows], per_tensor=False)
        if self.scheme == "fp8_per_tensor":
            return check_fp8(w, q, s[t.shard: t.shard + 1], per_tensor=True)
        return check_int4(w, q, s[t.row0: t.row0 + t.rows])

    def ptrs_unchanged(self):
        return all(t.data_ptr() == self.ptrs[n] for n, t in self.params.items())


def rollout_main(conn, cfg, scheme, device_str):
    try:
        device = torch.device(device_str)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ro = Rollout(cfg, scheme, device)
        sync(device)
        conn.send(("ready", ro.nbytes, len(ro.params)))
        buf = None
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "tensors":  # per-tensor IPC: [(name, rebuild, args)]
                held = []
                for name, rebuild, args in msg[1]:
                    held.append(rebuild(*args))
                    ro.write(name, held[-1])
                sync(device)
                held.clear()  # drops the opened handles once the GPU is done with them
                conn.send(("ack",))
            elif op == "buffer":  # packed buffer, shared once
                rebuild, args = msg[1]
                buf = rebuild(*args)
                conn.send(("ack",))
            elif op == "chunk":  # packed chunk: (k, [(name, shape, offset, row0)])
                k, pieces = msg[1], msg[2]
                for name, shape, off, row0 in pieces:
                    n = math.prod(shape) * 2
                    ro.write(name, buf[off: off + n].view(torch.bfloat16).view(shape), row0)
                sync(device)
                conn.send(("ack", k))
            elif op == "verify":  # [(name, rebuild, args)] of the trainer's current tensors
                report = {"ptrs_unchanged": ro.ptrs_unchanged(), "tensors": {}}
                for name, rebuild, args in msg[1]:
                    report["tensors"][name] = ro.check(name, rebuild(*args))
                sync(device)
                conn.send(("verified", report))
            elif op == "stop":
                break
            else:
                raise ValueError(f"unknown message {op}")
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# Trainer side.


def expect(conn, what):
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no '{what}' from the rollout within {REPLY_TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("rollout failed:\n" + msg[1])
    if msg[0] != what:
        raise RuntimeError(f"expected '{what}' from the rollout, got '{msg[0]}'")
    return msg


def make_weights(cfg, device, seed):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    out = []
    for name, shape in trainer_shapes(cfg):
        if len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            w = w.to(torch.bfloat16)
        else:
            w = torch.empty(shape, device=device, dtype=torch.bfloat16)
            w.normal_(0.0, 0.02, generator=g)
        out.append((name, w))
    return out


def align_up(n, a=ALIGN):
    return (n + a - 1) // a * a


def plan_chunks(shapes, splittable, slot_bytes, nslots):
    """Packs (name, shape) in order into chunks of at most slot_bytes; chunk k goes to slot
    k % nslots. Returns [[(name, piece shape, absolute offset, row0, rows)]]."""
    chunks, cur, used = [], [], 0

    def close():
        nonlocal cur, used
        if cur:
            chunks.append(cur)
        cur, used = [], 0

    def add(name, shape, row0, rows, nbytes):
        nonlocal used
        if align_up(used) + nbytes > slot_bytes:
            close()
        off = align_up(used)
        cur.append((name, (rows,) + tuple(shape[1:]), off, row0, rows))
        used = off + nbytes

    for name, shape in shapes:
        row_bytes = math.prod(shape[1:]) * 2
        rows = shape[0]
        if rows * row_bytes <= slot_bytes:
            add(name, shape, 0, rows, rows * row_bytes)
            continue
        if not splittable(name):
            raise ValueError(f"{name} ({rows * row_bytes} bytes) does not fit in a packed slot of {slot_bytes} bytes "
                             "and its scheme needs the whole tensor at once; raise --buffer-mib or use --buffers 1")
        per = slot_bytes // row_bytes
        if per == 0:
            raise ValueError(f"a row of {name} does not fit in a packed slot of {slot_bytes} bytes")
        r = 0
        while r < rows:
            n = min(per, rows - r)
            add(name, shape, r, n, n * row_bytes)
            r += n
    close()
    return [[(name, shape, (k % nslots) * slot_bytes + off, row0, rows) for name, shape, off, row0, rows in chunk]
            for k, chunk in enumerate(chunks)]


def update_per_tensor(conn, weights):
    handles = []
    for name, w in weights:
        rebuild, args = reduce_tensor(w)
        handles.append((name, rebuild, args))
    conn.send(("tensors", handles))
    expect(conn, "ack")


def update_packed(conn, wmap, plan, buf, nslots, device):
    in_flight = 0
    for k, chunk in enumerate(plan):
        if in_flight == nslots:  # the slot chunk k reuses is free once chunk k - nslots is acked
            expect(conn, "ack")
            in_flight -= 1
        for name, shape, off, row0, rows in chunk:
            n = math.prod(shape) * 2
            buf[off: off + n].view(torch.bfloat16).view(shape).copy_(wmap[name][row0: row0 + rows])
        sync(device)
        conn.send(("chunk", k, [(name, shape, off, row0) for name, shape, off, row0, _ in chunk]))
        in_flight += 1
    while in_flight:
        expect(conn, "ack")
        in_flight -= 1


def measure_copy(device, nbytes, reps=10):
    """Device-to-device copy bandwidth, bytes read + written per second (median of reps)."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def run_case(args, cfg, device, weights, buf, baseline, scheme, copy_bw):
    targets, _ = layout(cfg)
    on = ("" if args.model == "llama3-8b" else "-" + args.model) + ("-stacked" if cfg.get("stacked") else "")
    case = f"{CASE_PREFIX[baseline]}{on}/{scheme}"
    params = sum(w.numel() for _, w in weights)
    linear_params = sum(w.numel() for n, w in weights if targets[n].kind != "copy")
    if scheme == "int4_group":
        floor_bytes = 2.5 * linear_params + 3.0 * (params - linear_params)
    else:
        floor_bytes = 3.0 * params
    floor_s = floor_bytes / copy_bw

    plan = None
    if baseline == "packed":
        slot_bytes = (buf.numel() // args.buffers) // ALIGN * ALIGN

        def splittable(name):
            # Stacked experts split between whole experts (whole matrices, whole tiles).
            return targets[name].kind in ("copy", "stacked") or scheme not in ("fp8_per_tensor", "fp8_block")

        plan = plan_chunks([(n, tuple(w.shape)) for n, w in weights], splittable, slot_bytes, args.buffers)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=rollout_main, args=(child, cfg, scheme, str(device)), daemon=True)
    proc.start()
    child.close()
    try:
        _, rollout_bytes, rollout_tensors = expect(conn, "ready")
        log(f"{case}: rollout holds {rollout_tensors} tensors, {rollout_bytes / 2**30:.2f} GiB")
        if baseline == "packed":
            conn.send(("buffer", reduce_tensor(buf)))
            expect(conn, "ack")
            log(f"{case}: packed buffer {buf.numel() / 2**20:.0f} MiB in {args.buffers} slot(s), "
                f"{len(plan)} chunks per update")
        wmap = dict(weights)
        times = []
        for u in range(args.warmup + args.updates):
            delta = 1e-3 if u % 2 == 0 else -1e-3
            for _, w in weights:
                w.add_(delta)
            sync(device)
            t0 = time.perf_counter()
            if baseline == "per_tensor":
                update_per_tensor(conn, weights)
            else:
                update_packed(conn, wmap, plan, buf, args.buffers, device)
            dt = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.ipc_collect()  # lets the trainer release what the rollout has closed
            if u >= args.warmup:
                times.append(dt)
            log(f"{case}: update {u}{' (warm-up)' if u < args.warmup else ''} {dt * 1e3:.2f} ms")

        layer = args.verify_layer if args.verify_layer >= 0 else cfg["layers"] + args.verify_layer
        prefix = f"model.layers.{layer}."
        names = [n for n, _ in weights if n.startswith(prefix)]
        names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        conn.send(("verify", [(n, *reduce_tensor(wmap[n])) for n in names]))
        _, report = expect(conn, "verified")
        conn.send(("stop",))
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    bad = [n for n, r in report["tensors"].items() if not r["ok"]]
    verified = not bad and report["ptrs_unchanged"]
    for n in bad:
        log(f"{case}: VERIFY FAILED {n}: {report['tensors'][n]}")
    if not report["ptrs_unchanged"]:
        log(f"{case}: VERIFY FAILED: a rollout parameter's data_ptr changed")
    lin = [r for n, r in report["tensors"].items() if targets[n].kind != "copy"]
    log(f"{case}: verified layer {layer} ({len(report['tensors'])} tensors): "
        f"{'ok' if verified else 'FAILED'}; max |q - w/s| {max(r['code_err'] for r in lin):.6f} half-steps, "
        f"max scale rel err {max(r['scale_rel'] for r in lin):.3g}, "
        f"code mismatches {sum(r['mismatches'] for r in lin)} of {sum(r['elements'] for r in lin)}")

    med = statistics.median(times)
    line = {
        "bench": "colocated",
        "case": case,
        "device": device.type,
        "params": params,
        "bytes": 2 * params,
        "seconds": round(med, 9),
        "updates": len(times),
        "floor_seconds": round(floor_s, 9),
        "ratio_to_floor": round(med / floor_s, 3),
        "min_seconds": round(min(times), 9),
        "max_seconds": round(max(times), 9),
        "warmup": args.warmup,
        "model": args.model,
        "experts": "stacked" if cfg.get("stacked") else "per-expert",
        "layers": cfg["layers"],
        "tensors": len(weights),
        "rollout_bytes": rollout_bytes,
        "floor_bytes": int(floor_bytes),
        "copy_gbps": round(copy_bw / 1e9, 3),
        "verified": verified,
        "verified_layer": layer,
        "code_mismatches": sum(r["mismatches"] for r in lin),
    }
    if baseline == "packed":
        line.update(buffer_bytes=buf.numel(), buffers=args.buffers, chunks=len(plan))
    return line, verified


# ---------------------------------------------------------------------------------------------
# CPU self-test.


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


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=tuple(MODELS))
    ap.add_argument("--experts", default="per-expert", choices=("per-expert", "stacked"),
                    help="MoE models: a tensor per expert, or each layer's experts stacked (gate_up_proj, down_proj)")
    ap.add_argument("--scheme", default="all", choices=SCHEMES + ("all",))
    ap.add_argument("--baseline", default="all", choices=BASELINES + ("all",))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; fewer for quick runs)")
    ap.add_argument("--updates", type=int, default=10, help="timed updates (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--buffer-mib", type=int, default=1024, help="packed IPC buffer, MiB")
    ap.add_argument("--buffers", type=int, default=2, choices=(1, 2),
                    help="slots of the packed buffer: 2 = double buffering with two halves")
    ap.add_argument("--copy-mib", type=int, default=2048, help="size of the copy that measures the floor")
    ap.add_argument("--verify-layer", type=int, default=-1, help="layer checked against float64 (default: last)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small shapes (hidden 256) for a quick check of the protocol")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selftest", action="store_true", help="CPU checks of quantizers, float64 checks and packing")
    args = ap.parse_args()

    if args.selftest:
        return selftest()
    if args.updates < 1 or args.warmup < 0:
        ap.error("--updates must be >= 1 and --warmup >= 0")

    cfg = dict(MODELS[args.model][1 if args.tiny else 0], stacked=args.experts == "stacked")
    if args.layers is not None:
        cfg["layers"] = args.layers
    if not (-cfg["layers"] <= args.verify_layer < cfg["layers"]):
        ap.error(f"--verify-layer outside the model's {cfg['layers']} layers")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log("no CUDA device")
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    schemes = DEFAULT_SCHEMES[args.model] if args.scheme == "all" else (args.scheme,)
    baselines = BASELINES if args.baseline == "all" else (args.baseline,)

    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"model {cfg}")
    weights = make_weights(cfg, device, args.seed)
    sync(device)
    params = sum(w.numel() for _, w in weights)
    log(f"trainer: {len(weights)} tensors, {params} params, {2 * params / 2**30:.2f} GiB bf16")
    copy_bw = measure_copy(device, args.copy_mib * 2**20)
    log(f"device copy ({args.copy_mib} MiB): {copy_bw / 1e9:.1f} GB/s read + write")
    buf = None
    if "packed" in baselines:
        buf = torch.empty(args.buffer_mib * 2**20, dtype=torch.uint8, device=device)

    all_ok = True
    for scheme in schemes:
        for baseline in baselines:
            line, ok = run_case(args, cfg, device, weights, buf, baseline, scheme, copy_bw)
            all_ok &= ok
            print(json.dumps(line, separators=(",", ":")), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
