"""The models of bench/gpu/torch_baseline.py: their shapes (Llama-3-8B, Qwen3-30B-A3B, tiny
versions of both), the trainer's HF tensors and where each lands in the rollout's fused parameters,
and the random weights the trainer starts from."""
import sys
from dataclasses import dataclass

import torch

SCHEMES = ("fp8_per_channel", "fp8_per_tensor", "int4_group", "fp8_block")
BLOCK = 128  # fp8_block tile side
FP8_MAX = 448.0
INT4_GROUP = 128
F16_MAX = 65504.0

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
